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
    fed = re.search(r"the feed gave fit ([\d,]+) rows \(([\d.]+) MB: 8 epochs of 1438 training and "
                    r"359 validation rows\) in [\d.]+ s: [\d,]+ rows/s, [\d.]+ MB/s; the model "
                    r"waited for input ([\d.]+)% of that time: (.*)\n", out)
    assert fed, out
    rows = int(fed.group(1).replace(",", ""))
    assert 8 * (1438 + 359) - 8 * 4 <= rows <= 8 * (1438 + 359)  # a few dropped for balance
    share = float(fed.group(3))
    assert 0.0 <= share <= 100.0
    # the verdict follows the share: "(input-bound)" was printed beside a 1.2% wait
    assert ("the model, not the feed, set the pace" in fed.group(4)) == (share < 10), fed.group(0)
    assert ("input-bound" in fed.group(4)) == (share >= 50), fed.group(0)
    jobs = re.search(r"Spark jobs that pushed data: (\d+) .* rows received per node \{0: (\d+), "
                     r"1: (\d+)\}, of which (\d+) left out so that every worker takes the same "
                     r"number of batches", out)
    assert jobs, out
    assert int(jobs.group(1)) == 2  # the training and the validation DataFrame, once each
    received = int(jobs.group(2)) + int(jobs.group(3))
    assert received == 8 * (1438 + 359)
    assert received - int(jobs.group(4)) == rows  # the two lines add up
    assert re.search(r"node 0 \(chief 0\) @ 127\.0\.0\.1:\d+, node 1 \(worker 0\) @", out), out
    val = float(re.search(r"validation accuracy (\d\.\d+)", out).group(1))
    acc = float(re.search(r"accuracy (\d\.\d+)\n", out[out.index("inference on"):]).group(1))
    assert acc >= 0.85 and val >= 0.85, out  # a 64-16-10 MLP reaches ~0.97 on digits
    assert re.search(r"inference on 359 held-out rows in \d+\.\d s", out), out
    # TensorFlow's start-up notices on a machine without a GPU (some logged as errors, none
    # silenced by TF_CPP_MIN_LOG_LEVEL) are not shown: the driver's and the nodes' alike
    for notice in ("absl::InitializeLog", "oneDNN custom operations", "Could not find cuda drivers",
                   "failed call to cuInit", "Unable to register cu", "Coordination agent"):
        assert notice not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("flag, value", [("--nodes", "0"), ("--epochs", "0"), ("--batch-size", "-1"), ("--nodes", "two")])
def test_demo_refuses_a_bad_number_before_starting_spark(flag, value):
    # --nodes 0 started Spark and failed naming num_nodes; --batch-size -1 failed in a node
    exe = os.path.join(os.path.dirname(sys.executable), "dataplane")
    proc = subprocess.run([exe, "demo", flag, value], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"argument {flag}: expected a whole number >= 1, got" in proc.stderr, proc.stderr
    assert "Spark" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
