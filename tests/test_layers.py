"""The project's layers, read from its source: no import loop (type-only imports included),
and no layer importing one above it (docs/ARCHITECTURE.md). The benchmarks and evaluations
(``experiments``) sit on top: they import the serving packages, none of which imports them, but
for ``policyd/cli/__init__.py``, which names their modules as strings that ``importlib`` imports
when a command runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("policyd", "experiments", "connector", "ui")
EXPERIMENTS = ("experiments",)

# tools of their own inside a serving package, which may import the experiments
TOOLS = frozenset({"connector.replay", "connector.bench_step"})

# the one module that names the experiments (as strings, for importlib)
DISPATCH = ROOT / "policyd" / "cli" / "__init__.py"

# policyd's layers, lowest first (docs/ARCHITECTURE.md): a package may import its own layer's
# modules and any lower layer's, never a higher one's nor a sibling's on the same level
LAYERS: tuple[tuple[str, ...], ...] = (
    ("policyd.core",),  # vocabulary, wire, engine, state, the policy contract, profiles
    ("policyd.workloads",),  # what a workload is, and the generators
    ("policyd.models", "policyd.traces"),  # online models; real-trace readers
    ("policyd.tiers",),  # applying a snapshot to tiers (the connector ships it)
    ("policyd.policies",),  # the policies (the guard's shadows apply snapshots as tiers do)
    ("policyd.sim", "policyd.history", "policyd.fleet"),  # simulator; history; fleet parts
    ("policyd.daemon",),  # the serving daemon (and the demo that drives it by a simulator)
    ("policyd.cli",),  # the command line
)


def forbidden() -> dict[str, tuple[str, ...]]:
    """Layer -> the module prefixes it must not import: the experiments for every serving
    package, and for each of policyd's layers every package on its level or above but itself."""
    banned: dict[str, tuple[str, ...]] = {p: EXPERIMENTS for p in ("policyd", "connector", "ui")}
    # the dashboard speaks to the daemon over HTTP only; the connector ships core/ and tiers/
    banned["ui"] = (*EXPERIMENTS, "policyd")
    shipped = ("policyd.core", "policyd.tiers")
    banned["connector"] = (
        *EXPERIMENTS,
        *(p for level in LAYERS for p in level if p not in shipped),
    )
    for level, packages in enumerate(LAYERS):
        above = tuple(p for higher in LAYERS[level:] for p in higher)
        for package in packages:
            banned[package] = tuple(p for p in above if p != package)
    return banned


FORBIDDEN = forbidden()


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its source (a function's or
    ``TYPE_CHECKING`` block's imports included)."""
    modules = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}

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
                target = resolve(name) if name.split(".")[0] in PACKAGES else None
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
            if module in TOOLS:
                continue
            upward += [
                f"{module} -> {target}"
                for target in sorted(targets)
                if any(target == b or target.startswith(b + ".") for b in banned)
                and not target.startswith(layer)
            ]
    return upward


def test_no_layer_imports_one_above_it() -> None:
    assert upward_imports(import_graph()) == []


def test_an_upward_import_is_named() -> None:
    graph = {"policyd.policies.virtual": {"policyd.sim.cache", "policyd.core.queues"}}
    assert upward_imports(graph) == ["policyd.policies.virtual -> policyd.sim.cache"]
    graph = {
        "connector.runtime": {"policyd.sim.cache", "policyd.tiers.gpu", "policyd.core.types"},
        "ui.app": {"policyd.core.types", "ui.client"},
    }
    assert upward_imports(graph) == [
        "connector.runtime -> policyd.sim.cache",
        "ui.app -> policyd.core.types",
    ]


def test_the_serving_packages_never_import_the_experiments() -> None:
    graph = {
        "policyd.cli": {"policyd.core.names"},
        "policyd.sim.replay": {"experiments.bench"},
        "connector.replay": {"experiments.bench", "policyd.sim.replay"},
        "ui.app": {"experiments.matrix"},
        "experiments.matrix": {"experiments.bench", "policyd.sim.replay"},
    }
    assert upward_imports(graph) == [
        "policyd.sim.replay -> experiments.bench",
        "ui.app -> experiments.matrix",
    ]


# ``experiments.<module>`` or ``experiments/<module>``, anywhere in a file's text
EXPERIMENT_REFERENCE = re.compile(r"\bexperiments[./][A-Za-z_]")


def test_only_the_command_line_names_the_experiments_and_only_as_importlib_strings() -> None:
    experiments = {module_name(p) for p in (ROOT / "experiments").rglob("*.py")}
    named: list[str] = []
    for package in ("policyd", "connector", "ui"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if module_name(path) in TOOLS:
                continue
            text = path.read_text()
            if path != DISPATCH:
                assert not EXPERIMENT_REFERENCE.search(text), path.relative_to(ROOT)
                continue
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    named += [node.value] if node.value.startswith("experiments.") else []
    assert named, "policyd/cli/__init__.py dispatches no command to the experiments"
    assert sorted(set(named) - experiments) == []  # each string a module that exists
    # ...and nowhere but in strings: no docstring nor comment points there either
    text = DISPATCH.read_text()
    assert len(EXPERIMENT_REFERENCE.findall(text)) == len(named)


def test_every_module_of_policyd_lives_in_a_layer() -> None:
    """The folder listing is the layering: no module at policyd's root, no package unplaced."""
    root = ROOT / "policyd"
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py"]
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    placed = {name.split(".")[1] for level in LAYERS for name in level}
    assert packages == placed
