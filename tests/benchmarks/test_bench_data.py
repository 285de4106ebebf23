"""`dataplane bench ... --data URL`: the user's own data on every path, with the breakdown.

Real files, a real S3 server (tests/s3server.py), real Spark and TF nodes for push; asserts the
JSON (paths, rows, breakdown parts adding up), the one-line errors, never timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from benchmarks import data, report, userdata
from benchmarks.breakdown import Step, ladder
from benchmarks.pull_parquet import write_parquet
from benchmarks.pull_tfrecord import write_tfrecords
from dataplane.cli import console

REPO = Path(__file__).resolve().parents[2]
ROWS = 1500
LIMIT = 700


def _on_compat() -> bool:
    return int(pa.__version__.split(".")[0]) < 16


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The MNIST-shaped table as 3 Parquet files and as 3 TFRecord files (+ schema file)."""
    root = tmp_path_factory.mktemp("userdata")
    table = data.make_table("mnist", ROWS)
    write_parquet(table, root / "parquet", files=3)
    write_tfrecords(table, root / "tfrecord", files=3)
    return root


def _bench(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 600):
    cmd = [sys.executable, "-m", "dataplane.cli", "bench", *args]
    return subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _check_breakdown(sc: dict, ours: str, parts: list[str]) -> None:
    bd = sc["breakdown"]
    assert bd["path"] == ours
    res = next(r for r in sc["results"] if r["path"] == ours)
    assert bd["measured_seconds"] == pytest.approx(res["seconds"])
    assert [p["part"] for p in bd["parts"]] == parts
    assert all(p["seconds"] >= 0 and p["what"] for p in bd["parts"])
    # the parts account for the measured time
    assert abs(sum(p["seconds"] for p in bd["parts"]) - bd["measured_seconds"]) <= 0.1 * bd["measured_seconds"]
    assert bd["sum_seconds"] == pytest.approx(sum(p["seconds"] for p in bd["parts"]))
    assert bd["consumer_wait_seconds"] is not None and bd["consumer_wait_seconds"] >= 0
    assert 0 < bd["first_batch_seconds"] <= 1.01 * max(bd["consumer_wait_seconds"], bd["measured_seconds"])


def _results(sc: dict) -> dict[str, dict]:
    from benchmarks.userdata import DATA_PATH_NAMES

    out = {r["path"]: r for r in sc["results"]}
    assert set(out) <= DATA_PATH_NAMES[sc["scenario"]]  # what --peers is checked against
    return out


@pytest.mark.slow
def test_pull_parquet_cli_on_local_files(files, tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench(
        "pull-parquet", "--data", str(files / "parquet"), "--shapes", "image=784", "--label", "label",
        "--reps", "1", "--idle-wait", "0", "--json", str(out), "--plot", str(tmp_path / "b.png"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    sc = json.loads(out.read_text())
    assert sc["scenario"] == "pull-parquet" and sc["table"] == "data"
    assert sc["data"]["format"] == "parquet" and sc["data"]["files"] == 3
    assert sc["data"]["rows"] == sc["data"]["total_rows"] == ROWS == sc["rows"]
    assert sc["data"]["columns"] == ["id", "image", "label"]
    assert sc["row_bytes"] == 3144  # int32 id + 784 float32 + int32 label, as tensors
    res = _results(sc)
    assert set(res) == {"parquet", "pyarrow-raw", "petastorm", "tfio"}
    for name in ("parquet", "pyarrow-raw") + (("petastorm",) if _on_compat() else ()):
        assert res[name]["ok"], res[name]
        assert res[name]["rep_rows"] == [ROWS], name
    if not _on_compat():
        assert not res["petastorm"]["ok"] and "compat stack" in res["petastorm"]["error"]
        assert not res["tfio"]["ok"] and "compat stack" in res["tfio"]["error"]
    else:
        assert not res["tfio"]["ok"] and "list columns" in res["tfio"]["error"]
    assert set(sc["stages"]) == {"read", "decode"} and all(s["ok"] for s in sc["stages"].values())
    _check_breakdown(sc, "parquet", ["read", "decode", "to_tf"])
    # the schema comes first, then progress; the table and the breakdown on stdout
    err = proc.stderr.splitlines()
    first = next(i for i, line in enumerate(err) if line.startswith("data: "))
    assert err[first + 2].strip() == "image: list<element: float> -> tf.float32 [784] (--shapes)"
    assert first < next(i for i, line in enumerate(err) if line.startswith("[pull-parquet/data]"))
    assert "| pull-parquet | data | parquet | ours | 1,500 |" in proc.stdout
    assert "where parquet's" in proc.stdout and "waited" in proc.stdout
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def _run(spec: userdata.DataSpec, scenario: str) -> dict:
    described = userdata.describe(spec, scenario)
    doc = userdata.run_on_data(scenario, described, reps=1, idle_wait=0)
    return doc["scenarios"][0]


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_pull_tfrecord_with_columns_and_limit(files):
    spec = userdata.DataSpec(str(files / "tfrecord"), columns=["image"], label="label", limit=LIMIT)
    sc = _run(spec, "pull-tfrecord")
    assert sc["data"]["rows"] == LIMIT and sc["data"]["total_rows"] == ROWS
    assert sc["data"]["columns"] == ["image", "label"]
    res = _results(sc)
    assert set(res) == {"tfrecord", "tfdata-tuned", "tfdata-sequential"}
    for r in res.values():
        assert r["ok"], r
        assert r["rep_rows"] == [LIMIT], r["path"]
    _check_breakdown(sc, "tfrecord", ["read", "decode", "to_tf"])


@pytest.fixture(scope="module")
def s3(tmp_path_factory, files):
    from tests.s3server import acquire_shared, release_shared

    server = acquire_shared(tmp_path_factory.mktemp("seaweedfs"))
    bucket = server.make_bucket()
    urls = {
        kind: server.upload_dir(files / kind, bucket, f"bench/{kind}") for kind in ("parquet", "tfrecord")
    }
    yield server, urls
    release_shared()


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_pull_on_s3(s3, monkeypatch):
    server, urls = s3
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    sc = _run(userdata.DataSpec(urls["parquet"], shapes={"image": (784,)}), "pull-parquet")
    res = _results(sc)
    assert sc["data"]["rows"] == ROWS
    assert res["parquet"]["ok"] and res["parquet"]["rep_rows"] == [ROWS]
    assert res["pyarrow-raw"]["ok"] and res["pyarrow-raw"]["rep_rows"] == [ROWS]
    assert not res["tfio"]["ok"] and ("s3://" in res["tfio"]["error"] or "compat" in res["tfio"]["error"])
    _check_breakdown(sc, "parquet", ["read", "decode", "to_tf"])

    sc = _run(userdata.DataSpec(urls["tfrecord"], limit=LIMIT), "pull-tfrecord")
    res = _results(sc)
    assert res["tfrecord"]["ok"] and res["tfrecord"]["rep_rows"] == [LIMIT]
    for peer in ("tfdata-tuned", "tfdata-sequential"):  # TF itself reads no s3://
        assert not res[peer]["ok"] and "s3://" in res[peer]["error"]
    _check_breakdown(sc, "tfrecord", ["read", "decode", "to_tf"])


@pytest.mark.slow
@pytest.mark.cluster
def test_push_cli_on_local_parquet(files, tmp_path):
    out = tmp_path / "push.json"
    proc = _bench(
        "push", "--data", str(files / "parquet"), "--shapes", "image=784", "--limit", str(LIMIT),
        "--reps", "1", "--idle-wait", "0", "--json", str(out), cwd=tmp_path, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    sc = json.loads(out.read_text())
    assert sc["scenario"] == "push" and sc["rows"] == LIMIT
    res = _results(sc)
    assert set(res) == {"flight-push", "spark-mapinarrow", "flight-raw"}
    for r in res.values():
        assert r["ok"], r
        assert r["rep_rows"] == [LIMIT], r["path"]
    assert sc["stages"]["node-buffer"]["ok"], sc["stages"]
    _check_breakdown(sc, "flight-push", ["spark_to_arrow", "transport", "node_buffer", "tensors"])
    bd = sc["breakdown"]
    assert set(bd["node_metrics"]) == {"0", "1"}
    assert all("stall_seconds" in m for m in bd["node_metrics"].values())
    assert bd["last_feed_report"]["rows"] == LIMIT
    assert "where flight-push's" in proc.stdout


@pytest.mark.s3
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_push_reads_s3_parquet_with_spark_tasks(s3, spark, monkeypatch):
    from benchmarks.userdata_push import read_frame

    server, urls = s3
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    described = userdata.describe(userdata.DataSpec(urls["parquet"], columns=["id", "label"], limit=LIMIT), "push")
    df = read_frame(spark, described)
    try:
        assert df.columns == ["id", "label"]
        assert sorted(r.id for r in df.collect()) == list(range(LIMIT))
    finally:
        df.unpersist()


@pytest.mark.s3
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_push_reads_partitioned_parquet_through_a_glob(s3, spark, tmp_path, monkeypatch):
    """``bench push --data 'dir/day=*'`` on data written with partitionBy: the frame has the
    ``day`` column with each row's value and the same type (int64, as our readers give it),
    locally (Spark's reader, told the base path) and on S3 (our tasks reading the files)."""
    from benchmarks.userdata_push import read_frame

    out = tmp_path / "parted"
    spark.range(0, 90, 1, 2).selectExpr("id", "id % 3 as day").write.partitionBy("day").parquet(str(out))
    server, _ = s3
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    bucket = server.make_bucket()
    remote = server.upload_dir(out, bucket, "parted")
    for url in (f"{out}/day=*", f"{remote}/day=[0-2]"):
        described = userdata.describe(userdata.DataSpec(url, columns=["id", "day"]), "push")
        df = read_frame(spark, described)
        try:
            assert df.columns == ["id", "day"], url
            assert sorted((r.id, r.day) for r in df.collect()) == [(i, i % 3) for i in range(90)], url
            # one type wherever the files live: Spark's own reader says int32 for small keys
            assert dict(df.dtypes) == {"id": "bigint", "day": "bigint"}, url
        finally:
            df.unpersist()


# ---------------------------------------------------------------- errors: one line, exit 2


def _cli(capsys, *args: str) -> tuple[int, str]:
    from dataplane import cli

    code = cli.main(["bench", *args, "--json", "/nonexistent/never-written.json"])
    return code, capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize(
    "case",
    ["missing", "bad-url", "column", "label", "shape", "shape-syntax", "parquet-as-tfrecord",
     "tfrecord-as-parquet", "empty-file", "synthetic-option", "not-a-data-scenario", "unknown-peer"],
)
def test_errors_are_one_line(case, files, tmp_path, capsys):
    pq, tfr = str(files / "parquet"), str(files / "tfrecord")
    (tmp_path / "empty.parquet").touch()  # (was "is not Parquet; use pull-tfrecord")
    args, expect = {
        "missing": (["pull-parquet", "--data", str(tmp_path / "nope")], "nope"),
        "bad-url": (["pull-parquet", "--data", "ftp://host/x"], "ftp"),
        "column": (["pull-parquet", "--data", pq, "--columns", "id,pixels"], "'pixels' is not in"),
        "label": (["pull-tfrecord", "--data", tfr, "--label", "target"], "'target' is not in"),
        "shape": (["pull-parquet", "--data", pq, "--shapes", "image=28x27"], "image=28x27"),
        "shape-syntax": (["pull-parquet", "--data", pq, "--shapes", "image:784"], "COLUMN=DIMS"),
        "parquet-as-tfrecord": (["pull-tfrecord", "--data", pq], "is Parquet"),
        "tfrecord-as-parquet": (["pull-parquet", "--data", tfr], "is not Parquet"),
        "empty-file": (["pull-parquet", "--data", str(tmp_path / "empty.parquet")],
                       "empty.parquet is empty (0 bytes); remove it or write it again"),
        "synthetic-option": (["push", "--data", pq, "--rows", "10"], "--rows"),
        "not-a-data-scenario": (["export", "--data", pq], "--data works with"),
        "unknown-peer": (["pull-parquet", "--data", pq, "--peers", "petastrom"],
                         "--peers names no path of this run: petastrom; the paths are: decode, parquet, "
                         "petastorm, pyarrow-raw, read, tfio"),
    }[case]
    code, err = _cli(capsys, *args)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("dataplane bench: error: ") and expect in lines[0], lines[0]
    assert "Traceback" not in err


def test_verbose_error_shows_the_traceback(files, capsys):
    from dataplane import cli

    code = cli.main(["-v", "bench", "pull-parquet", "--data", str(files / "parquet"), "--columns", "pixels",
                     "--json", "/nonexistent/x.json"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("dataplane bench: error:")


# ---------------------------------------------------------------- pure pieces


def test_parse_shapes():
    assert userdata.parse_shapes("image=784, mask=28x28") == {"image": (784,), "mask": (28, 28)}
    assert userdata.parse_shapes(None) == {}
    for bad in ("image", "image=", "=3", "image=0", "image=2xa"):
        with pytest.raises(userdata.DataError, match="COLUMN=DIMS"):
            userdata.parse_shapes(bad)


def _scenario(seconds: dict[str, float], stages: dict[str, float | None]) -> dict:
    return {
        "scenario": "pull-parquet", "table": "data", "reps": 1,
        "results": [{"path": p, "ok": True, "seconds": s, "rows_per_s": 1.0} for p, s in seconds.items()],
        "stages": {k: {"ok": v is not None, "seconds": v or 0.0} for k, v in stages.items()},
    }


def test_ladder_parts_add_up_capped_and_merged():
    steps = [Step("read", "r", stage="read"), Step("decode", "d", stage="decode"), Step("to_tf", "t")]
    bd = ladder(_scenario({"parquet": 1.0}, {"read": 0.2, "decode": 0.7}), "parquet", steps, waits=[0.9])
    assert [(p["part"], round(p["seconds"], 6)) for p in bd["parts"]] == [("read", 0.2), ("decode", 0.5), ("to_tf", 0.3)]
    assert bd["sum_seconds"] == pytest.approx(1.0) and bd["consumer_wait_share"] == pytest.approx(0.9)
    # a prefix slower than ours whole is capped (never a negative part)
    bd = ladder(_scenario({"parquet": 1.0}, {"read": 0.2, "decode": 1.3}), "parquet", steps)
    assert [p["seconds"] for p in bd["parts"]] == pytest.approx([0.2, 0.8, 0.0])
    assert bd["parts"][1].get("capped") and bd["sum_seconds"] == pytest.approx(1.0)
    # a prefix faster than the shorter one before it reads 0 and says so (it read as a plain
    # "decode 0.000 s (0%)" beside a read part overstated by the difference)
    bd = ladder(_scenario({"parquet": 1.0}, {"read": 0.6, "decode": 0.2}), "parquet", steps)
    assert [p["seconds"] for p in bd["parts"]] == pytest.approx([0.6, 0.0, 0.4])
    assert bd["parts"][1].get("hidden") and not bd["parts"][0].get("hidden")
    lines = report.breakdown_lines({"scenario": "pull-parquet", "table": "data"}, bd)
    assert "decode 0.000 s (0%, hidden)" in lines[0] and "upper bounds" in lines[1], lines
    # a stage that could not run joins the next part
    bd = ladder(_scenario({"parquet": 1.0}, {"read": 0.2, "decode": None}), "parquet", steps)
    assert [p["part"] for p in bd["parts"]] == ["read", "decode+to_tf"]
    assert ladder(_scenario({"other": 1.0}, {}), "parquet", steps) is None


def test_breakdown_renders_under_the_table():
    sc = _scenario({"parquet": 1.0}, {"read": 0.2, "decode": 0.7})
    sc["results"][0].update(kind="ours", mb_per_s=1.0, rows=10, error=None)
    sc["rows"] = 10
    sc["data"] = {"url": "/d", "format": "parquet", "files": 1, "rows": 10, "total_rows": 10,
                  "row_bytes": 4, "columns": ["x"]}
    sc["breakdown"] = ladder(sc, "parquet", [Step("read", "r", stage="read"), Step("decode", "d", stage="decode"),
                                             Step("to_tf", "t")], waits=[0.5])
    text = report.markdown(sc)
    assert "Data: /d (parquet, 1 file, 10 of 10 rows" in text
    assert "read 0.200 s (20%), decode 0.500 s (50%), to_tf 0.300 s (30%) (sum 1.000 s)" in text
    assert "waited 0.500 s for input (50% of it)" in text
    sc["data"].update(files=2, fill={"x": 0})
    assert "Data: /d (parquet, 2 files, 10 of 10 rows, 4 bytes a row as tensors; columns x; nulls filled: x -> 0)" in report.markdown(sc)


def test_image_table_has_48_kib_rows():
    from benchmarks import push

    table = data.make_table("image", 3)
    assert data.row_bytes("image") == 49160 and "image" in push.TABLES
    assert len(table.column("image")[0]) == 64 * 64 * 3 and table.column("id").to_pylist() == [0, 1, 2]
    assert data.spark_schema_ddl("image") == "id INT, image ARRAY<FLOAT>, label INT"


def test_progress_bar_redraws_under_the_lines():
    import io

    from dataplane.cli.bench import _Progress

    stream = io.StringIO()
    bar = _Progress(stream, bar=True)
    bar.line("data: x")
    bar.tick(3, 12)
    bar.line("[pull-parquet/data] parquet rep 1/3: ...")
    bar.close()
    text = stream.getvalue()
    assert text.startswith("data: x\n")
    assert "[#######" in text and "] 3/12 passes" in text
    # a line printed while the bar shows clears it first and redraws it after
    assert "\r\033[K[pull-parquet/data] parquet rep 1/3: ...\n\r\033[K[" in text
    plain = io.StringIO()
    quiet = _Progress(plain, bar=False)
    quiet.tick(1, 2)
    quiet.line("x")
    assert plain.getvalue() == "x\n"




def _nullable(root: Path) -> Path:
    """id 0..29; score null on ids % 3 == 1 (10 nulls), name null on ids % 5 == 2 (6 nulls)."""
    import pyarrow.parquet as pq

    ids = list(range(30))
    table = pa.table({
        "id": ids,
        "score": [None if i % 3 == 1 else float(i) for i in ids],
        "name": [None if i % 5 == 2 else f"n{i}" for i in ids],
    })
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, root / "t.parquet", row_group_size=12)
    return root / "t.parquet"


_SCORES = sum(i for i in range(30) if i % 3 != 1) - 1.5 * 10  # nulls filled with -1.5
_NAMES = [b"none" if i % 5 == 2 else f"n{i}".encode() for i in range(30)]


def _filled_sums(d: userdata.Described) -> tuple[int, float, list[bytes]]:
    ids, scores, names = 0, 0.0, []
    for batch in userdata.ours_dataset(d):
        ids += int(batch["id"].numpy().sum())
        scores += float(batch["score"].numpy().sum())
        names += list(batch["name"].numpy())
    return ids, scores, names


def test_nullable_columns_are_named_together_and_fill_makes_them_readable(tmp_path):
    # a typical Spark table with nullable columns could not be benchmarked at all: the error
    # named the first such column only, and bench had no way to fill them
    _nullable(tmp_path)
    with pytest.raises(userdata.DataError) as info:
        userdata.describe(userdata.DataSpec(str(tmp_path)), "pull-parquet")
    assert str(info.value) == (
        f"{tmp_path}: column(s) with nulls, which TensorFlow tensors cannot hold: 'score' (10), "
        f"'name' (6); give each a value with --fill score=0,name=, or leave them out with --columns")
    spec = userdata.DataSpec(str(tmp_path), fill=userdata.parse_fill("score=-1.5, name=none"))
    d = userdata.describe(spec, "pull-parquet")
    assert spec.fill == {"score": -1.5, "name": "none"}  # typed by the columns' dtypes
    assert d.schema_lines[1:] == ["score: double -> tf.float64 [] (nulls -> -1.5)",
                                  "name: string -> tf.string [] (nulls -> 'none')"]
    assert _filled_sums(d) == (sum(range(30)), _SCORES, _NAMES)
    assert d.as_json()["fill"] == {"score": -1.5, "name": "none"}
    # filling one leaves the other named
    with pytest.raises(userdata.DataError, match=r"hold: 'name' \(6\); give each a value with --fill name=,"):
        userdata.describe(userdata.DataSpec(str(tmp_path), fill={"score": "0"}), "pull-parquet")


@pytest.mark.parametrize("text, message", [
    ("score", "--fill: 'score' is not COLUMN=VALUE; write e.g. rating=0"),
    ("score=1,score=2", "--fill names column 'score' twice"),
])
def test_fill_text_that_is_not_column_value(text, message):
    with pytest.raises(userdata.DataError, match=message):
        userdata.parse_fill(text)


@pytest.mark.parametrize("fill, message", [
    ({"id": "1.5"}, "--fill id=1.5: column 'id' is int64, so its fill value must be an integer"),
    ({"score": "high"}, "--fill score=high: column 'score' is float64, so its fill value must be a number"),
    ({"nosuch": "0"}, "--fill: column 'nosuch' is not among the columns read (id, score, name)"),
])
def test_fill_values_that_do_not_fit(tmp_path, fill, message):
    _nullable(tmp_path)
    with pytest.raises(userdata.DataError) as info:
        userdata.describe(userdata.DataSpec(str(tmp_path), fill=dict(fill)), "pull-parquet")
    assert str(info.value) == message


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_fill_on_tfrecords_fills_absent_features_in_ours_and_in_tf_data(tmp_path):
    import pyarrow.parquet as pq

    from benchmarks.userdata_pull import _tfdata

    write_tfrecords(pq.read_table(_nullable(tmp_path / "pq")), tmp_path / "rec", files=2)
    url = str(tmp_path / "rec")
    with pytest.raises(userdata.DataError) as info:
        userdata.describe(userdata.DataSpec(url), "pull-tfrecord")
    assert "(here: --fill score=0, or leave the column out with --columns)" in str(info.value)
    d = userdata.describe(userdata.DataSpec(url, fill={"score": "-1.5", "name": "none"}), "pull-tfrecord")
    assert _filled_sums(d) == (sum(range(30)), _SCORES, _NAMES)
    # the tf.data peer parses absent features as the same values
    got = [(b["id"].numpy(), b["score"].numpy(), list(b["name"].numpy()))
           for b in _tfdata(d, parallel_reads=False)]
    assert sum(int(i.sum()) for i, _, _ in got) == sum(range(30))
    assert sum(float(s.sum()) for _, s, _ in got) == pytest.approx(_SCORES)
    assert [n for _, _, ns in got for n in ns] == _NAMES


@pytest.mark.cluster
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_push_with_fill_gives_the_nodes_the_values(spark, tmp_path):
    """The flight-push path's nodes read the pushed nulls with --fill's values (a node without
    them refuses the first null)."""
    from benchmarks.userdata_push import build

    _nullable(tmp_path / "data")
    d = userdata.describe(userdata.DataSpec(str(tmp_path / "data"), fill={"score": "0", "name": ""}), "push")
    env = userdata.DataEnv(d, spark=spark, workdir=tmp_path / "work")
    env.workdir.mkdir()
    paths = {p.name: p for p in build(env)}
    try:
        assert paths["flight-push"].run() == 30
    finally:
        for p in paths.values():
            if p.close is not None:
                p.close()
        env.release()


def test_counting_tfrecords_without_a_schema_file_says_how_far_it_is(files, tmp_path, monkeypatch):
    """The count reads every file to its end; past SLOW_STEP_MARKS's first mark it says so and
    how far it is, file by file here (both marks at 0), and a quick count prints nothing."""
    import shutil

    rec = tmp_path / "rec"
    rec.mkdir()
    names = sorted(p.name for p in (files / "tfrecord").iterdir() if p.name != "_tf_schema.json")
    assert len(names) == 3, names
    for name in names:
        shutil.copy(files / "tfrecord" / name, rec / name)
    lines: list[str] = []
    d = userdata.describe(userdata.DataSpec(str(rec)), "pull-tfrecord", progress=lines.append)
    assert d.total_rows == ROWS and lines == []
    monkeypatch.setattr(console, "SLOW_STEP_MARKS", (0.0, 0.0))
    d = userdata.describe(userdata.DataSpec(str(rec), limit=LIMIT), "pull-tfrecord", progress=lines.append)
    assert (d.total_rows, d.rows) == (ROWS, LIMIT)
    assert len(lines) == 3, lines
    assert lines[0].startswith("counting the records of 3 TFRecord files: the whole data set is read once")
    assert "_tf_schema.json giving num_rows" in lines[0]
    counted = [int(line.split(", ")[1].split()[0].replace(",", "")) for line in lines[1:]]
    assert [line.split(" files")[0].strip() for line in lines[1:]] == ["counted 1/3", "counted 2/3"]
    assert counted[0] < counted[1] < ROWS, lines


def test_reading_many_parquet_footers_says_how_far_it_is(files, monkeypatch):
    """Describing a Parquet data set reads every file's footer (a round trip or two each on S3):
    past SLOW_STEP_MARKS's first mark it says so and how far it is, file by file here (both marks at
    0); a quick one prints nothing, and the description is the same either way."""
    lines: list[str] = []
    quick = userdata.describe(userdata.DataSpec(str(files / "parquet")), "pull-parquet", progress=lines.append)
    assert quick.total_rows == ROWS and lines == []
    monkeypatch.setattr(console, "SLOW_STEP_MARKS", (0.0, 0.0))
    d = userdata.describe(userdata.DataSpec(str(files / "parquet")), "pull-parquet", progress=lines.append)
    assert (d.total_rows, d.schema_lines) == (ROWS, quick.schema_lines)
    assert lines[0] == "reading the footers of 3 Parquet files (schema, rows, null counts)", lines
    assert [line.split(" in ")[0] for line in lines[1:]] == ["  read 1/3 footers", "  read 2/3 footers"], lines
    assert all(line.endswith(" s") for line in lines[1:]), lines
