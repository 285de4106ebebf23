"""The harness's wait for an idle machine before each timed repetition."""

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
