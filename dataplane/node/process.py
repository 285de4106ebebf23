"""The TF node process: ``python -m dataplane.node.process``.

Started (spawned, never forked: gRPC does not survive fork) by the launch task on an executor,
detached from the Spark worker so the task can return and free its slot. In order, it:

1. binds its Flight server and reserves its TF port (port 0 or the configured range),
2. registers with the driver's control server and tells the launch task (through a pipe),
3. waits for the cluster spec, exports ``TF_CONFIG``, starts TensorBoard on the chief,
4. runs ``main(args, ctx)`` and reports its outcome (the traceback if it raised),
5. stays up (serving metrics) until the driver says stop, then exits.

A heartbeat thread pings the driver; if the driver is unreachable for ``heartbeat_timeout``
seconds the node exits by itself, so nothing outlives a dead driver.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from dataplane.node.config import NodeConfig
from dataplane.node.logtail import FINAL_BYTES, LogTail, clip
from dataplane.node.reaper import TOLD_LAUNCHER

__all__ = ["spawn_detached", "NodeShutdown"]

logger = logging.getLogger("dataplane.node.process")


class NodeShutdown(BaseException):
    """Raised inside ``main`` when the driver shut the cluster down before data arrived.

    A ``BaseException`` so that user code's ``except Exception`` does not swallow it; the node
    treats it as a clean stop, not as a failure of ``main``.
    """


def spawn_detached(config_path: str, ready_fd: int, env: dict[str, str]) -> int:
    """Start the node reparented away from the Spark worker; returns at once.

    The intermediate process exits immediately, so the node never becomes a zombie of a
    long-lived Python worker; it leaves the node running under its reaper
    (:mod:`dataplane.node.reaper`), which removes the node's work directory when it ends.
    Returns the intermediate's exit code.
    """
    # The intermediate is the reaper script itself (standard library only, run with -S): as
    # `python -m dataplane.node.process` it imported numpy and pyarrow only to start a
    # process, 0.4 s of CPU per node.
    proc = subprocess.Popen(
        [sys.executable, "-S", os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py"),
         "--detach", config_path, str(ready_fd)],
        pass_fds=(ready_fd,),
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,  # (the reaper it starts writes to node.log instead)
        close_fds=True,
    )
    _, err = proc.communicate()
    if proc.returncode:
        text = err.decode("utf-8", "replace")[-4000:]
        raise NodeLaunchError(
            f"the node's launch step ({sys.executable} -S {os.path.basename(proc.args[2])}) "
            f"exited with code {proc.returncode} before starting the node"
            f"{shadowing_hint(env, text)}",
            text,
        )
    return proc.returncode


class NodeLaunchError(RuntimeError):
    """The launch step could not start the node process; ``output`` is what it wrote."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


def shadowing_hint(env: dict[str, str], output: str) -> str:
    """If a file on the node's PYTHONPATH has a standard-library module's name (a driver script
    called types.py or random.py, shipped with the job), the node's new interpreter imports it
    instead of the library's and fails as it starts: say which file to rename ("" if none)."""
    names = getattr(sys, "stdlib_module_names", ())
    for entry in env.get("PYTHONPATH", "").split(os.pathsep):
        if not entry or not os.path.isdir(entry):
            continue
        for name in sorted(names):
            path = os.path.join(entry, name + ".py")
            if os.path.isfile(path) and path in output:
                return (f": {path} has the name of the standard-library module {name!r}, and "
                        f"the node's Python (started with {entry} on its PYTHONPATH, as the "
                        f"Spark task had it on sys.path) imports it instead; rename that file")
    return ""


def _load_payload(path: str, cloudpickle: Any) -> tuple[Any, Any]:
    """``(main, args)`` as the driver pickled them; a module they refer to that this node
    cannot import fails with the fix (pickled functions of a module travel by name)."""
    try:
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"{e}: main(args, ctx) or its args refer to module {e.name!r}, which the node's "
            f"Python ({sys.executable}) cannot import. Functions defined in a module travel by "
            f"name, so the executors need that module: ship it with "
            f"spark.sparkContext.addPyFile(path) or spark-submit --py-files, or install it on "
            f"every executor (or define main in the driver script itself).",
            name=e.name,
        ) from e


def _set_pdeathsig() -> None:
    """Make a child (TensorBoard) die with its node, even on SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - not Linux
        pass


def _callers_line(exc: BaseException) -> str:
    """``file, line N`` of the innermost frame of ``exc``'s traceback outside this project's
    packages and installed libraries: the line in the user's code that made the call."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ours = tuple(os.path.join(root, p) + os.sep for p in ("dataplane", "feeders", "formats"))
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if not f.filename.startswith(ours) and "site-packages" not in f.filename]
    f = (mine or frames)[-1]
    return f"{f.filename}, line {f.lineno}"


class _Node:
    def __init__(self, config_path: str, ready_fd: int) -> None:
        self.cfg = NodeConfig.load(config_path)
        if self.cfg.node_id is None or self.cfg.bind_host is None:
            raise ValueError(f"{config_path}: the launch task did not set node_id and bind_host")
        self.workdir = os.path.dirname(config_path)
        self.ready_fd = ready_fd
        self.node_id: int = self.cfg.node_id
        self.secret = self.cfg.secret
        self.stop_event = threading.Event()
        self.stop_now = threading.Event()  # the driver aborts: main gets 1 s, not stop_grace
        self.role: str | None = None  # known once the driver sends the topology
        self.driver_lost = threading.Event()
        self.main_finished = threading.Event()
        self.tensorboard: subprocess.Popen | None = None
        self.server = None
        self.buffer = None
        # what the node prints, for the driver to show (run(log_to_driver=True))
        self.log_tail = LogTail(os.path.join(self.workdir, "node.log")) if self.cfg.log_to_driver else None
        self._log_lock = threading.Lock()  # one message with log text in flight: lines stay in order
        self._log_unsent = ""  # text of a message that did not arrive; goes with the next one

    def _log_text(self, *, final: bool = False) -> dict[str, str]:
        """``{"log": text}`` with what the node wrote since the last call, or ``{}``."""
        if self.log_tail is None:
            return {}
        if final:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
        text = self.log_tail.take(final=final)
        return {"log": text} if text else {}

    def _send_with_log(self, client, name: str, body: dict[str, Any], *, timeout: float,  # type: ignore[no-untyped-def]
                       final: bool = False) -> dict[str, Any]:
        """Send control action ``name`` carrying what the node wrote since the last message.

        One such message at a time, so the driver prints the lines in the order written (a
        heartbeat and ``done`` could otherwise overtake each other); the text of one that
        fails goes with the next.
        """
        with self._log_lock:
            text = clip(self._log_unsent + self._log_text(final=final).get("log", ""), FINAL_BYTES)
            self._log_unsent = ""
            try:
                return self._action(client, name, {**body, "log": text} if text else body, timeout=timeout)
            except Exception:
                self._log_unsent = text
                raise

    # -- helpers ----------------------------------------------------------------------------
    def _tell_launcher(self, msg: dict[str, Any]) -> None:
        if self.ready_fd < 0:
            return
        try:
            open(os.path.join(self.workdir, TOLD_LAUNCHER), "w").close()  # (see reaper.reap)
        except OSError:
            pass
        try:
            os.write(self.ready_fd, (json.dumps(msg) + "\n").encode())
            os.close(self.ready_fd)
        except OSError:
            pass
        self.ready_fd = -1

    def _driver(self):  # type: ignore[no-untyped-def]
        from dataplane import rpc

        return rpc.connect_driver(self.cfg.driver, self.cfg.tls)

    def _action(self, client, name: str, body: dict[str, Any], timeout: float = 15.0):  # type: ignore[no-untyped-def]
        from dataplane.rpc import do_json_action

        body = dict(body, node_id=self.node_id)
        return do_json_action(client, self.secret, name, body, timeout=timeout)

    def _agree(self, key: str, n: int, value: Any) -> tuple[int, Any]:
        """The driver's answer to this node's ``n``-th ``ctx.agree(key, value)``: (the first
        asking node's id, its value)."""
        client = self._driver()
        try:
            reply = self._action(client, "agree", {"key": key, "n": n, "value": value}, timeout=60.0)
        finally:
            client.close()
        return int(reply["node_id"]), reply["value"]

    def _bind_flight(self, host: str):  # type: ignore[no-untyped-def]
        import pyarrow.flight as flight

        from dataplane.node.server import InferenceBroker, NodeServer
        from dataplane.rpc import PortRangeError
        from feeders.buffer import FeedBuffer

        self.buffer = FeedBuffer(
            self.cfg.buffer_bytes,
            cache_dir=os.path.join(self.workdir, "cache"),
            cache_bytes=self.cfg.cache_bytes,
        )
        self.broker = InferenceBroker()
        self.broker.waits_for_data = self.buffer.waits_for_data
        rng = self.cfg.port_range
        ports = [0] if not rng else list(range(rng[0], rng[1] + 1))
        scheme = self.cfg.scheme
        tls = None
        if self.cfg.tls_cert:
            tls = [flight.CertKeyPair(cert=self.cfg.tls_cert, key=self.cfg.tls_key)]
        for port in ports:
            try:
                return NodeServer(
                    f"{scheme}://{host}:{port}",
                    self.secret,
                    buffer=self.buffer,
                    broker=self.broker,
                    on_shutdown=self.request_stop,
                    node_id=self.node_id,
                    tls_certificates=tls,
                )
            except (OSError, flight.FlightError, pa_error()) as e:  # port taken
                last = e
                continue
        raise PortRangeError(
            f"node {self.node_id}: no free port for its Flight server in port_range "
            f"{rng[0]}-{rng[1]} on {host} ({len(ports)} tried; last error: {last}). Widen "
            f"port_range or stop what holds those ports."
        )

    def request_stop(self, now: bool = False) -> None:
        """Stop the node: datasets end, serving ends; ``now`` (the driver is aborting: an
        exception, Ctrl-C) gives a busy main one second instead of ``stop_grace``."""
        if now:
            self.stop_now.set()
        self.stop_event.set()
        if self.buffer is not None:
            self.buffer.stop()
        if getattr(self, "broker", None) is not None:
            self.broker.stop()

    # -- heartbeat ------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        interval = float(self.cfg.heartbeat_interval)
        timeout = float(self.cfg.heartbeat_timeout)
        client = self._driver()
        last_ok = time.monotonic()
        while not self.driver_lost.is_set():
            try:
                reply = self._send_with_log(client, "heartbeat", {}, timeout=max(interval * 3, 3.0))
                last_ok = time.monotonic()
                if reply.get("stop"):
                    self.request_stop()
            except Exception as e:  # noqa: BLE001 - any failure counts as a missed beat
                if time.monotonic() - last_ok > timeout:
                    logger.error(
                        "node %d: driver unreachable for %.0f s (%s); exiting",
                        self.node_id,
                        timeout,
                        e,
                    )
                    self.driver_lost.set()
                    self.request_stop()
                    self._hard_exit(3)
            time.sleep(interval)

    def _hard_exit(self, code: int) -> None:
        self._kill_tensorboard()
        logging.shutdown()
        _remove_workdir(self.workdir)
        os._exit(code)

    def _kill_tensorboard(self) -> None:
        tb = self.tensorboard
        if tb is not None and tb.poll() is None:
            tb.terminate()
            try:
                tb.wait(5)
            except subprocess.TimeoutExpired:
                tb.kill()

    # -- lifecycle ------------------------------------------------------------------------
    def run(self) -> int:
        from dataplane.rpc import bind_port

        host = self.cfg.bind_host
        rng = self.cfg.port_range
        try:
            self.server = self._bind_flight(host)
            tf_sock = bind_port(host, rng)
            tb_sock = None
            if self.cfg.tensorboard:
                tb_sock = bind_port(host, rng)
            client = self._driver()
            reg = {
                "host": host,
                "flight_port": self.server.port,
                "flight_scheme": self.cfg.scheme,
                "tf_port": tf_sock.getsockname()[1],
                "tensorboard_port": tb_sock.getsockname()[1] if tb_sock else None,
                "pid": os.getpid(),
                "hostname": socket.gethostname(),
            }
            reply = self._action(client, "register", reg, timeout=30.0)
            if not reply.get("accepted"):
                raise RuntimeError(f"the driver refused registration: {reply.get('reason')}")
        except BaseException as e:  # noqa: BLE001 - reported to the launch task, then exit
            self._tell_launcher(
                {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            )
            logger.exception("node %d failed to start", self.node_id)
            return 2
        self._tell_launcher({"ok": True, **reg})
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        threading.Thread(target=self._watchdog, name="watchdog", daemon=True).start()

        topology = self._wait_topology(client)
        if topology is None:
            self.main_finished.set()
            self._exit_cleanly(client, tf_sock, tb_sock)
            return 0
        me = topology.node(self.node_id)
        self.role = me.role
        tf_sock.close()
        os.environ["TF_CONFIG"] = json.dumps(topology.tf_config(me))
        log_dir = self.cfg.log_dir
        tb_error = None
        if tb_sock is not None and me.role == "chief":
            tb_port = tb_sock.getsockname()[1]
            tb_sock.close()
            try:
                self._start_tensorboard(host, tb_port, log_dir)
            except Exception as e:  # noqa: BLE001 - reported as this node's failure
                tb_error = e
        elif tb_sock is not None:
            tb_sock.close()
        self._run_main(client, me, topology, log_dir, tb_error)
        # Stay up for metrics and inference answers until the driver says stop.
        while not self.stop_event.wait(0.5):
            pass
        self._exit_cleanly(client, None, None)
        return 0

    def _watchdog(self) -> None:
        """After a stop request, give main ``stop_grace`` seconds, then leave regardless."""
        self.stop_event.wait()
        t0 = time.monotonic()
        while True:
            # a parameter server's main is server.join(), which never returns, and a driver
            # that aborts (stop "now", which may come after the heartbeat's stop) waits for
            # nobody: one second for them, stop_grace otherwise
            quick = self.role == "ps" or self.stop_now.is_set()
            grace = min(1.0, float(self.cfg.stop_grace)) if quick else float(self.cfg.stop_grace)
            left = t0 + grace - time.monotonic()
            if self.main_finished.wait(max(0.0, min(left, 0.25))) or left <= 0:
                break
        if not self.main_finished.is_set():
            logger.warning("node %d: main did not return after stop; exiting anyway", self.node_id)
            try:
                self._send_with_log(self._driver(), "done", {"exiting": True}, timeout=5.0, final=True)
            except Exception:  # noqa: BLE001 - the driver may already be gone
                pass
            self._hard_exit(0)

    def _wait_topology(self, client):  # type: ignore[no-untyped-def]
        from dataplane.topology import Topology

        deadline = time.monotonic() + float(self.cfg.reservation_timeout) + 30
        while time.monotonic() < deadline and not self.stop_event.is_set():
            try:
                reply = self._action(client, "wait_spec", {"wait": 5.0}, timeout=20.0)
            except Exception:  # noqa: BLE001 - the heartbeat thread decides if the driver is gone
                time.sleep(1.0)
                continue
            if reply.get("stop"):
                return None
            if reply.get("ready"):
                return Topology.from_json(reply["topology"])
        return None

    def _start_tensorboard(self, host: str, port: int, log_dir: str | None) -> None:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            from dataplane.errors import StackError

            raise StackError(
                f"run(tensorboard=True): the tensorboard package is not installed on the chief's "
                f"executor ({socket.gethostname()}, {sys.executable}). TF >= 2.20 no longer "
                f"installs it: pip install 'spark-tf-dataplane[tf]' or pip install tensorboard."
            )
        os.makedirs(log_dir, exist_ok=True)  # type: ignore[arg-type]
        self.tensorboard = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                "--logdir",
                str(log_dir),
                "--host",
                host,
                "--port",
                str(port),
            ],
            stdin=subprocess.DEVNULL,
            stdout=open(os.path.join(self.workdir, "tensorboard.log"), "ab"),
            stderr=subprocess.STDOUT,
            preexec_fn=_set_pdeathsig,
        )

    def _run_main(self, client, me, topology, log_dir, startup_error=None) -> None:  # type: ignore[no-untyped-def]
        from pyspark import cloudpickle

        from dataplane.node.context import NodeContext

        ok, tb_text = True, ""
        try:
            if startup_error is not None:
                raise startup_error
            main, args = _load_payload(os.path.join(self.workdir, "payload.pkl"), cloudpickle)
            self.server.main_state = "running"
            ctx = NodeContext(
                node=me,
                topology=topology,
                buffer=self.buffer,
                broker=self.broker,
                log_dir=log_dir,
                default_fs=self.cfg.default_fs,
                stop_event=self.stop_event,
                polls_stop=self.server.main_polls_stop,
                agree=self._agree,
                saves=self.server.saves,
            )
            main(args, ctx)
        except NodeShutdown:
            pass
        except BaseException:  # noqa: BLE001 - the traceback goes to the driver
            from feeders.buffer import FeedStopped

            exc = sys.exc_info()[1]
            if not (isinstance(exc, FeedStopped) and self.stop_event.is_set()):
                # at once, before the traceback is formatted: the node may already end main's
                # pass as abandoned, and a driver reading "pass closed, main running" in between
                # took it for a pass left early and returned from train() without the error
                self.server.main_state = "failed"
                ok, tb_text = False, traceback.format_exc()
                logger.error("node %d: main raised\n%s", self.node_id, tb_text)
            else:  # not a failure, but the code after that call in main did not run
                where = _callers_line(exc)
                logger.warning(
                    "node %d: the shutdown stopped main where it waited for data (%s: %s); the "
                    "rest of main did not run.", self.node_id, where, exc,
                )
        self.server.main_state = "finished" if ok else "failed"
        if not self.broker.serving:
            from dataplane.errors import error_summary

            how = "returned" if ok else f"raised ({error_summary(tb_text)})"
            self.broker.close(
                f"main {how} without serving inference, so nothing will answer; call "
                f"ctx.serve(predict) in main on every chief and worker before "
                f"cluster.inference, and see cluster.shutdown() for main's error"
            )
        self.buffer.consumer_finished()
        self.main_finished.set()
        done = {"ok": ok, "traceback": tb_text[-20000:]}
        if not ok and self.buffer.empty_pass_note:  # why a pass main read got nothing
            done["note"] = self.buffer.empty_pass_note
        for _ in range(3):
            try:
                reply = self._send_with_log(client, "done", done, timeout=10.0, final=True)
                if reply.get("stop"):
                    self.request_stop()
                break
            except Exception:  # noqa: BLE001
                time.sleep(1.0)

    def _exit_cleanly(self, client, *socks) -> None:  # type: ignore[no-untyped-def]
        for s in socks:
            if s is not None:
                s.close()
        self._kill_tensorboard()
        try:
            self._send_with_log(client, "done", {"exiting": True}, timeout=5.0, final=True)
        except Exception:  # noqa: BLE001 - the driver may already be gone
            pass
        if self.server is not None:
            threading.Thread(target=self.server.shutdown, daemon=True).start()


def _remove_workdir(path: str) -> None:
    # DATAPLANE_KEEP_NODE_DIR=1 keeps config, payload and node.log for debugging.
    if os.environ.get("DATAPLANE_KEEP_NODE_DIR") != "1":
        shutil.rmtree(path, ignore_errors=True)


def pa_error():  # type: ignore[no-untyped-def]
    import pyarrow as pa

    return pa.ArrowException


def _children_from_a_forkserver() -> None:
    """Make multiprocessing's default start method "forkserver" in this process.

    main runs beside gRPC's, Flight's and TensorFlow's threads: a child forked from here
    inherits whatever lock one of them held at that moment, and may wait on it for ever (a
    multiprocessing.Pool in main hung its node in two runs of three). Children start from a
    clean server process instead, as Python 3.14 does by default on Linux. Only the default
    changes, as 3.14 changes it: a main that calls ``set_start_method`` itself still may
    (with ``set_start_method("forkserver")`` here, its call would raise "context has already
    been set")."""
    import multiprocessing.context as mpc

    default = getattr(mpc, "_default_context", None)
    contexts = getattr(mpc, "_concrete_contexts", {})
    if hasattr(default, "_default_context") and "forkserver" in contexts:
        default._default_context = contexts["forkserver"]  # type: ignore[union-attr]


def _main(argv: list[str]) -> int:
    config_path, ready_fd = argv[1], int(argv[2])  # (argv[0]: "--run")
    # a crash in native code (SIGSEGV, SIGABRT) writes every thread's Python stack to node.log,
    # which the reaper's exit report carries to the driver's error (dataplane.node.exitreport)
    faulthandler.enable()
    # Our own INFO lines, other libraries' from WARNING up (as in a plain TF program: at INFO,
    # TensorFlow logs a line for every all-reduce it builds under MWMS)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for ours in ("dataplane", "feeders", "formats"):
        logging.getLogger(ours).setLevel(logging.INFO)
    # stdout is a file: without this, main's prints would reach node.log (and the driver)
    # only when a block of them filled up
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    _children_from_a_forkserver()
    node = _Node(config_path, ready_fd)
    # The driver asks nicely; a plain SIGTERM (executor killed) also stops the node.
    signal.signal(signal.SIGTERM, lambda *_: node.request_stop())
    try:
        code = node.run()
    except BaseException:  # noqa: BLE001 - exit below regardless: a normal interpreter exit
        # would wait on Flight handler threads that may block on the feed buffer forever
        logging.getLogger(__name__).exception("node %d: failed outside main", node.node_id)
        code = 1
    node._kill_tensorboard()
    logging.shutdown()
    _remove_workdir(node.workdir)
    os._exit(code)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
