"""ZeRO's rows layout on plain state dicts: which rows of a tensor each rank holds, and an
optimizer state dict joined from every rank's pieces or split into one rank's again.

Under ``zero:1``'s rows layout (``gradsync.strategies.zero_rows``) each rank's optimizer steps
rows ``[r * c, r * c + c)`` of every parameter tensor (``c = ceil(rows / N)``: torch.chunk's
and FSDP2's dim-0 split; 0-dim tensors stay whole), so ``optimizer.state_dict()`` keeps the
whole tensors' indices, each entry holding this rank's rows of every per-element tensor
(AdamW's moments) and the per-tensor scalars (its step count) whole. ``join`` and ``split``
turn such per-rank dicts into the whole one and back: ``full_state_dict``, a resume on another
number of ranks and ``gradsync checkpoint export`` all need them, the last without the
strategy's torch objects, so they live here, on plain dicts, with no gradsync import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: the layout name a checkpoint's strategy state records (``ShardedUpdate.state_dict``)
ROWS = "rows"
WHOLE = "whole"


def rows_of(shape: Sequence[int], world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a tensor of ``shape`` (at least one dimension) that
    ``rank`` of ``world`` holds:
    blocks of ``ceil(rows / world)``, the last ones shorter or empty (torch.chunk's split)."""
    rows = int(shape[0])
    per = -(-rows // world)
    start = min(rank * per, rows)
    return start, min(start + per, rows)


def _per_element(value: Any) -> bool:
    """Whether an optimizer state entry of a piece is per element of it (a moment: rows), not
    one value for the whole tensor (a step count: 0-dim)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def join(parts: Sequence[Mapping[str, Any]], shapes: Sequence[Sequence[int] | None]) -> dict:
    """The whole optimizer state dict from every rank's (in rank order), each holding its rows
    of the tensors whose ``shapes[index]`` is given (None: the whole tensor, the same on every
    rank, taken from the first rank that has it); under the first rank's ``param_groups``."""
    state: dict[Any, Any] = {}
    for index, shape in enumerate(shapes):
        entries = [part["state"][index] for part in parts if index in part["state"]]
        if not entries:
            continue
        if shape is None:
            state[index] = entries[0]
            continue
        if len(entries) != len(parts):
            raise ValueError(
                f"optimizer state of parameter {index} is held by {len(entries)} of "
                f"{len(parts)} ranks: every rank holds rows of it under the rows layout"
            )
        state[index] = {
            key: torch.cat([e[key] for e in entries]) if _per_element(value) else value
            for key, value in entries[0].items()
        }
    return {**parts[0], "state": state}


def split(
    whole: Mapping[str, Any], shapes: Sequence[Sequence[int] | None], world: int, rank: int
) -> dict:
    """``rank``'s part of a whole optimizer state dict: its rows of the per-element entries of
    every tensor whose ``shapes[index]`` is given, the rest as it is."""
    state: dict[Any, Any] = {}
    for index, entry in whole["state"].items():
        shape = shapes[int(index)] if int(index) < len(shapes) else None
        if shape is None:
            state[index] = entry
            continue
        start, stop = rows_of(shape, world, rank)
        state[index] = {
            key: value[start:stop].clone()
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shape)
            else value
            for key, value in entry.items()
        }
    return {**whole, "state": state}


def layout_of(record: Mapping[str, Any] | None) -> str:
    """The layout a checkpoint's strategy state records (files written before the rows
    layout existed record none: whole tensors)."""
    return str((record or {}).get("layout", WHOLE))


def join_saved(
    parts: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any] | None]
) -> dict:
    """The whole optimizer state dict from the per-rank ones of a ``zero:1`` / ``zero:2``
    checkpoint, by the layout its strategy state ``records``: rows joined, or whole tensors
    each taken from the rank that holds it."""
    if layout_of(records[0]) == ROWS:
        shapes = (records[0] or {}).get("shapes") or []
        return join(parts, shapes)
    return join_whole(parts)


def join_whole(parts: Sequence[Mapping[str, Any]]) -> dict:
    """The whole optimizer state dict from every rank's, each holding the state of the whole
    tensors it owns, under the first rank's ``param_groups`` (the same on every rank)."""
    state: dict[Any, Any] = {}
    for part in parts:
        state.update(part["state"])
    return {**parts[0], "state": dict(sorted(state.items()))}
