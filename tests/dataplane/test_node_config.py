"""The node config: one typed value from ``run()`` through the launch task to the node process."""

from __future__ import annotations

import inspect
import os
import pickle
import stat

import pytest

from dataplane.node.config import NodeConfig


def _config(**kw) -> NodeConfig:  # type: ignore[no-untyped-def]
    base = {"cluster_id": "c0ffee00", "driver": "grpc://127.0.0.1:40000", "secret": "s3cret-token"}
    return NodeConfig(**{**base, **kw})


def test_round_trips_through_config_json(tmp_path):
    cfg = _config(
        port_range=(41000, 41010), tensorboard=True, log_dir="/tmp/tb", default_fs="hdfs://nn:8020",
        tls_cert="-----BEGIN CERTIFICATE-----\nX\n", tls_key="-----BEGIN PRIVATE KEY-----\nY\n",
    ).for_node(3, "10.0.0.7")
    path = str(tmp_path / "config.json")
    cfg.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # it holds the secret
    back = NodeConfig.load(path)
    assert back == cfg
    assert back.port_range == (41000, 41010) and back.node_id == 3 and back.bind_host == "10.0.0.7"
    assert back.tls == {"cert": cfg.tls_cert, "key": cfg.tls_key} and back.scheme == "grpc+tls"
    with pytest.raises(FileExistsError):  # never overwrites: each node's file is new
        cfg.save(path)


def test_secrets_stay_out_of_repr():
    cfg = _config(tls_cert="CERT-PEM", tls_key="KEY-PEM")
    assert "s3cret-token" not in repr(cfg) and "KEY-PEM" not in repr(cfg)
    from dataplane.node.launcher import NodeLauncher

    launcher = NodeLauncher(cfg, b"payload")
    assert "s3cret-token" not in repr(launcher) and "KEY-PEM" not in repr(launcher)
    assert pickle.loads(pickle.dumps(launcher)) == launcher  # shipped to the Spark tasks
    assert launcher.start_timeout == cfg.reservation_timeout


def test_plaintext_and_half_tls():
    assert _config().tls is None and _config().scheme == "grpc"
    with pytest.raises(ValueError, match="together"):
        _config(tls_cert="CERT-PEM")


def test_run_takes_its_defaults_from_the_node_config():
    from dataplane.driver.startup import run

    params = inspect.signature(run).parameters
    for name in ("buffer_bytes", "cache_bytes", "heartbeat_interval", "heartbeat_timeout",
                 "reservation_timeout", "stop_grace"):
        assert params[name].default == getattr(NodeConfig, name), name


def test_node_work_dirs_go_to_spark_local_dirs_spread_by_node(tmp_path):
    # a cache spilling gigabytes belongs on the disks given to spark.local.dir, not in /tmp;
    # Python workers get the executor's block manager dirs in SPARK_LOCAL_DIRS
    from dataplane.node.launcher import work_root

    disks = [tmp_path / "d1", tmp_path / "d2"]
    for d in disks:
        (d / "blockmgr-1").mkdir(parents=True)
    env = {"SPARK_LOCAL_DIRS": f"{disks[0]}/blockmgr-1,{disks[1]}/blockmgr-1/"}
    assert [work_root(env, i) for i in range(3)] == [str(disks[0]), str(disks[1]), str(disks[0])]
    # outside Spark, or with a local dir gone: the system temp directory
    assert work_root({}, 0) is None
    assert work_root({"SPARK_LOCAL_DIRS": str(tmp_path / "gone" / "blockmgr-1")}, 0) is None


def test_node_environment_sets_arenas_unless_the_task_did_and_a_tmpdir_of_its_own():
    # the node frees every received chunk from many threads; with glibc's default of up to 8
    # arenas per core the memory went back to the kernel and was faulted in and zeroed again
    from dataplane.node.launcher import node_environment

    arenas = str(max(2, os.cpu_count() or 2))
    assert node_environment({"PATH": "/bin"}, []) == {"PATH": "/bin", "MALLOC_ARENA_MAX": arenas}
    assert node_environment({"MALLOC_ARENA_MAX": "8"}, [])["MALLOC_ARENA_MAX"] == "8"  # the user's wins
    assert node_environment({"MALLOC_ARENA_MAX": ""}, [])["MALLOC_ARENA_MAX"] == arenas  # empty: unset
    # the node's temp files live in its work directory, which goes however the node ends
    assert node_environment({"TMPDIR": "/big"}, [], "/w/node0/tmp")["TMPDIR"] == "/w/node0/tmp"
    mine = node_environment({"PYTHONPATH": "/a"}, ["/jobs/code.zip", "/a"])
    assert mine == {"PYTHONPATH": "/jobs/code.zip" + os.pathsep + "/a", "MALLOC_ARENA_MAX": arenas}
