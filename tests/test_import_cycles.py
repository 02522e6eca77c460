"""No module of distlocks/ or bench/ takes part in an import cycle at run time.

A cycle makes the import order matter: whichever module of the ring is imported first
sees the others half-initialised, and a name that is not defined yet is an ImportError
that depends on which test or which entry point ran first. The graph here is what
Python executes on import: statements at module level (also inside ``try``/``except``,
``if`` and class bodies), never inside functions and never under ``if TYPE_CHECKING:``,
which only the type checker runs.

bench/ is held to more: its registry imports every workload module, so no workload
may import the registry back even inside a function, where the cycle would only wait
for the first call. There the graph also has the imports inside functions and the
modules named in strings (``import_module("bench.saves")``, the opt-in table).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("distlocks", "bench")

#: Cycles known and owned elsewhere, each the exact set of modules of one strongly
#: connected component. None now: the etcd backend's pair is untied (issue 28, item 4).
ALLOWED: frozenset[frozenset[str]] = frozenset()

#: The same for bench/'s deferred graph. A Celery app names its task modules in
#: ``include`` (the worker imports them once the app is built) and the tasks are
#: declared on that app: Celery's own layout, kept as ``celery -A bench.celery_app``.
BENCH_DEFERRED_ALLOWED: frozenset[frozenset[str]] = frozenset(
    {frozenset({"bench.celery_app", "bench.celery_tasks"})}
)


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` when it is itself imported; ``line`` says where."""

    source: str
    target: str
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _run_on_import(
    body: Iterable[ast.stmt], deferred: bool = False
) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements Python executes when the module of ``body`` is imported
    (``deferred``: also those it would execute later, in its functions)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            # Only the type checker enters ``if TYPE_CHECKING:``; its ``else`` runs.
            if not _is_type_checking(node.test):
                yield from _run_on_import(node.body, deferred)
            yield from _run_on_import(node.orelse, deferred)
        elif isinstance(node, ast.Try | ast.TryStar):
            yield from _run_on_import(node.body, deferred)
            for handler in node.handlers:
                yield from _run_on_import(handler.body, deferred)
            yield from _run_on_import(node.orelse, deferred)
            yield from _run_on_import(node.finalbody, deferred)
        elif isinstance(node, ast.For | ast.AsyncFor | ast.While):
            yield from _run_on_import(node.body, deferred)
            yield from _run_on_import(node.orelse, deferred)
        elif isinstance(node, ast.With | ast.AsyncWith):
            yield from _run_on_import(node.body, deferred)
        elif isinstance(node, ast.ClassDef):
            # A class body runs on import; the bodies of its methods do not.
            yield from _run_on_import(node.body, deferred)
        elif deferred and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _run_on_import(node.body, deferred)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_edges(
    name: str, source: str, is_package: bool, known: set[str], deferred: bool = False
) -> list[Edge]:
    """The edges from module ``name`` (of text ``source``) to the modules in ``known``
    (``deferred``: also the imports in its functions and the modules its strings name).

    ``import a.b.c`` and ``from a.b import c`` run the packages ``a`` and ``a.b`` too,
    except those the importer sits in: they were imported before it, so going back to
    them is only a cycle when it asks them for a name (``from a import f``).
    """
    package = name if is_package else name.rpartition(".")[0]
    own = {*_ancestors(name), name}
    edges: list[Edge] = []

    def add(target: str, line: int, explicit: bool) -> None:
        for parent in _ancestors(target):
            if parent in known and parent not in own:
                edges.append(Edge(name, parent, line))
        if target in known and (explicit or target not in own) and target != name:
            edges.append(Edge(name, target, line))

    tree = ast.parse(source)
    if deferred:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in known and node.value != name:
                edges.append(Edge(name, node.value, node.lineno))
    for node in _run_on_import(tree.body, deferred):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, explicit=False)
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        submodules = [f"{origin}.{alias.name}" for alias in node.names]
        names = [sub for sub in submodules if sub not in known]
        # ``from a import b`` where b is a module imports a.b; any other name is read
        # from ``a`` itself, which must have finished defining it.
        add(origin, node.lineno, explicit=bool(names))
        for sub in submodules:
            if sub in known:
                edges.append(Edge(name, sub, node.lineno))
    return edges


def import_graph(
    root: Path, packages: Iterable[str], deferred: bool = False
) -> dict[str, list[Edge]]:
    files = {
        module_name(path, root): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }
    known = set(files)
    return {
        name: import_edges(name, path.read_text(), path.name == "__init__.py", known, deferred)
        for name, path in files.items()
    }


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(graph.get(start, ())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(graph.get(succ, ()))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The components that hold a cycle: two or more modules, or one importing itself."""
    return [
        component
        for component in strongly_connected(graph)
        if len(component) > 1 or component[0] in graph.get(component[0], ())
    ]


def _one_ring(component: list[str], edges: Mapping[str, list[Edge]]) -> list[Edge]:
    """A shortest way from the component's first module back to itself, edge by edge."""
    members = set(component)
    start = component[0]
    came_from: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for edge in edges[node]:
                if edge.target not in members or edge.target in came_from:
                    continue
                came_from[edge.target] = edge
                if edge.target == start:
                    ring = [edge]
                    while ring[0].source != start:
                        ring.insert(0, came_from[ring[0].source])
                    return ring
                following.append(edge.target)
        frontier = following
    raise AssertionError(f"{component} is not a cycle")


def describe(component: list[str], edges: Mapping[str, list[Edge]]) -> str:
    ring = _one_ring(component, edges)
    lines = [f"{len(component)} modules: {', '.join(component)}", "  for example:"]
    lines += [f"    {e.source} (line {e.line}) imports {e.target}" for e in ring]
    return "\n".join(lines)


def test_no_import_cycles() -> None:
    edges = import_graph(ROOT, PACKAGES)
    graph = {name: [edge.target for edge in out] for name, out in edges.items()}
    found = [c for c in cycles(graph) if frozenset(c) not in ALLOWED]
    assert not found, (
        "Import cycles at module level (untie each one: move what both sides need to a "
        "module that imports neither, or import inside the function that needs it):\n"
        + "\n".join(describe(component, edges) for component in found)
    )


def test_no_bench_module_imports_the_registry_back() -> None:
    """Not even from a function: bench/ has no cycle once deferred imports count too."""
    edges = import_graph(ROOT, ["bench"], deferred=True)
    graph = {name: [edge.target for edge in out] for name, out in edges.items()}
    found = [c for c in cycles(graph) if frozenset(c) not in BENCH_DEFERRED_ALLOWED]
    assert not found, (
        "Import cycles in bench/ through imports in functions or module names in strings "
        "(a workload must not reach bench.registry; share through bench.base instead):\n"
        + "\n".join(describe(component, edges) for component in found)
    )


def test_the_graph_sees_the_imports_that_run() -> None:
    """What counts as an import on import: the walker's rules, one case each."""
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e", "pkg.f", "pkg.sub", "pkg.sub.g"}
    source = """
from __future__ import annotations
from typing import TYPE_CHECKING
import pkg.a
from . import b
try:
    from .c import thing
except ImportError:
    from pkg.sub import g
if TYPE_CHECKING:
    import pkg.d
else:
    import pkg.e
def later():
    import pkg.f
class Holder:
    from pkg import name
    def method(self):
        import pkg.f
"""
    edges = import_edges("pkg.mod", source, is_package=False, known=known)
    targets = sorted({e.target for e in edges})
    assert targets == ["pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.e", "pkg.sub", "pkg.sub.g"]
    # The importer's own package is imported before it: no edge unless asked for a name.
    relative = import_edges("pkg.sub.mod", "from . import g\n", is_package=False, known=known)
    assert [e.target for e in relative] == ["pkg.sub.g"]
    # Counting deferred imports adds the functions' imports and the modules named in
    # strings, still not what only the type checker imports.
    later = import_edges("pkg.mod", source + 'X = "pkg.sub.g"\n', False, known, deferred=True)
    assert sorted({e.target for e in later}) == sorted([*targets, "pkg.f"])
    assert {e.target for e in later if e.line == source.count("\n") + 1} == {"pkg.sub.g"}


def test_the_allowed_cycles_still_exist() -> None:
    """An allowed cycle that was untied leaves the list, so that it cannot come back.

    An entry naming a module that no longer exists can excuse nothing, and is left to
    whoever moved the module (the etcd backend is being split into a package).
    """
    for packages, deferred, allowed in (
        (PACKAGES, False, ALLOWED),
        (["bench"], True, BENCH_DEFERRED_ALLOWED),
    ):
        edges = import_graph(ROOT, packages, deferred)
        graph = {name: [edge.target for edge in out] for name, out in edges.items()}
        found = {frozenset(component) for component in cycles(graph)}
        stale = {entry for entry in allowed if entry <= graph.keys() and entry not in found}
        assert not stale, f"no longer a cycle, remove it from the allowed list: {stale}"


def _reaches(graph: Mapping[str, Iterable[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


@given(
    st.dictionaries(
        st.integers(0, 12).map(str),
        st.lists(st.integers(0, 12).map(str), max_size=4),
        max_size=13,
    )
)
def test_components_are_the_mutually_reachable_sets(graph: dict[str, list[str]]) -> None:
    """Two modules share a component exactly when each reaches the other."""
    graph = {node: [t for t in targets if t in graph] for node, targets in graph.items()}
    components = strongly_connected(graph)
    assert sorted(m for c in components for m in c) == sorted(graph)
    where = {member: i for i, component in enumerate(components) for member in component}
    reach = {node: _reaches(graph, node) for node in graph}
    for a in graph:
        for b in graph:
            mutual = a == b or (b in reach[a] and a in reach[b])
            assert (where[a] == where[b]) == mutual, (a, b)
    for component in cycles(graph):
        assert component[0] in reach[component[0]]
