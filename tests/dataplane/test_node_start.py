"""A node that cannot start says why: the launch step's and the node's own last words reach
the error, and nothing of the node's work directory is left behind (no Spark needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import dataplane.node.reaper as reaper
from dataplane.node.process import NodeLaunchError, spawn_detached
from dataplane.node.reaper import TOLD_LAUNCHER


def _workdir(tmp_path, *, told: bool = False) -> str:  # type: ignore[no-untyped-def]
    workdir = tmp_path / "dataplane-c0ffee00-node0-x"
    (workdir / "tmp").mkdir(parents=True)
    (workdir / "config.json").write_text("{ not json: the node fails as it loads it")
    (workdir / "payload.pkl").write_bytes(b"\x80")
    if told:
        (workdir / TOLD_LAUNCHER).write_text("")
    return str(workdir / "config.json")


def _reap(config: str, ready_fd: int) -> int:
    """The reaper as the launch step runs it (by path, in a session of its own: it ends every
    other process of its group when the node has ended)."""
    return subprocess.run([sys.executable, "-S", reaper.__file__, config, str(ready_fd)],
                          pass_fds=(ready_fd,), start_new_session=True, timeout=120).returncode


def test_a_node_that_dies_before_a_word_leaves_its_log_for_the_launcher(tmp_path):
    # The node died before it told the launcher anything: the reaper used to remove the
    # whole directory at once, often before the launcher, woken by the pipe closing, read the
    # log, so the error said "(no node log)". node.log stays; the rest (the secret) goes.
    config = _workdir(tmp_path)
    r, w = os.pipe()
    code = _reap(config, w)
    os.close(w)
    assert os.read(r, 100) == b""  # the launcher sees the pipe close without a word
    os.close(r)
    workdir = os.path.dirname(config)
    assert code != 0 and sorted(os.listdir(workdir)) == ["node.log"]
    log = open(os.path.join(workdir, "node.log")).read()
    assert "Traceback" in log and "JSONDecodeError" in log, log


def test_a_node_that_told_the_launcher_leaves_nothing(tmp_path):
    config = _workdir(tmp_path, told=True)
    r, w = os.pipe()
    assert _reap(config, w) != 0
    os.close(w)
    os.close(r)
    assert not os.path.exists(os.path.dirname(config))


def test_a_script_named_like_a_standard_module_on_the_path_is_named_with_the_fix(tmp_path):
    # A driver script called types.py, whose folder Spark puts on the task's sys.path: the
    # node's new interpreter imports it for the library's 'types' and the launch step dies at
    # once. It used to fail as "exited before registering" with "(no node log)".
    shipped = tmp_path / "job"
    shipped.mkdir()
    (shipped / "types.py").write_text("raise ImportError('this is the user\\'s script')\n")
    config = _workdir(tmp_path)
    r, w = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shipped), *sys.path])}
    with pytest.raises(NodeLaunchError) as err:
        spawn_detached(config, w, env)
    os.close(r)
    os.close(w)
    msg = str(err.value)
    assert "the node's launch step" in msg and "exited with code 1 before starting the node" in msg, msg
    assert (f"{shipped / 'types.py'} has the name of the standard-library module 'types'" in msg
            and "rename that file" in msg), msg
    assert "this is the user's script" in err.value.output, err.value.output
