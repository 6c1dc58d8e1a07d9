"""Structural rules of the package: no import cycles, no side doors into the strategy protocol,
private torch APIs only through ``gradsync.compat``."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "gradsync"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(path: Path, module: str) -> set[str]:
    """Every gradsync module ``path`` imports, lazily (inside functions) or not, except under
    ``if TYPE_CHECKING:``; ``from a import b`` counts as ``a.b`` when that is a module."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {name for name in found if name == "gradsync" or name.startswith("gradsync.")}


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {resolve(dep) for dep in _imported(path, name)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None (depth-first, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := walk(start)):
            return cycle
    return None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "gradsync.strategies.base" in graph  # the walk found the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_lazy_cycles_but_not_type_checking_ones(tmp_path: Path) -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    lazy = tmp_path / "m.py"
    lazy.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gradsync.synchronizer import Synchronizer\n"
        "def f():\n    from gradsync.strategies import bsp\n"
    )
    assert _imported(lazy, "gradsync.m") == {"gradsync.strategies", "gradsync.strategies.bsp"}


SIDE_DOOR = re.compile(
    r"getattr\((self\.|sync\.)?_?strategy|hasattr\(spec|type: ignore\[attr-defined\]"
)


def test_nothing_reaches_around_the_strategy_protocol() -> None:
    hits = [
        f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if SIDE_DOOR.search(line)
    ]
    assert hits == []


# Private torch names gradsync uses; only gradsync/compat.py may spell them.
PRIVATE_TORCH = re.compile(
    r"_get_default_group|_get_default_store|_set_default_timeout|options\._timeout|"
    r"_opt_called|Py_IncRef|_get_backend|_device_types|_per_optimizer_states"
)


def test_private_torch_apis_are_used_only_in_the_compat_module() -> None:
    hits = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "compat.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE_TORCH.search(line)
    ]
    assert hits == []


def test_importing_the_synchronizer_takes_no_exit_hold() -> None:
    code = (
        "import gradsync.synchronizer, gradsync.compat as c\n"
        "assert c._HELD is None, 'hold taken at import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
