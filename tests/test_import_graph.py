"""The project's plan, kept by its import graph (computed with `ast`, every import: at module
level, under `if TYPE_CHECKING`, and inside functions).

The arrows run console -> {web face, worker} -> domain -> compiler_core (docs/service.md draws
it): no module imports itself back through any chain, the worker never imports the web face,
the domain imports neither the web face nor the worker, and the compiler imports nothing of
the service.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("app", "worker", "migrations", "compiler_core")

WEB_FACE = ("app.main", "app.api", "app.web", "app.security_headers")
"""The modules that answer HTTP (and nothing else of the service may need)."""
DOMAIN = ("app.domain",)
CONSOLE = ("app.console",)
SERVICE = ("app", "worker", "migrations")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {}
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            if "versions" in path.relative_to(ROOT).parts:  # migration scripts import nothing
                continue  # of the project's, and Alembic loads them by path
            found[module_name(path)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module an imported name means: itself, or the longest known prefix (an
    attribute imported from a module: `from app.domain.db.models import Job`)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every project module `module` imports, anywhere in its file. `from pkg import name`
    counts `pkg.name` when that is a module, else `pkg`."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets: Iterable[str] = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop] if drop else base
                prefix = ".".join(base)
                mod = f"{prefix}.{node.module}" if node.module else prefix
            else:
                mod = node.module or ""
            submodules = [f"{mod}.{alias.name}" for alias in node.names]
            targets = [t for t in submodules if t in known] or [mod]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, known)
            if resolved is not None and resolved != module:
                out.add(resolved)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]], within: tuple[str, ...]) -> list[list[str]]:
    """The strongly connected components of more than one module among the modules under
    `within` (Tarjan), each as one cycle through it, for the message."""
    nodes = sorted(n for n in graph if _under(n, within))
    edges = {n: sorted(m for m in graph[n] if _under(m, within)) for n in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
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
                    if len(component) > 1:
                        found.append(_one_cycle(sorted(component), edges))

    for node in nodes:
        if node not in index:
            visit(node)
    return found


def _one_cycle(component: list[str], edges: dict[str, list[str]]) -> list[str]:
    """A path from the component's first module back to itself (breadth-first, shortest)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in edges[node]:
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return component


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def arrows(
    graph: dict[str, set[str]], source: tuple[str, ...], target: tuple[str, ...]
) -> list[str]:
    return sorted(
        f"{a} -> {b}"
        for a, deps in graph.items()
        if _under(a, source)
        for b in deps
        if _under(b, target)
    )


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def _render(found: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle) for cycle in found)


def test_the_service_has_no_import_cycle(graph: dict[str, set[str]]) -> None:
    found = cycles(graph, SERVICE)
    assert not found, f"import cycles in the service:\n{_render(found)}"


def test_the_compiler_has_no_import_cycle(graph: dict[str, set[str]]) -> None:
    found = cycles(graph, ("compiler_core",))
    assert not found, f"import cycles in compiler_core:\n{_render(found)}"


def test_the_worker_never_imports_the_web_face_or_the_console(graph: dict[str, set[str]]) -> None:
    assert not arrows(graph, ("worker",), WEB_FACE + CONSOLE)


def test_the_domain_imports_neither_the_web_face_nor_the_worker(
    graph: dict[str, set[str]],
) -> None:
    assert not arrows(graph, DOMAIN, WEB_FACE + CONSOLE + ("worker",))


def test_the_web_face_never_imports_the_worker_or_the_console(graph: dict[str, set[str]]) -> None:
    """Only the composition roots (`app.console`) know both: the web face gets its queue."""
    assert not arrows(graph, WEB_FACE, ("worker",) + CONSOLE)


def test_the_compiler_imports_nothing_of_the_service(graph: dict[str, set[str]]) -> None:
    assert not arrows(graph, ("compiler_core",), SERVICE)


def test_every_service_module_is_in_a_layer(graph: dict[str, set[str]]) -> None:
    """A new module under app/ lands in a layer the rules above see."""
    stray = [
        name
        for name in graph
        if _under(name, ("app",))
        and name != "app"
        and not _under(name, WEB_FACE + DOMAIN + CONSOLE)
    ]
    assert not stray, stray


# ----------------------------------------------------------------- the graph itself


def test_the_graph_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "c.py").write_text("from pkg.a import f\n")
    known = {"pkg": pkg / "__init__.py", **{f"pkg.{n}": pkg / f"{n}.py" for n in "abc"}}
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph, ("pkg",)) == [["pkg.a", "pkg.b", "pkg.a"]]
