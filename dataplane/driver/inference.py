"""Driver side of ``cluster.inference``: the lazily evaluated output DataFrame.

Each partition of the input goes to one serving node over a Flight ``do_exchange``
(:class:`feeders.push.PartitionInferrer`); the answers come back on the same stream. When the
caller gives no output schema, one node answers a 4-row probe first to learn it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import pyarrow as pa

from dataplane.driver.sparkjobs import arrow_schema_of, sample_arrow
from dataplane.errors import FeedError, SchemaError
from formats.schema import names_arg
from formats.sparkframe import arrow_batches_by_rows, bound_session_batches

if TYPE_CHECKING:
    from dataplane.driver.feed import Feeder

__all__ = ["inference"]


def inference(
    feeder: "Feeder",
    df: Any,
    *,
    passthrough: Sequence[str],
    columns: Sequence[str] | None,
    output_schema: pa.Schema | None,
    feed_timeout: float,
    max_rows: int,
) -> Any:
    """Build the lazily evaluated output DataFrame of ``cluster.inference``."""
    from pyspark.sql.pandas.types import from_arrow_schema

    from feeders.push import PartitionInferrer
    from formats.sparkframe import dense_vectors, map_in_arrow, not_a_spark_frame

    if not (hasattr(df, "mapInArrow") and hasattr(df, "schema")):
        raise TypeError(f"inference() needs a Spark DataFrame, got {not_a_spark_frame(df)}")
    if getattr(df, "isStreaming", False) and output_schema is None:
        raise ValueError(
            "inference() got a streaming DataFrame: predict's output columns cannot be learned "
            "from a probe batch of a stream. Pass them, e.g. output_schema=pa.schema([('y', "
            "pa.float32())]); the result is then a streaming DataFrame too (start it with "
            "writeStream)."
        )
    passthrough = [] if passthrough is None else names_arg("passthrough", passthrough)
    columns = None if columns is None else names_arg("columns", columns)
    if columns == []:
        raise ValueError(
            "inference(columns=[]) would send predict no input; name the columns predict reads, "
            "or leave columns=None to send every column."
        )
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows <= 0:
        raise ValueError(f"max_rows (rows per request to a node) must be a positive int, got {max_rows!r}.")
    if isinstance(feed_timeout, bool) or not (isinstance(feed_timeout, (int, float)) and feed_timeout > 0):
        raise ValueError(f"feed_timeout (seconds to wait for each answer) must be > 0, got {feed_timeout!r}.")
    if output_schema is not None and not isinstance(output_schema, pa.Schema):
        raise TypeError(
            f"output_schema must be a pyarrow.Schema, e.g. pa.schema([('y', pa.float64())]), "
            f"got {type(output_schema).__name__} {output_schema!r}."
        )
    df = dense_vectors(df)  # Spark ML vectors (VectorAssembler's) as float64 arrays
    if not getattr(df, "isStreaming", False):
        # Spark spends tens of ms on every Python task and each opens its exchange streams:
        # 200 partitions (a join's output) of 100,000 rows took 7 s a pass against 0.5 s
        df = feeder.few_tasks(df)
    in_schema = arrow_schema_of(df)
    for c in passthrough:
        if c not in in_schema.names:
            raise SchemaError(
                f"passthrough column {c!r} is not in the DataFrame; its columns are {in_schema.names}."
            )
    send = list(columns) if columns is not None else list(in_schema.names)
    for c in send:
        if c not in in_schema.names:
            raise SchemaError(f"column {c!r} is not in the DataFrame; its columns are {in_schema.names}.")
    send = _tensor_columns(in_schema, send, passthrough, explicit=columns is not None)
    servers = feeder.live_workers()
    if not servers:
        raise FeedError("no chief or worker node is running main, so nothing can answer inference.")
    # requests go to the nodes already serving, if any: a worker whose main is still busy
    # (loading its model, training) would hold its share of the partitions until it serves
    servers = feeder.serving_workers() or servers
    schema_from = "probe" if output_schema is None else "output_schema"
    # a few rows: predict's output columns (the probe), and the rows' size for Spark 3.5's
    # Arrow batches (a query planned in the user's code: only the session's setting reaches it)
    sample = None
    if not getattr(df, "isStreaming", False) and (output_schema is None or arrow_batches_by_rows(df.sparkSession)):
        sample = sample_arrow(df, 4)
        if sample.num_rows:
            bound_session_batches(df.sparkSession, max(1, sample.nbytes // sample.num_rows), "cluster.inference")
    if output_schema is None:
        output_schema = _probe_output_schema(feeder, sample.select(send), servers[0], feed_timeout)
    else:
        output_schema = _declared_outputs(output_schema)
    clash = [f.name for f in output_schema if f.name in passthrough]
    if clash:
        raise SchemaError(
            f"predict returns column(s) {clash}, which are also passthrough columns; rename the "
            f"outputs or drop them from passthrough."
        )
    fields = [in_schema.field(c) for c in passthrough] + list(output_schema)
    out_schema = pa.schema(fields)
    inferrer = PartitionInferrer(
        secret=feeder.secret,
        locations=[(n.node_id, n.flight_location) for n in servers],
        send_columns=send,
        passthrough=passthrough,
        output_schema_ipc=out_schema.serialize().to_pybytes(),
        max_rows=max_rows,
        timeout=feed_timeout,
        tls_root_certs=feeder.tls_root,
        schema_from=schema_from,
    )
    return map_in_arrow(df, inferrer, from_arrow_schema(out_schema))


def _probe_output_schema(feeder, sample, node, timeout) -> pa.Schema:  # type: ignore[no-untyped-def]
    """Ask one node to answer ``sample``'s rows (a few, of the columns predict reads), to
    learn predict's output columns and types."""
    import pyarrow.flight as flight

    from dataplane.rpc import call_options, connect
    from feeders.flight import flight_message
    from feeders.protocol import InferCommand

    if sample.num_rows == 0:
        raise FeedError(
            "inference on an empty DataFrame: there is no row to learn predict's output columns "
            "from; pass output_schema= (a pyarrow.Schema) to cluster.inference."
        )
    client = connect(node.flight_location, tls_root_certs=feeder.tls_root)
    desc = flight.FlightDescriptor.for_command(InferCommand(probe=True).encode())
    writer, reader = client.do_exchange(desc, options=call_options(feeder.secret, timeout))
    batch = sample.combine_chunks().to_batches()[0]
    try:
        writer.begin(batch.schema)
        writer.write_with_metadata(batch, pa.py_buffer(b"0"))
        reply = reader.read_chunk()
        writer.done_writing()
    except flight.FlightError as e:
        raise FeedError(
            f"inference: node {node.node_id} could not answer a probe batch: {flight_message(e)}"
        ) from e
    finally:
        try:  # closed here, or Arrow prints the stream's error again when it is collected
            writer.close()
        except flight.FlightError:
            pass
        client.close()
    schema = reply.data.schema
    # Spark has no unsigned or half types: widen them so the output DataFrame can hold them.
    return pa.schema([pa.field(f.name, _spark_type(f.type)) for f in schema])


def _declared_outputs(schema: pa.Schema) -> pa.Schema:
    """``output_schema`` in types a Spark DataFrame can hold (as a probed answer's are); a
    type that has none is a SchemaError naming the output."""
    from pyspark.sql.pandas.types import from_arrow_type

    fields = []
    for f in schema:
        t = _spark_type(f.type)
        try:
            from_arrow_type(t)
        except Exception as e:  # noqa: BLE001 - pyspark's own error types differ by version
            raise SchemaError(
                f"output_schema declares output {f.name!r} as {f.type}, which a Spark DataFrame "
                f"cannot hold ({type(e).__name__}: {str(e).splitlines()[0]}). Declare a "
                f"number, string, binary, bool, date or timestamp type, or a list of them."
            ) from None
        fields.append(pa.field(f.name, t))
    return pa.schema(fields)


def _spark_type(t: pa.DataType) -> pa.DataType:
    """``t``, or the type Spark holds its values in (lists of them included)."""
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return pa.list_(_spark_type(t.value_type))
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_unsigned_integer(t):
        return pa.int64()
    if pa.types.is_float16(t):
        return pa.float32()
    return t


def _tensor_columns(schema: pa.Schema, send: list[str], passthrough: Sequence[str], *, explicit: bool) -> list[str]:
    """The columns to send predict, checked here rather than by the node's probe: each must
    have a TensorFlow type. By default (every column) a passthrough column that has none (a
    decimal key, a map of attributes) is left out, since predict could not read it and it
    reaches the output from Spark's side; any other such column fails, naming the fix."""
    from formats.schema import check_unique_names, untensorable_columns

    check_unique_names(schema, "inference reads")
    untensorable = untensorable_columns(schema, send)
    left_out = {n for n, _ in untensorable}
    keep = [n for n in send if n not in left_out]
    bad = [(n, e) for n, e in untensorable if explicit or n not in passthrough]
    if bad:
        names = [n for n, _ in bad]
        fix = (f"leave {'it' if len(bad) == 1 else 'them'} out of columns=" if explicit else
               f"pass columns= naming the columns predict reads (without {names}), or "
               f"df.drop({', '.join(repr(n) for n in names)})")
        raise SchemaError(f"{bad[0][1]} inference sends predict "
                          f"{'the columns named in columns=' if explicit else 'every column'}; {fix}.")
    if not keep:
        raise SchemaError(
            f"inference: no column of the DataFrame can be sent to predict as a tensor (its "
            f"columns: {schema.names}); cast the inputs predict reads to numbers, "
            f"strings or arrays of them."
        )
    return keep

