"""The README's main job: `dataplane demo` trains on digits through the push path."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_demo_trains_to_a_real_accuracy():
    exe = os.path.join(os.path.dirname(sys.executable), "dataplane")
    proc = subprocess.run(
        [exe, "demo", "--epochs", "8"], capture_output=True, text=True, timeout=420,
        env=dict(os.environ, PYSPARK_PYTHON=sys.executable),
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-3000:]
    pushed = re.search(r"pushed (\d+) rows .* rows per node \{0: (\d+), 1: (\d+)\}", out)
    assert pushed, out
    total, a, b = map(int, pushed.groups())
    assert total == 8 * 1438 and a == b == total // 2
    acc = float(re.search(r"accuracy (\d\.\d+)", out).group(1))
    assert acc >= 0.85, out  # a 64-16-10 MLP reaches ~0.97 on digits
    assert re.search(r"training done on every node \d+\.\d s after the last push", out), out
    assert re.search(r"inference on 359 held-out rows in \d+\.\d s", out), out
