"""The README's quick start runs as pasted, and the README points only inside the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _quick_start() -> str:
    """The first ```python block under the '## Quick start' heading."""
    text = README.read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)
    assert match, "README's Quick start section has no ```python block"
    return match.group(1)


@pytest.mark.slow
@pytest.mark.cluster
def test_the_quick_start_runs_as_written(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(_quick_start())
    env = {
        k: v
        for k, v in os.environ.items()
        # What the test suite sets for itself must not be what makes the snippet work.
        if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH")
    }
    env.update(SPARK_LOCAL_IP="127.0.0.1", TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(
        [sys.executable, str(script)],  # the stack's Python, from a folder outside the checkout
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = [ln for ln in out.stdout.splitlines() if ln.startswith("FeedReport(")]
    assert len(report) == 1, out.stdout[-2000:]
    # 1000 rows, 2 epochs, split evenly over the 2 nodes, nothing dropped.
    assert "rows=2000," in report[0], report[0]
    assert "rows_per_node={0: 1000, 1: 1000}" in report[0], report[0]
    assert "dropped_for_balance=0" in report[0], report[0]


def test_the_readme_keeps_the_two_commands():
    text = README.read_text()
    assert "bash .ci/setup current && SPARK_LOCAL_IP=127.0.0.1 .venvs/current/bin/dataplane demo" in text
    assert "\nbash .ci/test\n" in text
    assert "bash .ci/test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md", "docs/api.md", "benchmarks/RESULTS.md"])
def test_links_stay_inside_the_repository(doc):
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", path.read_text()):
        if "://" in target:
            continue
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{doc} links outside the repository: {target}"
        assert resolved.exists(), f"{doc} links a missing file: {target}"
    assert "shared/API.md" not in path.read_text()
