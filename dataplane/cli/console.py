"""What every ``dataplane`` command shows on the terminal: one line per problem, no Spark chatter.

Three things, all owned by the console script (a library never touches the process's logging
or file descriptors):

- :func:`problem_line`: the one line ``dataplane <cmd>: error: ...`` prints for an exception,
  whatever raised it: our own errors as written, a failed Spark job as the Python error its task
  raised (not the JVM stack), anything else as ``Type: message``.
- :func:`quiet_spark`: keeps Spark's start-up chatter (the log4j profile line, "Setting default
  log level", NativeCodeLoader and other JVM warnings, the console progress bar, the JDK's
  "Using incubator modules" notice) off the terminal. The JVM that PySpark starts gets a log4j2
  configuration that logs only fatal errors (through ``SPARK_SUBMIT_OPTS``, read by
  ``spark-submit``), and the process's file descriptor 2, which the JVM and every other child
  inherit, goes through a filter that drops the lines log4j cannot reach (and TensorFlow's
  start-up notices on a machine without a GPU, which no log level silences); Python's own
  ``sys.stderr`` keeps the real terminal, so progress bars still see a TTY.

- :class:`SlowStep`: progress lines for a step that is quick on small data and long on big
  data (every Parquet footer read, TFRecord files counted to their ends): nothing while it is
  quick, then what it does and how far it is.

``-v`` turns all of it off: Spark logs as it always does and errors come with their traceback.
"""

from __future__ import annotations

import io
import os
import re
import sys
import threading
from typing import Any

from dataplane.errors import TF_STARTUP_NOISE
from formats.fs import write_text_atomic

__all__ = ["problem_line", "quiet_spark", "spark_log_level", "LOG4J2_QUIET", "SlowStep", "SLOW_STEP_MARKS"]

# A step that has taken this long (seconds) says what it does, then how far it is at this interval.
SLOW_STEP_MARKS = (2.0, 10.0)

#: log4j2 configuration for a quiet JVM (fatal only; a failed job's task tracebacks are ERRORs
#: and would fill the terminal with what the command already says in one line).
LOG4J2_QUIET = """\
rootLogger.level = fatal
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.spark.name = org.apache.spark
logger.spark.level = fatal
logger.hadoop.name = org.apache.hadoop
logger.hadoop.level = fatal
"""

# Lines from the JVM (and PySpark's launcher) that say nothing a user of the CLI can act on.
_CHATTER = re.compile(
    r"^(WARNING: Using incubator modules"
    r"|Using Spark's default log4j profile"
    r"|Setting default log level to"
    r"|To adjust logging level use sc\.setLogLevel"
    r"|\S+ \S+ WARN NativeCodeLoader"
    r"|\s*\[Stage \d+:)"
)


def _chatter(line: str) -> bool:
    """A line of Spark's start-up chatter, or of TensorFlow's (this process imports it too)."""
    return bool(_CHATTER.match(line) or TF_STARTUP_NOISE.search(line))


_PY_EXC = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Warning|Exit|Interrupt)): ?(.*)$")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def jvm_exited_line(spark: Any = None) -> str | None:
    """The line a command prints when Spark's JVM (``spark``'s, or the process's active
    SparkContext's) has exited under it, else None."""
    from dataplane.errors import jvm_gone

    if not jvm_gone(spark):
        return None
    return (
        "Spark's JVM has exited, most often because it ran out of memory "
        "(java.lang.OutOfMemoryError; with -v its log says): run the command again with "
        "more, e.g. SPARK_DRIVER_MEMORY=4g in front of it (in local mode the tasks run "
        "inside the driver's JVM), or on a cluster more spark.executor.memory"
    )


def problem_line(exc: BaseException) -> str:
    """One line naming what went wrong, for ``dataplane <cmd>: error: <line>``.

    Our own errors (:class:`~dataplane.errors.DataplaneError`) and ``ValueError``/``OSError``
    print their message; a failed Spark job prints the Python exception its task raised (the
    last ``SomeError: message`` line of the task's traceback) instead of the JVM stack; anything
    else prints ``Type: message``.
    """
    from dataplane.errors import DataplaneError

    gone = jvm_exited_line()
    if gone is not None:
        return gone
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a py4j error whose JVM is gone cannot fetch its text
        return type(exc).__name__
    if "Traceback (most recent call last)" in text:
        tail = text.rsplit("Traceback (most recent call last)", 1)[1].splitlines()
        for line in reversed(tail):
            m = _PY_EXC.match(line.strip())
            if m and not m.group(1).startswith("py4j"):
                name = m.group(1).rsplit(".", 1)[-1]
                return _one_line(f"{name}: {m.group(2)}".split(" SQLSTATE")[0].split("\tat ")[0])
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and not ln.startswith(("\tat ", "JVM"))]
    message = _one_line(" ".join(lines[:3])) if lines else ""
    if isinstance(exc, (DataplaneError, ValueError, OSError)) and message:
        return message
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def spark_log_level(verbose: int) -> str:
    """The level a command sets on its SparkContext: Spark's own WARN with ``-v``, else FATAL."""
    return "WARN" if verbose else "FATAL"


class _Filter(threading.Thread):
    """Copies lines from a pipe to the real stderr, dropping chatter (:func:`_chatter`)."""

    def __init__(self, read_fd: int, out_fd: int) -> None:
        super().__init__(name="dataplane-stderr-filter", daemon=True)
        self.read_fd = read_fd
        self.out_fd = out_fd

    def run(self) -> None:
        with io.open(self.read_fd, "rb", buffering=0, closefd=True) as pipe:
            pending = b""
            while True:
                try:
                    chunk = pipe.read(65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                pending += chunk
                # Progress bars end in \r, not \n: treat both as line ends.
                *lines, pending = re.split(rb"(?<=[\n\r])", pending)
                self._emit(lines)
            if pending:
                self._emit([pending])

    def _emit(self, lines: list[bytes]) -> None:
        keep = [ln for ln in lines if not _chatter(ln.decode("utf-8", "replace"))]
        if keep:
            try:
                os.write(self.out_fd, b"".join(keep))
            except OSError:
                pass


def _filter_stderr() -> bool:
    """Route fd 2 through :class:`_Filter`; ``sys.stderr`` keeps writing to the terminal.

    Only when ``sys.stderr`` is the process's own fd 2 (not under a test's capture, not when
    something already replaced it).
    """
    try:
        if sys.stderr is None or sys.stderr.fileno() != 2:
            return False
    except (AttributeError, OSError, ValueError):
        return False
    sys.stderr.flush()
    terminal = os.dup(2)
    read_fd, write_fd = os.pipe()
    _Filter(read_fd, terminal).start()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(terminal, "w", closefd=False), encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
        errors="backslashreplace", line_buffering=True,
    )
    return True


def _log4j2_file() -> str:
    """The quiet log4j2 configuration as a file of this process's, removed when it exits
    (Spark's JVM reads it once, at start)."""
    import atexit
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"dataplane-log4j2-quiet-{os.getpid()}.properties")
    write_text_atomic(path, LOG4J2_QUIET)
    atexit.register(_remove_quietly, path)
    return path


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def quiet_spark(environ: Any = None, *, filter_stderr: bool = True) -> None:
    """Keep Spark's start-up chatter off the terminal for the rest of this process.

    Call before the first SparkSession starts. A log4j2 configuration the user already chose
    (``-Dlog4j2.configurationFile`` in ``SPARK_SUBMIT_OPTS``, or ``log4j2.properties`` in
    ``SPARK_CONF_DIR``) is left alone.
    """
    env = os.environ if environ is None else environ
    opts = env.get("SPARK_SUBMIT_OPTS", "")
    conf_dir = env.get("SPARK_CONF_DIR")
    own = "log4j2.configurationFile" in opts or (
        conf_dir and os.path.exists(os.path.join(conf_dir, "log4j2.properties"))
    )
    if not own:
        try:
            target = _log4j2_file()
        except OSError:
            target = None
        if target:
            env["SPARK_SUBMIT_OPTS"] = f"{opts} -Dlog4j2.configurationFile=file:{target}".strip()
    if filter_stderr:
        _filter_stderr()


class SlowStep:
    """Lines for ``say`` while a step runs: none while it is quick; once it has run for
    ``marks[0]`` seconds, the line on what it does and one on how far it is, then one on how
    far it is every ``marks[1]`` seconds (``SLOW_STEP_MARKS`` by default).

    The step calls :meth:`tick` after each unit of work."""

    def __init__(self, say: Any, marks: tuple[float, float] | None = None) -> None:
        import time

        self._clock = time.monotonic
        self._say, self._marks = say, SLOW_STEP_MARKS if marks is None else marks
        self._start = self._last = self._clock()
        self._said = False

    def tick(self, done: int, total: int, head: str, line: Any) -> None:
        """After unit ``done`` of ``total``: if a line is due, ``line(seconds so far)``, after
        ``head`` the first time. Nothing after the last unit: the step is over."""
        first, every = self._marks
        now = self._clock()
        if done >= total or now - self._last < (every if self._said else first):
            return
        if not self._said:
            self._say(head)
            self._said = True
        self._say(line(now - self._start))
        self._last = self._clock()
