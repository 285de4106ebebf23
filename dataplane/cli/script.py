"""The ``dataplane`` console script.

Each sub-command lives in ``dataplane/cli/<name>.py`` and exposes ``add_arguments(parser)``
and ``run(args) -> int``. Modules are imported only for the command being run (or asked about),
and none of them imports Spark or TensorFlow at import time, so ``--help`` is instant.

Every command gets the same terminal behaviour from here (see :mod:`dataplane.cli.console`):
an exception that escapes a command prints one line, ``dataplane <cmd>: error: <what>``, and
exits 1 (130 on Ctrl-C) instead of a traceback; Spark's start-up chatter is kept off the
terminal. ``-v`` shows both again.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Sequence

__all__ = ["main"]

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("dataplane.cli.demo", "train a Keras model on digits through the push path"),
    "bench": ("dataplane.cli.bench", "measure throughput of every data path against peers"),
    "export": ("dataplane.cli.export", "convert Parquet <-> TFRecord as a Spark job"),
    "inspect": ("dataplane.cli.inspect", "show a Parquet/TFRecord dataset's schema and TF spec"),
}


def _parser(only: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dataplane",
        description="TensorFlow on Spark with an Arrow Flight data plane.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        # also after the command (`dataplane bench ... -v`), as its error lines suggest;
        # SUPPRESS keeps a `dataplane -v bench` given before it
        p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                       help="more log output, and tracebacks with errors")
        if only == name:
            importlib.import_module(module).add_arguments(p)
        else:
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _not_py4j_noise(record: logging.LogRecord) -> bool:
    """Drop py4j's own reports of a call it lost (Ctrl-C in a call, PySpark's SIGINT handler
    calling into the JVM from inside one, a connection then closed), which it logs with
    tracebacks, some on the root logger; the command's one-line error or "interrupted"
    says what happened (-v keeps them)."""
    return not (record.name.startswith("py4j") or record.getMessage().endswith("while sending command."))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a in COMMANDS), None)
    args = _parser(command).parse_args(argv)
    if not args.verbose:
        from dataplane.cli.console import quiet_spark

        # Before the command starts Spark: the JVM reads the log4j2 setting at launch;
        # before logging, whose handler must write to the terminal, not the filter.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        quiet_spark()
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # py4j logs tracebacks of the calls it loses (Ctrl-C): we say it in a line
        for handler in logging.getLogger().handlers:
            if _not_py4j_noise not in handler.filters:
                handler.addFilter(_not_py4j_noise)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"dataplane {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the console script's last word; -v re-raises
        if args.verbose:
            raise
        from dataplane.cli.console import problem_line

        print(f"dataplane {args.command}: error: {problem_line(exc)} (-v shows the traceback)",
              file=sys.stderr)
        return 1

