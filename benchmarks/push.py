"""Push scenario: a cached Spark DataFrame into TF nodes, ours against TFoS and two ceilings.

Tables: ``numeric``, ``mnist`` and ``image`` (48 KiB rows, issue #18: where flight-push against
flight-raw shows what the data plane adds per chunk rather than per row).

Paths (all read the same cached DataFrame; rows are counted where they are consumed):

* ``flight-push`` (ours): ``dataplane.run(spark, main, num_nodes=2)`` once, then one
  ``cluster.train(df)`` per repetition. Each node's ``main`` iterates ``ctx.dataset()`` (one
  iteration per pushed epoch), which materialises every batch as eager tensors, counts the rows
  and, at the end of the epoch, writes its count to ``workdir``. A repetition is timed from the
  ``train`` call until every node has reported the epoch: ``train`` itself returns once the
  data is in the nodes' buffers, so stopping there would leave the consumer's share out.
* ``spark-mapinarrow`` (ceiling): ``df.mapInArrow`` that only counts rows, then ``collect``:
  what Spark costs to hand the cached partitions to Python as Arrow.
* ``flight-raw`` (ceiling): the same ``mapInArrow`` job, each task ``do_put``-ing its
  partition to a bare ``pyarrow.flight`` server (a spawned process on 127.0.0.1) that counts
  what it receives: Spark plus Flight with no buffering, balancing or tensors.
* ``tfos`` (peer): tensorflowonspark 2.2.5, ``InputMode.SPARK``: ``TFCluster.run`` once, then
  ``cluster.train(df.rdd)`` per repetition; its ``map_fun`` drains
  ``ctx.get_data_feed().next_batch()`` and writes a running count. Timed until ``train``
  returns, which TFoS does once ``next_batch`` has taken every row off its queue (the running
  count is checked against the rows fed when the cluster shuts down). TFoS moves one Python
  row at a time through a multiprocessing queue and polls it once a second per partition, so
  it runs on the first :data:`TFOS_MAX_ROWS` rows only; its result carries its own row count.

Local mode runs TFoS with ``num_executors=1``: TFoS keys its per-executor manager by
(host, executor id), and every task of ``local[N]`` runs in the one executor, ``driver``.

``extra`` adds the memory check: a fresh two-node cluster with a small feed buffer whose
consumer is slowed 10x (it sleeps nine times its own unthrottled per-batch time after each
batch); the node's peak buffered bytes must stay within the buffer limit + 10%.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from benchmarks.paths import COUNT_SCHEMA, BenchPath, count_partition
from benchmarks.tfos_util import start_tfos_cluster, stop_tfos_cluster
from formats.fs import write_text_atomic

__all__ = ["TABLES", "TFOS_MAX_ROWS", "BATCH_SIZE", "build", "extra"]

TABLES = ("numeric", "mnist", "image")
TFOS_MAX_ROWS = 20_000
BATCH_SIZE = 1024
SLOW_FACTOR = 10
MEMORY_MIN_BUFFER = 256 * 1024
MEMORY_CHUNK = 64 * 1024


# ---------------------------------------------------------------- node and executor side


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(obj))


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def count_main(args: dict[str, Any], ctx: Any) -> None:
    """A node's ``main``: consume every pushed epoch, write each epoch's row count.

    ``args``: ``dir`` (where to write ``<role><index>-epoch<e>.json``), ``batch_size``, and optionally
    ``slow_factor``: from the second epoch on, sleep ``slow_factor - 1`` times the first
    epoch's per-batch time after every batch (a consumer that is ``slow_factor`` x slower), and
    ``shapes`` and ``fill_values`` (``ctx.dataset``'s). Each epoch's file also says when the first batch came
    (``first_at``, wall clock) and how long the consumer was blocked on the batches after it
    (``wait_after_first``): the driver adds the time from its ``train`` call to ``first_at``
    for the consumer's whole wait (the node's own wait before the first batch also covers the
    time between the driver's epochs).
    """
    out = Path(args["dir"])
    shapes, fill = args.get("shapes"), args.get("fill_values")
    ds = ctx.dataset(batch_size=args["batch_size"], **({"shapes": shapes} if shapes else {}),
                     **({"fill_values": fill} if fill else {}))
    slow = float(args.get("slow_factor") or 1)
    per_batch = 0.0
    epoch = 0
    clock = time.perf_counter
    while True:
        rows = batches = 0
        rss_start, rss_peak = _rss_bytes(), 0
        t0 = None
        first_at = None
        wait = 0.0
        it = iter(ds)
        while True:
            asked = clock()
            batch = next(it, None)
            if t0 is not None:
                wait += clock() - asked
            if batch is None:
                break
            if t0 is None:
                t0 = clock()
                first_at = time.time()
            rows += int(next(iter(batch.values())).shape[0])
            batches += 1
            if epoch > 0 and slow > 1:
                time.sleep((slow - 1) * per_batch)
                rss_peak = max(rss_peak, _rss_bytes())
        if rows == 0 and ctx.should_stop:
            return
        seconds = time.perf_counter() - t0 if t0 is not None else 0.0
        if epoch == 0 and batches:
            per_batch = seconds / batches
        _write_json(out / f"{ctx.role}{ctx.index}-epoch{epoch}.json", {
            "rows": rows, "batches": batches, "seconds": seconds,
            "first_at": first_at, "wait_after_first": wait,
            "rss_start": rss_start, "rss_peak": rss_peak,
        })
        epoch += 1


class _FlightPutter:
    """mapInArrow function: do_put the partition to the raw Flight server on ``port``."""

    def __init__(self, port: int) -> None:
        self.port = port

    def __call__(self, batches):  # type: ignore[no-untyped-def]
        import pyarrow.flight as fl

        client = fl.connect(f"grpc://127.0.0.1:{self.port}")
        writer = None
        n = 0
        try:
            for b in batches:
                if writer is None:
                    writer, _ = client.do_put(fl.FlightDescriptor.for_path("bench"), b.schema)
                writer.write_batch(b)
                n += b.num_rows
            if writer is not None:
                writer.close()
        finally:
            client.close()
        yield pa.RecordBatch.from_pydict({"n": pa.array([n], pa.int64())})


def _serve_raw_flight(conn: Any) -> None:
    """Spawned process: a bare Flight server on 127.0.0.1 that counts rows received by do_put."""
    import threading

    import pyarrow.flight as fl

    class Sink(fl.FlightServerBase):
        def __init__(self) -> None:
            super().__init__("grpc://127.0.0.1:0")
            self.rows = 0
            self.lock = threading.Lock()

        def do_put(self, context, descriptor, reader, writer):  # type: ignore[no-untyped-def]
            n = 0
            for chunk in reader:
                n += chunk.data.num_rows
            with self.lock:
                self.rows += n

        def do_action(self, context, action):  # type: ignore[no-untyped-def]
            if action.type == "take":
                with self.lock:
                    rows, self.rows = self.rows, 0
                yield fl.Result(str(rows).encode())
            elif action.type == "stop":
                threading.Thread(target=self.shutdown, daemon=True).start()
                yield fl.Result(b"ok")

    server = Sink()
    conn.send(server.port)
    conn.close()
    server.serve()


def tfos_main(args: dict[str, Any], ctx: Any) -> None:
    """TFoS ``map_fun``: drain the data feed, keep a running row count in ``args['file']``."""
    feed = ctx.get_data_feed(train_mode=True)
    path = Path(args["file"])
    n = 0
    while not feed.should_stop():
        batch = feed.next_batch(args["batch_size"])
        if not batch:
            continue
        n += len(batch)
        _write_json(path, {"rows": n})


# ---------------------------------------------------------------- driver side


def _wait_for(check: Callable[[], Any], *, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
        # A fixed short poll: a backing-off one added up to 50 ms to every timed epoch.
        time.sleep(0.003)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class FlightPushPath:
    """``flight-push``: one dataplane cluster, one ``train`` per repetition."""

    def __init__(self, env: Any, *, num_nodes: int = 2, batch_size: int = BATCH_SIZE,
                 buffer_bytes: int | None = None, max_chunk_bytes: int | None = None,
                 slow_factor: int = 1, name: str = "push", main: Callable[..., None] | None = None,
                 shapes: dict[str, list[int]] | None = None, feed_timeout: float | None = None,
                 keep_metrics: bool = False, fill_values: dict[str, Any] | None = None) -> None:
        self.spark = env.spark
        self.df = env.dataframe()
        self.rows = env.rows_of()
        self.dir = env.workdir / f"{name}-counts"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.num_nodes = num_nodes
        self.args = {"dir": str(self.dir), "batch_size": batch_size, "slow_factor": slow_factor,
                     "shapes": shapes, "fill_values": fill_values}
        self.main = main or count_main
        self.feed_timeout = feed_timeout
        self.keep_metrics = keep_metrics
        self.waits: list[float] = []  # per repetition: the longest any node waited for input
        self.firsts: list[float] = []  # per repetition: train() call to the last node's first batch
        self.final_metrics: dict[Any, Any] | None = None
        self.run_kwargs: dict[str, int] = {}
        if buffer_bytes:
            self.run_kwargs["buffer_bytes"] = buffer_bytes
        if max_chunk_bytes:
            self.run_kwargs["max_chunk_bytes"] = max_chunk_bytes
        self.cluster: Any = None
        self.epoch = 0
        self.last_report: Any = None
        self.last_nodes: list[dict[str, Any]] = []

    def _start(self) -> None:
        import dataplane

        self.cluster = dataplane.run(
            self.spark, self.main, self.args, num_nodes=self.num_nodes, log_to_driver=False,
            **self.run_kwargs,
        )

    def __call__(self) -> int:
        if self.cluster is None:
            self._start()
        epoch = self.epoch
        self.epoch += 1
        started = time.time()
        if self.feed_timeout is None:
            self.last_report = self.cluster.train(self.df)
        else:
            self.last_report = self.cluster.train(self.df, feed_timeout=self.feed_timeout)
        files = [
            self.dir / f"{n.role}{n.index}-epoch{epoch}.json"
            for n in self.cluster.nodes
            if n.role in ("chief", "worker")
        ]

        def done() -> list[dict[str, Any]] | None:
            got = [_read_json(f) for f in files]
            return got if all(g is not None for g in got) else None

        timeout = 600 if self.feed_timeout is None else self.feed_timeout
        self.last_nodes = _wait_for(done, timeout=timeout, what=f"every node consuming epoch {epoch}")
        self.firsts.append(max(
            (g["first_at"] - started if g.get("first_at") else 0.0) for g in self.last_nodes
        ))
        self.waits.append(max(
            (g["first_at"] - started if g.get("first_at") else 0.0) + float(g.get("wait_after_first", 0.0))
            for g in self.last_nodes
        ))
        return sum(int(g["rows"]) for g in self.last_nodes)

    def close(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            try:
                if self.keep_metrics:  # after the repetitions: costs none of their time
                    self.final_metrics = cluster.metrics()
            finally:
                cluster.shutdown()


class RawFlightPath:
    """``flight-raw``: mapInArrow tasks do_put their partitions to a bare Flight server."""

    def __init__(self, env: Any) -> None:
        self.df = env.dataframe()
        self.proc: Any = None
        self.port = 0

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_raw_flight, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        if not parent.poll(60):
            raise TimeoutError("the raw Flight server did not start within 60 s")
        self.port = int(parent.recv())

    def _action(self, name: str) -> bytes:
        import pyarrow.flight as fl

        client = fl.connect(f"grpc://127.0.0.1:{self.port}")
        try:
            return b"".join(r.body.to_pybytes() for r in client.do_action(fl.Action(name, b"")))
        finally:
            client.close()

    def __call__(self) -> int:
        if self.proc is None:
            self._start()
        self._action("take")
        sent = sum(r.n for r in self.df.mapInArrow(_FlightPutter(self.port), COUNT_SCHEMA).collect())
        received = int(self._action("take"))
        if received != sent:
            raise RuntimeError(f"raw Flight server received {received} rows, tasks sent {sent}")
        return received

    def close(self) -> None:
        if self.proc is not None:
            try:
                self._action("stop")
            except Exception:  # noqa: BLE001 - the process is terminated below anyway
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(10)
            self.proc = None


class TFoSPath:
    """``tfos``: tensorflowonspark 2.2.5 InputMode.SPARK on a capped subset of rows."""

    def __init__(self, env: Any, rows: int) -> None:
        self.sc = env.spark.sparkContext
        self.df = env.dataframe(rows=rows)
        self.rows = rows
        self.file = env.workdir / "tfos-count.json"
        self.cluster: Any = None
        self.fed = 0

    def _start(self) -> None:
        self.cluster = start_tfos_cluster(
            self.sc, tfos_main, {"file": str(self.file), "batch_size": BATCH_SIZE},
        )

    def __call__(self) -> int:
        if self.cluster is None:
            self._start()
        # TFoS's train() returns when every partition's queue is joined, i.e. when map_fun's
        # next_batch() has taken every row off the queue: that is TFoS's own "consumed".
        # (The running count lags by the partial batch next_batch() is still filling.)
        self.cluster.train(self.df.rdd, num_epochs=1)
        self.fed += self.rows
        return self.rows

    def close(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            stop_tfos_cluster(cluster)
            # at shutdown next_batch() hands over the partial batch: now every row is counted

            def counted() -> int | None:
                got = _read_json(self.file)
                return int(got["rows"]) if got and int(got["rows"]) >= self.fed else None

            try:
                got = _wait_for(counted, timeout=30, what="TFoS counting every row")
            except TimeoutError:
                got = (_read_json(self.file) or {}).get("rows")
                raise RuntimeError(
                    f"TFoS map_fun counted {got} rows, {self.fed} were fed"
                ) from None
            if got != self.fed:
                raise RuntimeError(f"TFoS map_fun counted {got} rows, {self.fed} were fed")


def _tfos_unavailable() -> str | None:
    try:
        import tensorflowonspark  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure makes the peer unavailable
        from benchmarks.harness import stack_info

        s = stack_info()
        return (
            f"tensorflowonspark cannot be imported on this stack (pyspark {s['pyspark']}, "
            f"TF {s['tensorflow']}): {type(exc).__name__}: {exc}; install it with "
            f"`bash .ci/setup current` or `bash .ci/setup compat`"
        )
    return None


def warm(env: Any) -> str:
    """Spark's JIT warmed on this table before any path runs (:func:`benchmarks.paths.warm_jvm`):
    every path here starts with Spark handing the cached rows to Python."""
    from benchmarks.paths import warm_jvm

    s = warm_jvm(env.dataframe())
    return f"JVM warm-up: {len(s)} bare mapInArrow passes, {s[0]:.2f} s first, {s[-1]:.2f} s last"


def build(env: Any) -> list[BenchPath]:
    """The push scenario's paths on ``env.table_name``."""
    rows = env.rows_of()
    row_bytes = env.row_bytes()
    nbytes = rows * row_bytes
    ours = FlightPushPath(env)
    count_df = env.dataframe()
    paths = [
        BenchPath("flight-push", ours, kind="ours", nbytes=nbytes, close=ours.close),
        BenchPath(
            "spark-mapinarrow",
            lambda: sum(r.n for r in count_df.mapInArrow(count_partition, COUNT_SCHEMA).collect()),
            kind="ceiling", nbytes=nbytes,
        ),
    ]
    raw = RawFlightPath(env)
    paths.append(BenchPath("flight-raw", raw, kind="ceiling", nbytes=nbytes, close=raw.close))
    tfos_rows = min(rows, TFOS_MAX_ROWS)
    reason = _tfos_unavailable()
    if reason is None:
        tfos = TFoSPath(env, tfos_rows)
        paths.append(BenchPath("tfos", tfos, kind="peer", nbytes=tfos_rows * row_bytes,
                               close=tfos.close))
    else:
        paths.append(BenchPath("tfos", lambda: 0, kind="peer", unavailable=reason))
    return paths


def extra(env: Any, results: list[dict[str, Any]], *, progress: Callable[[str], None]) -> dict[str, Any]:
    """Memory under backpressure: node buffer peak vs limit with a consumer slowed 10x.

    Skipped for ``--quick`` (the data would not fill any sensible buffer).
    """
    if env.quick:
        return {}
    rows = env.rows_of()
    per_node = rows * env.row_bytes() // 2
    # a quarter of each node's share, so the buffer must fill; messages well below it
    limit = max(MEMORY_MIN_BUFFER, per_node // 4)
    label = f"push/{env.table_name}"
    progress(f"[{label}] memory check: consumer slowed {SLOW_FACTOR}x, buffer {limit / 2**20:.1f} MiB")
    path = FlightPushPath(
        env, buffer_bytes=limit, max_chunk_bytes=MEMORY_CHUNK, slow_factor=SLOW_FACTOR,
        name="memory",
    )
    try:
        fast = path()  # epoch 0: the consumer's own pace, which sets the sleep
        t0 = time.perf_counter()
        slow = path()
        slow_seconds = time.perf_counter() - t0
        metrics = path.cluster.metrics()
        nodes_json = path.last_nodes
    finally:
        path.close()
    peaks = {str(k): int(m.get("buffer_peak_bytes", 0)) for k, m in metrics.items()}
    caps = {str(k): int(m.get("buffer_capacity", limit)) for k, m in metrics.items()}
    peak = max(peaks.values()) if peaks else 0
    stall = sum(float(m.get("stall_seconds", 0.0)) for m in metrics.values())
    rss_growth = max((n["rss_peak"] - n["rss_start"] for n in nodes_json), default=0)
    out = {
        "slow_factor": SLOW_FACTOR,
        "limit_bytes": limit,
        "node_buffer_capacity": caps,
        "node_peak_bytes": peaks,
        "peak_bytes": peak,
        "peak_over_limit": peak / limit,
        "within_target": peak <= 1.10 * limit,
        "producer_stall_seconds": stall,
        "node_rss_growth_bytes": int(rss_growth),
        "rows": [fast, slow],
        "slow_epoch_seconds": slow_seconds,
    }
    progress(
        f"[{label}] memory check: peak {peak / 2**20:.2f} MiB vs limit {limit / 2**20:.2f} MiB "
        f"({out['peak_over_limit']:.2f}x), producers stalled {stall:.1f} s"
    )
    return {"memory": out}
