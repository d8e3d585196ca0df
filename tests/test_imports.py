"""The package's modules import each other without a cycle: each layer sits on the ones below it.

The graph is read from the source (``ast``), imports inside functions included (they run too, only later);
imports under ``if TYPE_CHECKING:`` are left out (they never run). A package's ``__init__`` counts only where it
is imported by name (``from deepinfer import LLM``), not as the parent every submodule import also runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import deepinfer

ROOT = Path(deepinfer.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every import that runs, in any scope."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """deepinfer module -> the deepinfer modules it imports."""
    modules = {_module_name(path): path for path in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for module, names in _imports(ast.parse(path.read_text(), str(path))):
            if module.split(".")[0] != "deepinfer":
                continue
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            if submodules:  # ``from package import module``
                edges.update(submodules)
            if module in modules and (not names or len(submodules) < len(names)):  # names defined in ``module``
                edges.add(module)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "deepinfer.llm" in graph["deepinfer"]  # ``deepinfer.__getattr__`` imports it on first use
    assert "deepinfer.engine.scheduler" in graph["deepinfer.engine.setup"]


def test_deepinfer_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_folders_have_no_import_cycle():
    """The folders follow a step's flow (engine -> runner -> runtime, loading beside): no folder imports one that
    imports it back, even where no module of one imports itself back. A module at the package's top is its own node."""
    graph = import_graph()
    packages = {name for name in graph if (ROOT.parent / name.replace(".", "/")).is_dir()}

    def folder(module: str) -> str:
        parent = module.rpartition(".")[0]
        return module if module in packages or parent in ("", "deepinfer") else parent

    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        folders.setdefault(folder(module), set()).update(folder(t) for t in targets if folder(t) != folder(module))
    assert {"deepinfer.engine", "deepinfer.runner", "deepinfer.runtime", "deepinfer.loading"} <= set(folders)
    cycle = find_cycle(folders)
    assert cycle is None, "import cycle between folders: " + " -> ".join(cycle)
