"""The code's shape (issue 17), read from the source alone (no module of aegis is imported):
no file under src/aegis over 400 lines, no ``def`` over 60 lines from its ``def`` line to its
last line (methods and nested ones included), no import cycle among aegis's modules (imports
inside functions and under ``TYPE_CHECKING`` count; ``from P import N`` imports P, the package's
``__init__.py`` when P is a package, and P.N too when that is a module). The generated gRPC code
is left out. Each checker is tried on a tiny tree first, so that none passes by seeing nothing.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
LEFT_OUT = ("aegis/adapters/grpc/_generated/",)
MAX_FILE_LINES = 400
MAX_DEF_LINES = 60


@dataclass(frozen=True)
class Module:
    name: str  # aegis.core.machine; a package by its own name (aegis.core)
    path: Path
    shown: str  # the path as a failure names it (src/aegis/core/machine.py)

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def modules(src: Path, package: str = "aegis") -> dict[str, Module]:
    """Every module of ``package`` under ``src`` (the generated code left out), by name."""
    found: dict[str, Module] = {}
    for path in sorted((src / package).rglob("*.py")):
        relative = path.relative_to(src).as_posix()
        if any(relative.startswith(prefix) for prefix in LEFT_OUT):
            continue
        parts = relative.removesuffix(".py").split("/")
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        found[name] = Module(name, path, f"{src.name}/{relative}")
    return found


def long_files(found: dict[str, Module], limit: int = MAX_FILE_LINES) -> list[str]:
    failures = []
    for module in found.values():
        count = len(module.path.read_text().splitlines())
        if count > limit:
            failures.append(f"{module.shown}: {count} lines (at most {limit})")
    return failures


def _defs(
    node: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every def under ``node`` with its qualified name (methods and nested defs included)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{prefix}{child.name}", child
            yield from _defs(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _defs(child, f"{prefix}{child.name}.")
        else:
            yield from _defs(child, prefix)


def long_defs(found: dict[str, Module], limit: int = MAX_DEF_LINES) -> list[str]:
    failures = []
    for module in found.values():
        tree = ast.parse(module.path.read_text(), str(module.path))
        for name, node in _defs(tree):
            assert node.end_lineno is not None
            count = node.end_lineno - node.lineno + 1
            if count > limit:
                where = f"{module.shown}:{node.lineno} {name}"
                failures.append(f"{where}: {count} lines (at most {limit})")
    return failures


@dataclass(frozen=True)
class Edge:
    to: str
    line: int


def _imported(
    module: Module, node: ast.Import | ast.ImportFrom, found: dict[str, Module]
) -> list[str]:
    """The aegis modules an import statement imports."""
    if isinstance(node, ast.Import):
        return [name for alias in node.names if (name := _nearest(alias.name, found))]
    base = node.module or ""
    if node.level:
        package = module.name if module.is_package else module.name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    if base not in found:
        return []
    return [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in found]


def _nearest(name: str, found: dict[str, Module]) -> str:
    """``import a.b.c`` imports a.b.c (the nearest module above it if that is no module)."""
    while name and name not in found:
        name = name.rpartition(".")[0]
    return name


def import_graph(found: dict[str, Module]) -> dict[str, dict[str, int]]:
    """module -> {imported module: the line of the first import of it}, self-imports left out."""
    graph: dict[str, dict[str, int]] = {}
    for module in found.values():
        edges = graph.setdefault(module.name, {})
        for node in ast.walk(ast.parse(module.path.read_text(), str(module.path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _imported(module, node, found):
                    if target != module.name:
                        edges.setdefault(target, node.lineno)
    return graph


def _components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components (each sorted), those of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, {})):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _shortest_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """The shortest cycle through the component's first module, inside the component."""
    start, inside = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt in inside and nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def import_cycles(found: dict[str, Module]) -> list[str]:
    """One cycle per set of modules that import each other: each module with the file and line
    of its import of the next."""
    graph = import_graph(found)
    failures = []
    for component in _components(graph):
        cycle = _shortest_cycle(graph, component)
        steps = [f"{a} ({found[a].shown}:{graph[a][b]})" for a, b in itertools.pairwise(cycle)]
        also = f" (all of {', '.join(component)})" if len(component) > len(cycle) - 1 else ""
        failures.append(" -> ".join([*steps, cycle[-1]]) + also)
    return failures


# -- the checkers, on a tiny tree ----------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> dict[str, Module]:
    for name, text in files.items():
        path = root / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules(root / "src")


def _lines(count: int, indent: str = "    ") -> str:
    return "".join(f"{indent}x{i} = {i}\n" for i in range(count))


def test_the_file_check_names_a_file_over_400_lines_and_passes_one_of_400(tmp_path: Path) -> None:
    found = _tree(tmp_path, {
        "aegis/__init__.py": "",
        "aegis/fits.py": _lines(400, ""),
        "aegis/core/long.py": _lines(401, ""),
        "aegis/adapters/grpc/_generated/big_pb2.py": _lines(900, ""),
    })  # fmt: skip
    assert long_files(found) == ["src/aegis/core/long.py: 401 lines (at most 400)"]


def test_the_def_check_names_each_def_over_60_lines_nested_ones_and_methods_too(
    tmp_path: Path,
) -> None:
    source = (
        "def fits():\n" + _lines(59)  # 60 lines with its def line
        + "@decorated\nasync def long():\n" + _lines(60)  # 61
        + "class Shell:\n    def method(self):\n" + _lines(60, "        ")  # 61
        + "def outer():\n    def inner():\n" + _lines(60, "        ")  # inner 61, outer 62
    )  # fmt: skip
    found = _tree(tmp_path, {"aegis/__init__.py": "", "aegis/shell.py": source})
    assert long_defs(found) == [
        "src/aegis/shell.py:62 long: 61 lines (at most 60)",
        "src/aegis/shell.py:124 Shell.method: 61 lines (at most 60)",
        "src/aegis/shell.py:185 outer: 62 lines (at most 60)",
        "src/aegis/shell.py:186 outer.inner: 61 lines (at most 60)",
    ]


def test_the_cycle_check_counts_every_form_of_import_and_names_the_cycle_in_order(
    tmp_path: Path,
) -> None:
    found = _tree(tmp_path, {
        "aegis/__init__.py": "",
        # a -> b -> c -> a: a plain import, one inside a function, one under TYPE_CHECKING
        "aegis/a.py": "import aegis.b\n",
        "aegis/b.py": "def later():\n    from .c import thing\n",
        "aegis/c.py": "import typing\nif typing.TYPE_CHECKING:\n    from aegis import a\n",
        # a package's __init__ and its module: `from aegis.ckpt import store` imports the
        # package (its __init__) as well as aegis.ckpt.store
        "aegis/ckpt/__init__.py": "from aegis.ckpt.api import save\n",
        "aegis/ckpt/api.py": "from aegis.ckpt import store\n",
        "aegis/ckpt/store.py": "import os\n",
        # no cycle: a name from a module, a relative import of a sibling, an outside package
        "aegis/d.py": "from aegis.e import f\nfrom . import e\nimport json\n",
        "aegis/e.py": "f = 1\n",
        "aegis/sub/__init__.py": "from . import leaf\n",  # itself and its module: no cycle
        "aegis/sub/leaf.py": "from .. import e\n",
    })  # fmt: skip
    graph = import_graph(found)
    assert graph["aegis.d"] == {"aegis.e": 1, "aegis": 2}
    assert graph["aegis.sub"] == {"aegis.sub.leaf": 1}
    assert graph["aegis.sub.leaf"] == {"aegis": 1, "aegis.e": 1}
    assert import_cycles(found) == [
        "aegis.a (src/aegis/a.py:1) -> aegis.b (src/aegis/b.py:2) -> aegis.c (src/aegis/c.py:3)"
        " -> aegis.a",
        "aegis.ckpt (src/aegis/ckpt/__init__.py:1) -> aegis.ckpt.api (src/aegis/ckpt/api.py:1)"
        " -> aegis.ckpt",
    ]


def test_the_checks_see_the_whole_source_tree() -> None:
    found = modules(SRC)
    assert {"aegis", "aegis.core.machine", "aegis.cli.main", "aegis.checkpoint.api"} <= set(found)
    assert not any("_generated" in name for name in found)
    assert sum(1 for m in found.values() for _ in _defs(ast.parse(m.path.read_text()))) > 500
    graph = import_graph(found)
    assert "aegis.core.machine" in graph["aegis.master.job_runner"]


# -- the checks, on src/aegis ----------------------------------------------------------------


def test_no_file_under_src_aegis_is_over_400_lines() -> None:
    failures = long_files(modules(SRC))
    assert not failures, "\n".join(failures)


def test_no_def_under_src_aegis_is_over_60_lines() -> None:
    failures = long_defs(modules(SRC))
    assert not failures, "\n".join(failures)


def test_no_import_cycle_among_aegis_modules() -> None:
    failures = import_cycles(modules(SRC))
    assert not failures, "\n".join(failures)
