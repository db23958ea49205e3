"""Import layers, read from the source with ``ast`` (nothing is imported).

- No import cycle between modules of asyncflow. Every import statement counts: at module
  level, inside a function, under ``if TYPE_CHECKING:``.
- ``asyncflow.rpc`` is below ``asyncflow.transfer_queue`` and ``asyncflow.single_controller``:
  nothing it imports, directly or through other modules, is in either.
- The packages of asyncflow stand in layers (``LAYERS``, lowest first): a module imports only
  from its own package and from packages of lower layers, never up nor sideways. Every
  package has its layer: a new one must be placed. So the rollout engines build on
  ``weight_sync`` and never reach up into the role workers.

What an import statement depends on: ``import a.b.c`` on the deepest module of asyncflow
it names; ``from X import n`` on ``X.n`` when that is a module (a submodule imported by
name), else on ``X`` itself (``n`` is defined by X's code). The parent packages that
Python imports first are not counted: a package whose ``__init__`` re-exports its
submodules would otherwise be a cycle with each of them.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "asyncflow"
RPC = "asyncflow.rpc"
ABOVE_RPC = ("asyncflow.transfer_queue", "asyncflow.single_controller")

# The packages (and top-level modules) of asyncflow, lowest layer first, as the code has them:
# each imports only from layers before its own. "__init__" is the package itself (its version).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cpu_account",),  # the CPU account: the RPC layer and the TransferQueue record spans too
    # nothing of asyncflow; column_names: the shared column names, for every layer above
    ("__init__", "algorithm_config", "column_names", "metrics", "models", "platform", "rewards", "rpc"),
    ("algorithms", "planning", "transfer_queue"),
    ("single_controller",),  # takes its TransferQueue layout as its own dataclass, nothing of the app's config
    ("config",),
    ("data", "resolved"),  # resolved: the run's config resolved once (derived values), for driver and workers
    ("weight_sync",),  # protocol, send, receive, wire groups, sinks, intake, publish_and_swap
    ("engines",),  # training and rollout engines; vLLM's workers join the weight-sync groups
    ("agents",),
    ("workflow",),  # stages, recipes, the executor
    ("training", "workers"),  # the trainer, its phases and roles; the role workers
    ("simulation",),
    ("launcher",),
    ("cli",),
)

Edge = tuple[str, int]  # (imported module, line of the import statement)


def _in(module: str, packages: tuple[str, ...] | str) -> bool:
    packages = (packages,) if isinstance(packages, str) else packages
    return any(module == p or module.startswith(p + ".") for p in packages)


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        out[".".join(parts)] = (path, is_pkg)
    return out


def _known(name: str | None, modules: dict) -> str | None:
    """The deepest module of asyncflow that ``name`` (dotted) lies in, or None."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(name: str, modules: dict) -> dict[str, int]:
    """The modules of asyncflow that module ``name`` imports, each with its first line."""
    path, is_pkg = modules[name]
    package = name if is_pkg else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != name:
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_known(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in modules else _known(source, modules), node.lineno)
    return found


def _graph() -> dict[str, dict[str, int]]:
    modules = _modules()
    return {m: _imports(m, modules) for m in modules}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _path(graph: dict[str, dict[str, int]], start: str, goal: str, within: set[str] | None = None) -> list[str]:
    """A shortest import path start -> ... -> goal (breadth first), or []."""
    prev: dict[str, str] = {}
    todo = deque([start])
    while todo:
        v = todo.popleft()
        for w in sorted(graph[v]):
            if within is not None and w not in within:
                continue
            if w == goal:
                path = [goal, v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return path[::-1]
            if w not in prev and w != start:
                prev[w] = v
                todo.append(w)
    return []


def _describe(graph: dict[str, dict[str, int]], path: list[str]) -> str:
    """``a (a.py:12) -> b (b.py:30) -> c``: each module with the line that imports the next."""
    modules = _modules()
    parts = []
    for here, there in zip(path, path[1:]):
        file = modules[here][0].relative_to(ROOT)
        parts.append(f"{here} ({file}:{graph[here][there]})")
    return " -> ".join(parts + [path[-1]])


def _describe_cycle(graph: dict[str, dict[str, int]], comp: list[str]) -> str:
    first = comp[0]
    loop = _path(graph, first, first, set(comp))
    return f"{len(comp)} modules {comp}; e.g. {_describe(graph, loop)}"


def test_the_graph_sees_every_kind_of_import():
    """The parser finds what the checks rely on: module-level, function-level, relative
    and absolute imports, ``from pkg import submodule``, and a package's re-exports."""
    g = _graph()
    assert "asyncflow.rpc.async_client" in g["asyncflow.transfer_queue.client"]  # from ..rpc.async_client import
    assert "asyncflow.transfer_queue.service_process" in g["asyncflow.single_controller.tq_units"]  # in a function
    assert "asyncflow.single_controller.launch" in g["asyncflow.single_controller"]  # in __getattr__
    assert "asyncflow.rpc.auth" in g["asyncflow.single_controller.rendezvous"]  # from ..rpc import auth
    assert "asyncflow.rpc" not in g["asyncflow.single_controller.rendezvous"]  # (auth is a submodule)
    assert "asyncflow.transfer_queue.client" in g["asyncflow.transfer_queue"]  # the package's re-exports
    assert _cycles({"a": {"b": 1}, "b": {"a": 2}, "c": {"a": 3}}) == [["a", "b"]]


def test_no_import_cycle():
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles (make the dependency go one way, e.g. move what both need to a third " \
        "module):\n" + "\n".join(_describe_cycle(graph, c) for c in cycles)


def test_rpc_is_below_transfer_queue_and_single_controller():
    graph = _graph()
    rpc = [m for m in graph if _in(m, RPC)]
    assert rpc, "no asyncflow.rpc modules found"
    bad = []
    for start in rpc:
        seen, todo = {start}, [start]
        while todo:
            for w in graph[todo.pop()]:
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        for m in sorted(seen):
            if _in(m, ABOVE_RPC):
                bad.append(_describe(graph, _path(graph, start, m)))
                break
    assert not bad, "asyncflow.rpc must not import transfer_queue or single_controller:\n" + "\n".join(bad)


def _package(module: str) -> str:
    """The package (or top-level module) of asyncflow that ``module`` lies in."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _upward(graph: dict[str, dict[str, int]], layers: tuple[tuple[str, ...], ...]) -> list[tuple[str, str, int]]:
    """The imports that go up or sideways across ``layers``: (module, imported module, line)."""
    layer = {p: i for i, names in enumerate(layers) for p in names}
    bad = []
    for m in sorted(graph):
        for dep, line in sorted(graph[m].items()):
            a, b = _package(m), _package(dep)
            if a != b and layer[b] >= layer[a]:
                bad.append((m, dep, line))
    return bad


def test_the_layer_check_sees_an_upward_and_a_sideways_import():
    graph = {"asyncflow.engines.x": {"asyncflow.workers.y": 3, "asyncflow.weight_sync.z": 4},
             "asyncflow.workers.y": {"asyncflow.engines.x": 5}, "asyncflow.training.t": {"asyncflow.workers.y": 6},
             "asyncflow.weight_sync.z": {}}
    layers = (("weight_sync",), ("engines",), ("training", "workers"))
    assert _upward(graph, layers) == [("asyncflow.engines.x", "asyncflow.workers.y", 3),
                                      ("asyncflow.training.t", "asyncflow.workers.y", 6)]


def test_every_package_has_its_layer_once():
    listed = [p for names in LAYERS for p in names]
    assert len(listed) == len(set(listed)), f"a package is in two layers: {sorted(listed)}"
    missing = sorted({_package(m) for m in _modules()} - set(listed))
    assert not missing, f"place these packages of asyncflow in LAYERS (tests/test_import_layers.py): {missing}"


def test_the_layers_keep_the_architecture():
    """The order the layers exist for, so that a failing import is not fixed by moving a layer."""
    at = {p: i for i, names in enumerate(LAYERS) for p in names}
    assert at["rpc"] < at["transfer_queue"] < at["single_controller"] < at["weight_sync"] < at["engines"]
    assert at["engines"] < at["agents"] < at["workflow"] < at["workers"] < at["simulation"]
    assert at["workflow"] < at["training"] < at["launcher"] < at["cli"]
    assert at["single_controller"] < at["config"] < at["resolved"] < at["workers"]


def test_single_controller_imports_nothing_of_the_app_config():
    """The single controller runs any driver function: the run's config reaches it as values
    (its own LaunchConfig, TransferQueueLayout), never by importing asyncflow.config."""
    graph = _graph()
    bad = [f"{m} ({_modules()[m][0].relative_to(ROOT)}:{graph[m][dep]}) imports {dep}"
           for m in sorted(graph) if _in(m, "asyncflow.single_controller")
           for dep in graph[m] if _in(dep, ("asyncflow.config", "asyncflow.resolved"))]
    assert not bad, "\n".join(bad)


def test_no_import_goes_up_or_sideways_across_the_layers():
    graph = _graph()
    at = {p: i for i, names in enumerate(LAYERS) for p in names}
    modules = _modules()
    bad = [f"{m} ({modules[m][0].relative_to(ROOT)}:{line}) imports {dep}: {_package(m)} (layer {at[_package(m)]}) "
           f"may not import {_package(dep)} (layer {at[_package(dep)]})" for m, dep, line in _upward(graph, LAYERS)]
    assert not bad, "imports against the layers (move what both need down, or the code to where it belongs):\n" + \
        "\n".join(bad)
