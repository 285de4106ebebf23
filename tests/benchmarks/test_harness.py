"""The harness's wait for an idle machine before each timed repetition, and the train
scenario's bound arithmetic."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.harness import wait_until_idle

_SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc/stat")
def test_waits_while_every_core_is_busy():
    seconds = 1.5
    spinners = [
        subprocess.Popen([sys.executable, "-c", _SPIN.format(s=seconds)])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        time.sleep(0.3)  # let them start spinning
        waited = wait_until_idle(timeout=8.0)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    # it cannot call the machine idle before the spinners end (~1.2 s after it started)
    assert waited >= 1.0, waited
    assert waited <= 8.5, waited


def test_train_bound_arithmetic():
    from benchmarks.train import bound

    # 2 cores; Spark hands the rows over in 0.62 s using 1.16 core-s; an in-memory epoch takes
    # 0.56 s and 0.765 CPU-s: the first epoch needs (1.16 + 0.765) / 2 = 0.9625 s at least,
    # so 5 epochs take 0.9625 + 4 * 0.56 s against 5 * 0.56 s in memory
    b = bound(5, 2, (0.62, 1.16), (0.56, 0.765))
    assert b["first_epoch_min_seconds"] == pytest.approx(0.9625)
    assert b["best_ratio"] == pytest.approx(2.8 / 3.2025)
    # Spark's wall time dominates when it cannot use the cores (one core, a slow handoff)
    b = bound(10, 1, (2.0, 1.0), (0.5, 0.5))
    assert b["first_epoch_min_seconds"] == pytest.approx(2.0)
    assert b["best_ratio"] == pytest.approx(5.0 / 6.5)
