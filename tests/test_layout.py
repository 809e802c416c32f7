"""The code's shape: no import cycle anywhere, dependencies pointing one way, a torch-free API,
one `ferry` namespace that leaves Hugging Face's `kernels` alone.

Imports are read with `ast` from every module of the `ferry` namespace (module level and
inside functions alike: a lazy import is still a dependency). An edge goes to the most specific
project module an import names; a package's own `__init__` re-exporting its submodules is not a
cycle, so the implicit import of parent packages is not counted.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _sources() -> dict[str, str]:
    """setup.py's SOURCES: package name -> its folder (the one place that says it)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "SOURCES")
    return ast.literal_eval(node.value)


SOURCES = _sources()

# Package -> the project packages it may import (its own always). The direction of the layers:
# common <- protocol (the wire) <- api, serve, webhooks, autoscaler; serve -> engine, snapshots;
# snapshots -> engine; engine -> models, kernels (and the sampling limits and structured-output check of the wire);
# kernels -> nothing of ours; tools (`ferry up`, `ferry generate`) sit on top.
ALLOWED = {
    "ferry.kernels": set(),
    "ferry.worker.common": set(),
    "ferry.worker.protocol": {"ferry.worker.common"},
    "ferry.worker.models": {"ferry.kernels", "ferry.worker.common.objectstore"},  # S3 model sources share its client
    "ferry.worker.engine": {"ferry.worker.models", "ferry.kernels", "ferry.worker.protocol.sampling",
                            "ferry.worker.protocol.structured"},
    "ferry.worker.snapshots": {"ferry.worker.engine", "ferry.worker.models", "ferry.worker.common.objectstore"},
    "ferry.worker.serve": {"ferry.worker.engine", "ferry.worker.snapshots", "ferry.worker.protocol",
                           "ferry.worker.models", "ferry.worker.common"},
    "ferry.worker.webhooks": {"ferry.worker.protocol", "ferry.worker.common"},
    "ferry.worker.tools": {"ferry.worker.engine", "ferry.worker.models", "ferry.worker.serve",
                           "ferry.worker.webhooks", "ferry.worker.protocol", "ferry.worker.common"},
    "ferry.worker.cli": set(),  # imports each command's module by name, at run time
    "ferry.api": {"ferry.worker.protocol", "ferry.worker.common"},
    "ferry.autoscaler": {"ferry.worker.protocol", "ferry.worker.common"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))
            found[name] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The most specific project module `name` (a dotted import path) names, if any."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _runtime_nodes(tree: ast.AST):
    """Every node but the bodies of `if TYPE_CHECKING:` (imports for annotations, never executed)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` names the submodule when there is one.
            targets.update(
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
            )
    return {t for t in (_resolve(name) for name in targets) if t is not None and t != module}


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = iter(range(1 << 30))

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))  # deep import chains; restored: other tests depend on the default
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def _layer(module: str) -> str | None:
    return next((p for p in sorted(ALLOWED, key=len, reverse=True) if module == p or module.startswith(p + ".")), None)


def test_the_graph_sees_every_package():
    assert {"ferry.worker.engine.engine", "ferry.worker.serve.main", "ferry.api.main", "ferry.kernels.ops",
            "ferry.worker.protocol.jobs", "ferry.autoscaler.cli", "ferry.worker.common.connect"} <= set(GRAPH)
    assert "ferry.worker.engine.kv_cache" in GRAPH["ferry.worker.engine.scheduler"]


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_dependencies_point_one_way(layer):
    wrong = []
    for module, targets in GRAPH.items():
        if _layer(module) != layer:
            continue
        for target in targets:
            allowed = {layer} | ALLOWED[layer]
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


@pytest.mark.parametrize("module", ["ferry.api.main", "ferry.worker.protocol"])
def test_the_api_and_the_wire_never_import_torch(module):
    code = f"import sys, {module}; sys.exit(3 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr or f"importing {module} imported torch"


def _third_party(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("ferry", "__future__")}


def test_kernels_import_only_torch_and_triton():
    used = {name for module, path in MODULES.items() if _layer(module) == "ferry.kernels"
            for name in _third_party(path)}
    assert used <= {"torch", "triton"}, used


MAX_MODULE_LINES = 450  # a module past this has more than one job (issue 40)
SHORT_ORCHESTRATORS = {"ferry.worker.engine.engine": 250, "ferry.worker.serve.main": 250,
                       "ferry.worker.serve.engine_loop": 250}  # they wire parts, they do not do the work


def test_no_module_of_the_worker_or_the_api_is_long():
    lengths = {module: len(path.read_text().splitlines()) for module, path in MODULES.items()
               if _layer(module) != "ferry.kernels"}
    long = {module: n for module, n in lengths.items() if n > SHORT_ORCHESTRATORS.get(module, MAX_MODULE_LINES)}
    assert not long, long
