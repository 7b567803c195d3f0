"""The package's import graph: no cycles, and every layer imports only the layers below it.

Read statically from the source (every ``import``/``from`` statement, also inside functions and under
``TYPE_CHECKING``), so a late import that would close a cycle at run time is caught as well.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fedguide"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The fedguide modules ``path`` imports (``from pkg import mod`` counts as importing ``pkg.mod``)."""
    out: set[str] = set()
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in out if m in modules and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    return {m: imported(p, set(files)) for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle(graph):
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Each layer may import only from the layers listed for it (and itself).
BELOW = {
    "fedguide.core": {"fedguide.registry"},  # the errors a user sees (ConfigError) sit below everything
    "fedguide.registry": set(),
    "fedguide.config": {"fedguide.registry", "fedguide.core"},  # the device specs a config may name
    "fedguide.models": {"fedguide.registry", "fedguide.config"},
    "fedguide.data": {"fedguide.core", "fedguide.registry", "fedguide.config", "fedguide.models"},
    "fedguide.guidance": {"fedguide.core", "fedguide.registry", "fedguide.config", "fedguide.data",
                          "fedguide.models"},
    "fedguide.methods": {"fedguide.core", "fedguide.registry", "fedguide.config", "fedguide.data",
                         "fedguide.models", "fedguide.guidance"},
    # A report reads run folders through the one module that knows what a run folder holds.
    "fedguide.report": {"fedguide.core", "fedguide.registry", "fedguide.config", "fedguide.fl.run_folder"},
}


def layer(module: str) -> str:
    return next((k for k in sorted(BELOW, key=len, reverse=True) if module == k or module.startswith(k + ".")), module)


@pytest.mark.parametrize("lower", sorted(BELOW))
def test_every_import_points_down(graph, lower):
    allowed = BELOW[lower] | {lower, "fedguide"}
    wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() if layer(m) == lower
                   for d in deps if layer(d) not in allowed)
    assert wrong == [], "imports that reach up or sideways:\n" + "\n".join(wrong)


def test_no_method_imports_the_engine(graph):
    assert not [m for m, deps in graph.items() if m.startswith("fedguide.methods")
                and any(d.startswith("fedguide.fl") for d in deps)]


def test_the_engine_names_no_runtime():
    from fedguide.fl.runtime import RUNTIMES

    text = (SRC / "fl" / "engine.py").read_text()
    assert RUNTIMES.names() and not [n for n in RUNTIMES.names() if f'"{n}"' in text or f"'{n}'" in text]


# Inside fl/, bottom to top: a module may import its own layer and the ones below, never one above.
# The runtime interface is at the bottom so the engine reaches every runtime through it alone, and the
# runtimes, which may use the engine (a Flower deployment runs it in its ServerApp), sit on top.
FL_LAYERS = [
    # the runtime interface, one client's round, and the parts of a run the engine puts together
    {"fedguide.fl", "fedguide.fl.runtime", "fedguide.fl.client_step", "fedguide.fl.run_lock",
     "fedguide.fl.checkpoint", "fedguide.fl.evaluation", "fedguide.fl.loggers", "fedguide.fl.participation"},
    {"fedguide.fl.run_folder"},  # what a run folder holds (its lock)
    {"fedguide.fl.setup"},  # a config opened: data, model, method, runtime parameters
    {"fedguide.fl.preflight"},  # a config checked before anything runs
    {"fedguide.fl.engine"},  # the round loop
    {"fedguide.fl.runtimes"},  # every runtime, at any depth
]


def fl_layer(module: str) -> int:
    for i, names in reversed(list(enumerate(FL_LAYERS))):
        if module in names or (module.startswith("fedguide.fl.runtimes.") and "fedguide.fl.runtimes" in names):
            return i
    raise AssertionError(f"{module} has no place in FL_LAYERS (tests/test_import_structure.py): add it to the "
                         "lowest layer that holds every fl module it imports")


def test_no_import_runs_up_inside_fl(graph):
    fl = {m: {d for d in deps if d.startswith("fedguide.fl")} for m, deps in graph.items()
          if m == "fedguide.fl" or m.startswith("fedguide.fl.")}
    upward = sorted(f"{m} (layer {fl_layer(m)}) -> {d} (layer {fl_layer(d)})"
                    for m, deps in fl.items() for d in deps if fl_layer(d) > fl_layer(m))
    assert upward == [], "imports that reach up inside fl/:\n" + "\n".join(upward)
    assert cycles(fl) == []


def test_the_runtime_interface_stands_on_core_config_and_the_method_interface(graph):
    allowed = ("fedguide.core", "fedguide.registry", "fedguide.config", "fedguide.methods.base",
               "fedguide.fl.client_step")
    assert sorted(d for d in graph["fedguide.fl.runtime"] if not d.startswith(allowed)) == []


def test_the_layer_check_catches_an_upward_import():
    assert fl_layer("fedguide.fl.runtimes.flower.server") > fl_layer("fedguide.fl.engine") > \
        fl_layer("fedguide.fl.setup") > fl_layer("fedguide.fl.runtime")
    with pytest.raises(AssertionError, match="no place in FL_LAYERS"):
        fl_layer("fedguide.fl.new_module")
