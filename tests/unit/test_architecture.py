"""Structural rules of the package: no import cycles, no side doors into the strategy protocol,
private torch APIs only through ``gradsync.compat``, no function over 80 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "gradsync"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of gradsync (a file or folder under it)."""
    parts = name.split(".")
    if parts[0] != "gradsync":
        return False
    path = PACKAGE.parent.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported(path: Path, module: str) -> set[str]:
    """Every gradsync module ``path`` imports: lazily (inside functions), under ``if
    TYPE_CHECKING:`` or at the top, all alike (an arrow is an arrow in the house's plan).
    ``from a import b`` counts as ``a.b`` where that is a module, else as ``a``: the package
    ``a`` is run too, but it loads its names lazily (PEP 562) and would otherwise make every
    ``from gradsync import compat`` an arrow into the package's own facade."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if _is_module(sub) else base)
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


def test_the_cycle_finder_finds_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    lazy = tmp_path / "m.py"
    lazy.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gradsync.synchronizer import Synchronizer\n"
        "def f():\n    from gradsync.strategies import bsp\n"
        "from gradsync import compat\n"
        "from gradsync.strategies import Strategy\n"
    )
    assert _imported(lazy, "gradsync.m") == {
        "gradsync.synchronizer",
        "gradsync.strategies.bsp",
        "gradsync.compat",
        "gradsync.strategies",
    }


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_checkpointing_never_reaches_the_synchronizer() -> None:
    """No arrow back up: ``gradsync.checkpoint`` is handed the training loop's parts
    (``Checkpointer``) and imports nothing that imports the Synchronizer."""
    graph = import_graph()
    modules = [
        m for m in graph if m == "gradsync.checkpoint" or m.startswith("gradsync.checkpoint.")
    ]
    assert "gradsync.checkpoint.checkpointer" in modules
    for module in modules:
        assert "gradsync.synchronizer" not in _reachable(graph, module), module


#: docs/architecture.md's table: which packages each package may import (top-level modules
#: are open to all)
MAY_IMPORT = {
    "strategies": {"compression", "checks", "telemetry"},
    "compression": set(),
    "checks": set(),
    "checkpoint": {"strategies", "checks", "telemetry"},
    "telemetry": set(),
    "sim": {"telemetry", "processes"},
    "cluster": {"processes"},
    "workloads": set(),
    "processes": set(),
    # live membership: the Manager heals a replica with what a checkpoint holds (the strategy's
    # model state, the registry) and serves its group's store on loopback (processes.stores);
    # the final average is asked for at checks' END, as the strategies ask for it; its
    # quorum's participants are a compressor's group (compression.base.ReplicaExchange)
    "membership": {"strategies", "checkpoint", "processes", "checks", "compression"},
    # the top of the house: nothing imports it, it may import everything
    "runner": {
        "strategies",
        "compression",
        "checks",
        "checkpoint",
        "telemetry",
        "sim",
        "cluster",
        "workloads",
        "processes",
        "membership",
    },
    "fault": {"checkpoint"},  # the old name's aliases
}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in MAY_IMPORT else None


def test_packages_import_only_what_the_architecture_allows() -> None:
    arrows = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if (source := _package(module)) is not None
        for target in targets
        if (other := _package(target)) not in (None, source) and other not in MAY_IMPORT[source]
    )
    assert arrows == [], "arrows docs/architecture.md does not allow:\n" + "\n".join(arrows)


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


_ATTRIBUTE_CALLS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    """``_x`` and ``__x`` are private; a dunder (``__version__``) is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` for each private torch name ``source`` spells:

    - an import of one: ``import torch._C``, ``from torch._C import x``, ``from torch.x import _y``;
    - an attribute chain from ``torch``, or from a name an import bound to a torch module or
      object (``import torch as t``, ``import torch.distributed as dist``, ``from torch import
      nn``), with a private segment: ``torch._foreach_div_``, ``dist.distributed_c10d._x``;
    - ``getattr(<such a chain or name>, "_name")`` (and has-, set-, delattr) with a literal name.

    Each name is given as torch spells it, an alias resolved (``dist._x`` is
    ``torch.distributed._x``), and a chain once, whole. Flow-insensitive: a name bound to torch
    anywhere in the module counts everywhere in it. Not counted: attributes of what a call returns
    (``torch.zeros(1)._x``) or of any other object (``tensor._x``: another rule), and torch names
    in other strings (``"torch._dynamo"`` as a module to import)."""
    tree = ast.parse(source)
    found: set[tuple[int, str]] = set()
    bound: dict[str, str] = {}  # a name in the module -> the torch path it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _is_torch(alias.name):
                    continue
                if any(_private(s) for s in alias.name.split(".")):
                    found.add((node.lineno, alias.name))
                # ``import torch.x`` binds ``torch``; ``import torch.x as y`` binds y to torch.x
                bound[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and _is_torch(node.module or ""):
            module = node.module or ""
            private_module = any(_private(s) for s in module.split("."))
            for alias in node.names:
                if alias.name == "*":
                    found.update([(node.lineno, module)] if private_module else [])
                    continue
                path = f"{module}.{alias.name}"
                if private_module or _private(alias.name):
                    found.add((node.lineno, path))
                bound[alias.asname or alias.name] = path

    def torch_chain(node: ast.expr) -> list[str] | None:
        """``[the torch path the chain's root is bound to, the attributes after it...]``."""
        attributes: list[str] = []
        while isinstance(node, ast.Attribute):
            attributes.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in bound:
            return [bound[node.id], *reversed(attributes)]
        return None

    # a chain is reported at its outermost attribute only
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = torch_chain(node)
            if chain is not None and any(_private(a) for a in chain[1:]):
                found.add((node.lineno, ".".join(chain)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ATTRIBUTE_CALLS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            chain = torch_chain(node.args[0])
            if chain is not None:
                found.add((node.lineno, ".".join([*chain, node.args[1].value])))
    return sorted(found)


def test_private_torch_apis_are_used_only_in_the_compat_module() -> None:
    hits = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "compat.py"
        for line, name in private_torch_uses(path.read_text())
    ]
    assert hits == [], "private torch names outside gradsync/compat.py:\n" + "\n".join(hits)


def test_the_private_torch_finder_sees_every_spelling() -> None:
    source = (
        "import torch\n"
        "import torch as t\n"
        "import torch.distributed as dist\n"
        "import torch._dynamo\n"  # 4
        "from torch import nn, _C as C\n"  # 5
        "from torch._utils import _flatten_dense_tensors\n"  # 6
        "from torch.nn import functional as F\n"
        "from torch.distributed import distributed_c10d\n"
        "import tensorly as tl\n"
        "def f(tensor, grads, optimizer, _private):\n"
        "    torch._foreach_div_(grads, 2.0)\n"  # 11
        "    t._C._dynamo.guards\n"  # 12
        "    dist.distributed_c10d._get_default_group()\n"  # 13
        "    distributed_c10d._get_default_store()\n"  # 14
        "    nn.Module._parameters\n"  # 15
        "    F._canonical_mask\n"  # 16
        "    getattr(torch, '_foreach_copy_', None)\n"  # 17
        "    hasattr(dist, '_functional_collectives')\n"  # 18
        "    torch.__version__, torch.nn.Module.__init__, torch.nn.functional.relu\n"
        "    tensor._version, optimizer._opt_called, _private.x, tl._x\n"
        "    torch.zeros(1)._version, getattr(tensor, '_foo'), getattr(torch, name)\n"
        "    getattr(torch.nn.utils, 'get_total_norm', None), 'torch._C'\n"
    )
    assert private_torch_uses(source) == [
        (4, "torch._dynamo"),
        (5, "torch._C"),
        (6, "torch._utils._flatten_dense_tensors"),
        (11, "torch._foreach_div_"),
        (12, "torch._C._dynamo.guards"),
        (13, "torch.distributed.distributed_c10d._get_default_group"),
        (14, "torch.distributed.distributed_c10d._get_default_store"),
        (15, "torch.nn.Module._parameters"),
        (16, "torch.nn.functional._canonical_mask"),
        (17, "torch._foreach_copy_"),
        (18, "torch.distributed._functional_collectives"),
    ]


def foreign_private_uses(source: str) -> list[tuple[int, str]]:
    """``obj._name`` where the module does not define ``_name`` itself (as a function, class,
    attribute it assigns, variable or argument): another module's private attribute reached
    from outside. ``self._x`` and ``cls._x`` are the object's own; private names of imported
    outside modules (``argparse._SubParsersAction``) are their business, torch's excepted,
    which the compat rule above covers."""
    tree = ast.parse(source)
    defined: set[str] = set()
    outside: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            base = node.module if isinstance(node, ast.ImportFrom) else None
            for alias in node.names:
                origin = base or alias.name
                if not origin.startswith(("gradsync", "torch")):
                    outside.add(alias.asname or alias.name.partition(".")[0])
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        root = node.value
        if isinstance(root, ast.Name) and root.id in ("self", "cls", *outside):
            continue
        if node.attr not in defined:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_reaches_into_another_modules_private_attributes() -> None:
    hits = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "compat.py"  # private torch attributes are its purpose
        for line, name in foreign_private_uses(path.read_text())
    ]
    assert hits == [], "private attributes reached from another module:\n" + "\n".join(hits)


def test_the_foreign_private_finder_sees_a_reach_but_not_own_names() -> None:
    source = (
        "import argparse\n"
        "class A:\n    def __init__(self):\n        self._mine = 1\n"
        "def f(sync, other):\n"
        "    sync._final_handshake()\n"  # another module's
        "    other._mine\n"  # assigned in this module: its own
        "    argparse._SubParsersAction\n"  # an outside module's business
        "    self_like = other.__class__\n"  # dunder
    )
    assert foreign_private_uses(source) == [(6, "sync._final_handshake")]


#: the project's rule (its guide: "no function over ~80 lines"), counted from ``def`` to the
#: function's last line, docstring and decorators' arguments included
LONGEST_FUNCTION = 80


def long_functions(source: str, limit: int = LONGEST_FUNCTION) -> list[tuple[int, str, int]]:
    """Every function or method of ``source`` longer than ``limit`` lines: (line, name,
    length); nested functions are counted on their own and within their parent."""
    return [
        (node.lineno, node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_is_longer_than_the_projects_limit() -> None:
    hits = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name} ({length} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, name, length in long_functions(path.read_text())
    ]
    assert hits == [], (
        f"functions over {LONGEST_FUNCTION} lines (split them into named parts):\n"
        + "\n".join(hits)
    )


def test_the_long_function_finder_counts_from_def_to_the_last_line() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(4))
    method = body.replace("    ", "        ")
    source = f"def short():\n{body}\nclass A:\n    async def long(self):\n{method}{method}"
    assert long_functions(source, limit=5) == [(8, "long", 9)]  # 5 lines: short's own
    assert long_functions(source, limit=9) == []
