"""The package's layers, read from its source: no import loop (type-only imports included),
and no layer importing one above it (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "policyd"

# layer -> the layers (module prefixes) it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # the core: vocabulary, state, engine, structures
    "policyd.types": ("policyd.",),
    "policyd.state": ("policyd.engine", "policyd.policies", "policyd.sim", "policyd.daemon"),
    "policyd.queues": ("policyd.",),
    "policyd.names": ("policyd.",),
    "policyd.engine": ("policyd.sim", "policyd.daemon", "policyd.history"),
    "policyd.policies": ("policyd.sim", "policyd.daemon", "policyd.history", "policyd.engine"),
    "policyd.tiers": ("policyd.sim", "policyd.daemon", "policyd.history", "policyd.policies"),
    "policyd.history": ("policyd.daemon", "policyd.sim", "policyd.policies"),
    "policyd.sim": ("policyd.daemon", "policyd.history"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its source (a function's or
    ``TYPE_CHECKING`` block's imports included)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                names += [f"{node.module}.{a.name}" for a in node.names]
                names = [n for n in names if n == node.module or n in modules]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                target = resolve(name) if name.startswith("policyd") else None
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start, children_of_start in graph.items():
        if start in index:
            continue
        work = [(start, iter(sorted(children_of_start)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_loops() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_loop() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``module -> target`` for every import ``FORBIDDEN`` bans (a layer's own modules aside)."""
    upward = []
    for module, targets in graph.items():
        for layer, banned in FORBIDDEN.items():
            if module != layer and not module.startswith(layer + "."):
                continue
            upward += [
                f"{module} -> {target}"
                for target in sorted(targets)
                if any(target.startswith(b) for b in banned) and not target.startswith(layer)
            ]
    return upward


def test_no_layer_imports_one_above_it() -> None:
    assert upward_imports(import_graph()) == []


def test_an_upward_import_is_named() -> None:
    graph = {"policyd.policies.virtual": {"policyd.sim.cache", "policyd.queues"}}
    assert upward_imports(graph) == ["policyd.policies.virtual -> policyd.sim.cache"]
