"""The Python the tests' executors, and so their TF nodes, run: this venv less the packages that
only the tests' driver side uses.

`import tensorflow` imports Keras, and Keras imports scikit-learn (its sklearn wrapper), SciPy
(through scikit-learn) and matplotlib (its image-gallery plot) whenever they are installed. The
tests install them for the driver side only: scikit-learn's digits as data, matplotlib for the
bench pictures. In every process that imports TensorFlow they cost 2.5 s of CPU of 7.9
(current stack) and 1.4 s of 5.5 (compat), measured 2026-12-03 by `import tensorflow` with them
hidden; the suite starts a few hundred TF nodes a stack, on 2 cores shared by both stacks.

So the executors run a venv whose site-packages holds a link to each entry of this one's but
those three distributions' (nothing is copied or compiled again: the links share the packages'
byte code). No product code imports them, nor do the suite's own node mains; a node that did
would fail with ModuleNotFoundError, not pass unnoticed. The examples are users' programs and
their chiefs do load scikit-learn's digits (to evaluate): their tests run the executors on this
venv itself (`full_python`). The view lives in a temporary folder for the session's life.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import sysconfig
import tempfile
import venv
from importlib import metadata

DRIVER_ONLY = ("scikit-learn", "scipy", "matplotlib")


def _top_level_entries(dist: metadata.Distribution) -> set[str]:
    """Names directly in site-packages that the distribution's RECORD installed."""
    return {p.parts[0] for p in dist.files or () if p.parts[0] not in ("..", "__pycache__")}


def build() -> str | None:
    """Make the view and return its Python, or None where there is nothing to leave out (none of
    DRIVER_ONLY installed) or this Python is not a venv's."""
    if sys.prefix == sys.base_prefix:
        return None
    site = sysconfig.get_paths()["purelib"]
    left_out: set[str] = set()
    for name in DRIVER_ONLY:
        try:
            left_out |= _top_level_entries(metadata.distribution(name))
        except metadata.PackageNotFoundError:
            continue
    if not left_out:
        return None
    root = tempfile.mkdtemp(prefix="dataplane-tests-executor-python-")
    atexit.register(shutil.rmtree, root, True)
    venv.EnvBuilder(symlinks=True, with_pip=False).create(root)
    view = os.path.join(root, os.path.relpath(site, sys.prefix))
    os.makedirs(view, exist_ok=True)
    for entry in os.listdir(site):
        if entry not in left_out:
            os.symlink(os.path.join(site, entry), os.path.join(view, entry))
    return os.path.join(root, "bin", "python")


@contextlib.contextmanager
def full_python(sc):
    """Within the block, the Spark jobs (and so the TF nodes) that ``sc`` starts run this venv's
    own Python, every package included. PySpark takes the executors' Python from
    ``SparkContext.pythonExec`` for each function it ships, so the change holds from the next
    job on; the workers already started for the view stay idle meanwhile."""
    before = sc.pythonExec
    sc.pythonExec = sys.executable
    try:
        yield
    finally:
        sc.pythonExec = before
