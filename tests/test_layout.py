"""The layout's rules, read from the source (docs/architecture.md, "Where things live"): no
import cycle among spokefs's modules, and the sans-I/O parts (planner, policies, fetch queue,
link model, tier ranking and membership) import nothing that does I/O, themselves or through
any spokefs module they import. Imports inside functions and under ``TYPE_CHECKING`` do not
count for these: they run later, or never. The spoke's modules (``spokefs.spoke``) go further:
no cycle through them even with the imports inside functions counted (a lazy import that
closes a circle still ties the modules into one)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
SANS_IO = ("spokefs.planner", "spokefs.policy", "spokefs.spoke.fetchqueue",
           "spokefs.linkmodel", "spokefs.tier.rendezvous", "spokefs.tier.membership",
           "spokefs.wire.h1", "spokefs.wire.frames")
IO_MODULES = {"asyncio", "os", "socket", "sqlite3", "subprocess", "threading", "selectors",
              "aiohttp", "urllib3", "http", "shutil", "mmap"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "spokefs").rglob("*.py"):
        parts = p.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _top_level_imports(name: str, path: Path, lazy: bool = False) -> set[str]:
    """Every module ``path`` imports when it is imported (absolute names); ``lazy``: the
    imports inside functions too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    todo: list[ast.AST] = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def _graph(lazy: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    return {name: _top_level_imports(name, path, lazy) for name, path in mods.items()}


def test_no_import_cycle_among_spokefs_modules() -> None:
    _no_cycle(_graph())


def test_no_import_cycle_through_the_spoke_counting_imports_in_functions() -> None:
    graph = _graph(lazy=True)
    local = {n: {d for d in deps if d in graph and d != n} for n, deps in graph.items()}
    spoke = sorted(n for n in graph if n.startswith("spokefs.spoke."))
    assert "spokefs.spoke.service" in spoke
    for start in spoke:  # a way from each back to itself is a cycle through it
        came_from: dict[str, str] = {}
        todo = [start]
        while todo:
            n = todo.pop()
            for d in sorted(local[n]):
                if d == start:
                    cycle = [n]
                    while cycle[-1] != start:
                        cycle.append(came_from[cycle[-1]])
                    raise AssertionError("import cycle: " + " -> ".join(
                        [start, *reversed(cycle[:-1]), start]))
                if d not in came_from:
                    came_from[d] = n
                    todo.append(d)


def _no_cycle(graph: dict[str, set[str]]) -> None:
    """Fails naming a cycle."""
    local = {n: {d for d in deps if d in graph and d != n} for n, deps in graph.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        path.append(n)
        for d in sorted(local[n]):
            if state.get(d) == 1:
                cycle = [*path[path.index(d):], d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        path.pop()
        state[n] = 2

    for n in sorted(local):
        if n not in state:
            visit(n)


def test_sans_io_parts_import_no_io() -> None:
    graph = _graph()
    parts = [n for n in graph if any(n == p or n.startswith(p + ".") for p in SANS_IO)]
    assert len(parts) >= len(SANS_IO)  # the rule still names modules that exist
    for part in parts:
        seen, todo = {part}, [part]
        while todo:
            n = todo.pop()
            for d in graph[n]:
                top = d.partition(".")[0]
                assert top not in IO_MODULES, f"{part} imports {d} (through {n})"
                if d in graph and d not in seen:
                    seen.add(d)
                    todo.append(d)
