"""The packages' imports point one way and never run in a circle.

Layers, lowest first: ``formats`` <- ``feeders`` <- ``dataplane`` <- ``benchmarks``. A module may
import its own package and any lower one, never a higher one: this holds for every import
statement, including those inside functions (they run later, but they still tie the lower
package to the higher one). Between modules, the imports that run at import time (module and
class bodies; not function bodies, not ``if TYPE_CHECKING:`` blocks) form no cycle.

Inside ``dataplane``, modules live in rooms by role (``driver/``, ``node/``, ``workloads/``,
``compat/``, ``cli/``) around a small top (the public door and what the driver and the node
share); each imports only the parts of ``dataplane`` that :data:`ROOM_IMPORTS` allows it.

The walk reads the source with :mod:`ast`; it imports nothing.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"formats": 0, "feeders": 1, "dataplane": 2, "benchmarks": 3}

# Upward imports that stay, by design. ``dataplane bench`` is the CLI's door into the
# benchmarks/ folder (which is not installed): dataplane/cli/bench.py imports ``benchmarks``
# inside its functions only, when the command runs, so ``import dataplane`` never loads it.
# A (file, module) pair covers that module and its submodules.
UPWARD_BY_DESIGN = {
    ("dataplane/cli/bench.py", "benchmarks"),
}

# Upward imports tolerated while being fixed: (file, imported module). Empty since issue #20's
# moves landed; test_the_allow_list_has_no_stale_entries keeps it from outliving its entries.
UPWARD_IMPORTS_NOT_YET_FIXED: set[tuple[str, str]] = set()

# Import cycles between modules not fixed yet (same rule: delete when fixed, never add). Each
# entry is the sorted tuple of the modules in one cycle.
CYCLES_NOT_YET_FIXED: set[tuple[str, ...]] = set()

# Inside dataplane/: a small top (the public door and what the driver and the node share) and
# rooms by role. Each room, and each top module, may import from dataplane only itself and what
# ROOM_IMPORTS lists. ``dataplane`` (the package: the public names) matches only itself; every
# other name covers its submodules too.
TOP = {"dataplane", "dataplane.errors", "dataplane.ml", "dataplane.topology", "dataplane.rpc"}
ROOMS = {"dataplane.driver", "dataplane.node", "dataplane.workloads", "dataplane.compat", "dataplane.cli"}
SHARED = {"dataplane.errors", "dataplane.topology", "dataplane.rpc"}
PUBLIC = {"dataplane", "dataplane.errors"}
ROOM_IMPORTS: dict[str, set[str]] = {
    # the shared ground stands on formats and feeders only
    "dataplane.errors": set(),
    "dataplane.topology": set(),
    "dataplane.rpc": set(),
    # the driver starts nodes through the launch task, its one door into the node's room; the
    # node never imports the driver's code (they talk over Flight)
    "dataplane.driver": SHARED | {"dataplane.node.launcher"},
    "dataplane.node": SHARED,
    # on top: built on the public names, never on the driver's or the node's insides
    "dataplane.workloads": PUBLIC,
    "dataplane.ml": PUBLIC | {"dataplane.workloads"},
    "dataplane.compat": PUBLIC,
    "dataplane.cli": PUBLIC,
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing file, relative to the repository root
    module: str  # the importing module's dotted name
    target: str  # the imported module's dotted name (a submodule when one exists)
    line: int
    at_import_time: bool  # module or class body, outside `if TYPE_CHECKING:`


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the four packages."""
    found = {}
    for pkg in LAYERS:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_of(name: str, path: Path) -> list[Import]:
    rel = path.relative_to(ROOT).as_posix()
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: list[Import] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        out = []
        for a in node.names:
            sub = f"{base}.{a.name}"
            out.append(sub if sub in MODULES else base)
        return out

    def visit(node: ast.AST, at_import_time: bool) -> None:
        for child in ast.iter_child_nodes(node):
            now = at_import_time
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                now = False
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in targets(child):
                    found.append(Import(rel, name, t, child.lineno, now))
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), now)
                continue
            visit(child, now)

    visit(ast.parse(path.read_text(), filename=rel), True)
    return found


IMPORTS = [imp for name, path in MODULES.items() for imp in _imports_of(name, path)]


def _covers(pairs: set[tuple[str, str]], imp: Import) -> tuple[str, str] | None:
    for source, module in pairs:
        if imp.source == source and (imp.target == module or imp.target.startswith(module + ".")):
            return (source, module)
    return None


def _upward(imp: Import) -> bool:
    src, dst = imp.module.split(".")[0], imp.target.split(".")[0]
    return dst in LAYERS and LAYERS[dst] > LAYERS[src]


def _cycles() -> list[tuple[str, ...]]:
    """Strongly connected components of more than one module in the import-time graph."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        if imp.at_import_time and imp.target in MODULES and imp.target != imp.module:
            graph[imp.module].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []

    def strongconnect(v: str) -> None:  # Tarjan; the graph is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


def test_the_walk_sees_every_package():
    for pkg in LAYERS:
        assert pkg in MODULES and any(m.startswith(pkg + ".") for m in MODULES), pkg
    # Function-level imports are seen (the CLI's bench command imports benchmarks in a function).
    assert any(
        i.source == "dataplane/cli/bench.py" and i.target.startswith("benchmarks") and not i.at_import_time
        for i in IMPORTS
    )


def test_no_module_imports_a_higher_layer():
    allowed = UPWARD_BY_DESIGN | UPWARD_IMPORTS_NOT_YET_FIXED
    bad = sorted(
        {
            f"{i.source}:{i.line} imports {i.target} ({i.module.split('.')[0]} may import only "
            f"{', '.join(p for p, n in LAYERS.items() if n <= LAYERS[i.module.split('.')[0]])})"
            for i in IMPORTS
            if _upward(i) and _covers(allowed, i) is None
        }
    )
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules():
    cycles = [c for c in _cycles() if c not in CYCLES_NOT_YET_FIXED]
    assert not cycles, "import cycles (at import time):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_allow_list_has_no_stale_entries():
    used = {_covers(UPWARD_IMPORTS_NOT_YET_FIXED, i) for i in IMPORTS if _upward(i)}
    stale = sorted(UPWARD_IMPORTS_NOT_YET_FIXED - used)
    assert not stale, f"fixed, so delete from UPWARD_IMPORTS_NOT_YET_FIXED: {stale}"
    gone = sorted(CYCLES_NOT_YET_FIXED - set(_cycles()))
    assert not gone, f"fixed, so delete from CYCLES_NOT_YET_FIXED: {gone}"
    for pair in UPWARD_BY_DESIGN:
        assert any(_covers({pair}, i) for i in IMPORTS), f"{pair} no longer imports: delete it"


def _within(module: str, name: str) -> bool:
    return module == name or (name != "dataplane" and module.startswith(name + "."))


def test_every_dataplane_module_is_at_the_top_or_in_a_room():
    assert set(ROOM_IMPORTS) == (TOP - {"dataplane"}) | ROOMS
    stray = sorted(
        m for m in MODULES
        if m.split(".")[0] == "dataplane" and m not in TOP and not any(_within(m, r) for r in ROOMS)
    )
    assert not stray, f"modules at the top of dataplane/ that are neither public nor shared: {stray}"
    for room in ROOMS:
        assert room in MODULES, f"{room} is not a package any more: update ROOMS"


def test_rooms_import_only_what_they_may():
    bad = []
    for i in IMPORTS:
        room = next((r for r in ROOM_IMPORTS if _within(i.module, r)), None)
        if room is None or i.target.split(".")[0] != "dataplane":
            continue
        if _within(i.target, room) or any(_within(i.target, ok) for ok in ROOM_IMPORTS[room]):
            continue
        allowed = ", ".join(sorted(ROOM_IMPORTS[room])) or "nothing else from dataplane"
        bad.append(f"{i.source}:{i.line} imports {i.target} ({room} may import {allowed})")
    assert not bad, "imports across dataplane's rooms:\n" + "\n".join(sorted(bad))


def _loads_excused(module: str) -> bool:
    """Whether importing ``module`` runs (at import time) a file excused above."""
    excused = {src for src, _ in UPWARD_IMPORTS_NOT_YET_FIXED}
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if MODULES[m].relative_to(ROOT).as_posix() in excused:
            return True
        todo += [i.target for i in IMPORTS if i.module == m and i.at_import_time and i.target in MODULES]
    return False


def test_formats_and_feeders_load_without_dataplane():
    lower = sorted(m for m in MODULES if m.split(".")[0] in ("formats", "feeders"))
    wanted = [m for m in lower if not _loads_excused(m)]
    assert "formats" in wanted and "feeders" in wanted
    code = (
        "import importlib, sys\n"
        f"for m in {wanted!r}:\n"
        "    importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dataplane', 'benchmarks')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing formats and feeders loaded: {out.stdout.strip()}"


@pytest.mark.parametrize("pkg", ["formats", "feeders", "dataplane", "benchmarks"])
def test_importing_a_package_has_no_side_effects(pkg):
    """Importing a package loads neither TensorFlow nor Spark and starts no thread."""
    code = (
        "import sys, threading\n"
        f"import {pkg}\n"
        "heavy = sorted(m for m in ('tensorflow', 'pyspark', 'tf_keras') if m in sys.modules)\n"
        "print(heavy, threading.active_count())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] 1", out.stdout


def test_moved_names_keep_their_old_homes():
    """What moved down a layer is still importable, as the same objects, from where it was."""
    import dataplane.errors
    import dataplane.rpc
    import feeders.flight
    import feeders.fs
    import formats.errors
    import formats.fs
    from formats.schema import column_specs

    for old, new in [
        (dataplane.errors, formats.errors),
        (feeders.fs, formats.fs),
        (dataplane.rpc, feeders.flight),
    ]:
        for name in new.__all__:
            assert getattr(old, name) is getattr(new, name), (old.__name__, name)
        assert set(new.__all__) <= set(old.__all__), old.__name__
    import pyarrow as pa

    with pytest.raises(dataplane.errors.SchemaError):  # raised by formats, caught by the old name
        column_specs(pa.schema([("m", pa.map_(pa.string(), pa.int64()))]))
