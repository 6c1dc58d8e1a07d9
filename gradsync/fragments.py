"""Streaming DiLoCo's fragment rules, on plain sizes: one copy for the runtime and the simulator.

``gradsync.strategies.streaming`` (torch) cuts a model's tensors into fragments with these
rules, and ``gradsync.sim.streaming`` (no torch) prices the fragments they make, so both
import them from here rather than each writing them out. No torch here: the rules read a
model by duck typing (``modules()``, ``parameters(recurse=False)``, a tensor's ``shape``,
``dim()``, ``is_contiguous()``) and otherwise work on numbers.

- ``layers``: the layers the ``layers`` split strides, ``strided``: which go to each fragment.
- ``tensor_rows``: the rows the ``rows`` split may cut a tensor along, ``row_blocks``: the
  blocks of rows it gives each fragment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def layers(model: Any, params: Sequence[Any]) -> list[list[int]]:
    """Indices into ``params``, grouped by the module that holds them directly (a "layer":
    ``nn.Linear``'s weight and bias together), in module order; a tensor shared by two
    modules belongs to the first."""
    index = {id(p): i for i, p in enumerate(params)}
    seen: set[int] = set()
    out: list[list[int]] = []
    for module in model.modules():
        layer = []
        for p in module.parameters(recurse=False):
            if id(p) in index and id(p) not in seen:
                seen.add(id(p))
                layer.append(index[id(p)])
        if layer:
            out.append(layer)
    return out


def strided(items: Sequence[T], fragments: int) -> list[list[T]]:
    """The ``layers`` split: item i (a layer) to fragment ``i % fragments``, each fragment's
    items in order (fragment p holds p, p + F, p + 2F, ...: it spans the whole depth)."""
    return [list(items[p::fragments]) for p in range(fragments)]


def tensor_rows(p: Any) -> int:
    """The rows the rows split may cut ``p`` along: its first dimension. A scalar has none to
    cut, and a non-contiguous tensor (a transposed weight, say) is taken whole too, as one
    row: a block of its rows would be scattered through its memory rather than one stretch of
    it, so every block the split makes stays a plain slice of its parameter's storage."""
    return int(p.shape[0]) if p.dim() >= 1 and p.is_contiguous() else 1


def row_blocks(
    sizes: Sequence[tuple[int, float]], fragments: int
) -> list[list[tuple[int, int, int]]]:
    """The rows split on ``sizes``, each tensor's (rows, bytes) in parameter order: for each
    fragment, the ``(tensor, first row, end row)`` blocks it holds, in parameter order.

    A tensor with at least ``fragments`` rows is cut into one block per fragment, block p to
    fragment p, their sizes differing by one row at most: the blocks with an extra row go to
    the fragments with the fewest bytes so far. A smaller tensor goes whole, ``(i, 0, rows)``,
    to the fragment with the fewest bytes so far. Ties go to the lowest index. Both greedy
    choices keep the largest fragment within one increment (a row, or a small tensor) of the
    smallest, so none strays more than that from 1/F of the bytes. Pure arithmetic: integer
    bytes (the runtime's) are counted exactly, a row as ``bytes // rows``."""
    loads: list[float] = [0] * fragments
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(fragments)]
    for i, (rows, nbytes) in enumerate(sizes):
        if rows < fragments:
            p = min(range(fragments), key=lambda q: (loads[q], q))
            out[p].append((i, 0, rows))
            loads[p] += nbytes
            continue
        base, extra = divmod(rows, fragments)
        row = nbytes // rows
        longer = set(sorted(range(fragments), key=lambda q: (loads[q], q))[:extra])
        start = 0
        for p in range(fragments):
            count = base + (p in longer)
            out[p].append((i, start, start + count))
            loads[p] += count * row
            start += count
    return out


__all__ = ["layers", "row_blocks", "strided", "tensor_rows"]
