"""State that every replica holds alike, written once in all, a share by each replica.

Under a resizable strategy (``bsp``) every rank holds the same model and optimizer state; when
one rank wrote all of it, a checkpoint every step cost that rank the whole copy and write, and
the step, which waits for the slowest rank, paid it. Here each rank writes a share: whole
tensors, balanced by bytes plus a fixed cost per tensor (largest first, to the least loaded
rank, as ``ps_wire.shard_by_size``), the other tensors replaced by empty placeholders of their
dtype so the tree keeps its shape (``pack`` copies only this rank's). ``join`` puts the shares
of every rank's file back together, by the owner list saved beside them. (DCP's deduplication
of replicated tensors plans every save with collectives; these checkpoints post none.)
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradsync.checkpoint.packing import Share, skeleton

__all__ = ["join", "owners", "share", "share_of", "tensor_count", "whole"]


def owners(tree: Any, world_size: int, to_rank_0: frozenset[int] = frozenset()) -> list[int]:
    """The rank that writes each tensor of ``tree`` (in ``_tensors`` order), balanced by bytes
    and count (``_PER_TENSOR_BYTES``); the tensors at the indices ``to_rank_0`` go to rank 0.
    Deterministic for a given tree's shapes and dtypes, so every replica computes the same."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return list(_balanced(_costs(_tensors(tree)), world_size, to_rank_0))


#: what copying a tensor costs beyond its bytes, in bytes: each is a copy of its own (about
#: 0.5 us right after a step here, the time of about 5 KB). Balanced by bytes alone, charlm's
#: two ranks copied 48 and 78 tensors, 90 and 105 us a snapshot; with it 61 and 65, 100 each.
_PER_TENSOR_BYTES = 4096


def _costs(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t.numel() * t.element_size() + _PER_TENSOR_BYTES for t in tensors)


@functools.lru_cache(maxsize=8)
def _balanced(
    sizes: tuple[int, ...], world_size: int, to_rank_0: frozenset[int] = frozenset()
) -> tuple[int, ...]:
    # The same model every step: computed once per layout (a checkpoint every step).
    load = [0] * world_size
    owner = [0] * len(sizes)
    for i in to_rank_0:
        load[0] += sizes[i]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if i in to_rank_0:
            continue
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return tuple(owner)


def share(tree: Any, rank: int, owner: Sequence[int]) -> Share:
    """``tree`` as ``rank`` writes it: ``pack`` copies the tensors ``rank`` owns and packs
    every other one as an empty tensor of its dtype (``unpack`` gives that tree back)."""
    return Share(tree, owner, rank)


def share_of(
    tree: Any, rank: int, world_size: int, to_rank_0: frozenset[int] = frozenset()
) -> Share:
    """``share(tree, rank, owners(tree, world_size, to_rank_0))`` from one walk of ``tree``,
    which also takes its skeleton: ``pack`` reuses an earlier snapshot's encoding of a share
    with the same skeleton (a checkpoint every step of the same model and optimizer)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    described = skeleton(tree)
    if described is None:
        return share(tree, rank, owners(tree, world_size, to_rank_0))
    parts, tensors = described
    return Share(tree, _owners_of(parts, tensors, world_size, to_rank_0), rank, parts, tensors)


def whole(tree: Any, rank: int) -> Share:
    """``tree`` as a ``Share`` that ``rank`` writes whole: packed exactly as ``tree`` itself
    would be, but its encoding is kept and reused while its skeleton stays the same (a
    state that only this rank holds, saved every step: a parameter-server worker's model)."""
    described = skeleton(tree)
    if described is None:
        return Share(tree, [rank] * len(_tensors(tree)), rank)
    parts, tensors = described
    return Share(tree, [rank] * len(tensors), rank, parts, tensors)


#: the last (skeleton, world size, tensors pinned to rank 0) and its owners: the same every
#: step of a run
_last_owners: list[tuple[tuple[Any, ...], int, frozenset[int], tuple[int, ...]]] = []


def _owners_of(
    parts: tuple[Any, ...],
    tensors: Sequence[torch.Tensor],
    world_size: int,
    to_rank_0: frozenset[int],
) -> tuple[int, ...]:
    # A skeleton fixes every tensor's dtype and shape, hence its bytes and owner: comparing it
    # with the last one (at C speed) spares two method calls per tensor at every snapshot.
    if _last_owners:
        last_parts, last_world, last_pinned, last_owner = _last_owners[0]
        if last_world == world_size and last_pinned == to_rank_0 and last_parts == parts:
            return last_owner
    owner = _balanced(_costs(tensors), world_size, to_rank_0)
    _last_owners[:] = [(parts, world_size, to_rank_0, owner)]
    return owner


def tensor_count(tree: Any) -> int:
    """How many tensors ``tree`` holds (in the walk ``owners`` and ``join`` number them by)."""
    return len(_tensors(tree))


def join(shares: Sequence[Any], owner: Sequence[int]) -> Any:
    """The whole tree from every rank's ``share`` (``shares[r]`` is rank ``r``'s): each tensor
    is taken from its owner's share, the containers and other values from rank 0's."""
    if not shares:
        raise ValueError("no shares to join")
    by_rank = [_tensors(s) for s in shares]
    for r, tensors in enumerate(by_rank):
        if len(tensors) != len(owner):
            raise ValueError(
                f"rank {r}'s share holds {len(tensors)} tensors, the owner list {len(owner)}"
            )
    if max(owner, default=0) >= len(shares):
        raise ValueError(f"the owner list names rank {max(owner)}, only {len(shares)} shares")
    return _map_tensors(shares[0], lambda i, _: by_rank[owner[i]][i], len(owner))


def _tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor of ``tree`` in a fixed order (dicts in insertion order, then sequences)."""
    found: list[torch.Tensor] = []
    _collect(tree, found)
    return found


def _collect(node: Any, found: list[torch.Tensor]) -> None:
    # Appending to one list, not chained generators: ``owners`` walks the model and optimizer
    # state at every checkpoint, which may be every step.
    # The container types ``_map_tensors`` rebuilds, exactly (``pack`` refuses subclasses).
    kind = type(node)
    if kind is dict or kind is OrderedDict:
        for value in node.values():
            _collect(value, found)
    elif kind is list or kind is tuple:
        for value in node:
            _collect(value, found)
    elif isinstance(node, torch.Tensor):
        found.append(node)


def _map_tensors(tree: Any, fn: Callable[[int, torch.Tensor], Any], expected: int) -> Any:
    counter = [0]

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            i = counter[0]
            counter[0] += 1
            if i >= expected:
                raise ValueError(f"the tree holds more than the {expected} tensors expected")
            return fn(i, node)
        kind = type(node)
        if kind is dict or kind is OrderedDict:
            return kind((k, walk(v)) for k, v in node.items())
        if kind is list:
            return [walk(v) for v in node]
        if kind is tuple:
            return tuple(walk(v) for v in node)
        return node

    result = walk(tree)
    if counter[0] != expected:
        raise ValueError(f"the tree holds {counter[0]} tensors, {expected} were expected")
    return result
