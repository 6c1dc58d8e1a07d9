"""Streaming DiLoCo (``diloco:H:F:TAU:ALPHA[:SPLIT]``) priced: fragment sizes, the schedule,
and the step-by-step timeline of exchanges that overlap the next TAU inner steps.

The runtime (``gradsync.strategies.streaming``, docs/streaming.md) needs torch; the simulator
must not. The fragment rules both use are ``gradsync.fragments`` (no torch): under the
``layers`` split layer i (a module holding trainable parameters directly, in module order)
belongs to fragment ``i % F`` (``strided``); under the default ``rows`` split every tensor with
at least F rows is cut into F blocks of rows and the smaller ones go whole to the lightest
fragment (``row_blocks``, priced by ``row_loads``). The schedule is written again here and
tested against the runtime's (tests/unit/test_sim_streaming.py): fragment p starts its exchange
after every step t with ``(t + 1) % H == ((p + 1) * H // F) % H``.

A model's sizes come as one entry per layer (``layers``): the layer's bytes, which is all the
``layers`` split needs (``layer_bytes``, or ``--layers``), or its tensors' ``(rows, bytes)``
(``layer_tensors``), which the ``rows`` split needs to cut them as the runtime does. Given a
layer's bytes alone, the ``rows`` split cuts it evenly F ways (a layer of many rows, as most
are).

The timeline: the exchange of a fragment is one collective, so it starts once the slowest
worker has finished the step it is launched after (and the previous exchange has left the
link); it takes the comm model's time for that fragment's share of the bytes; TAU steps later
each worker, after that step's compute, waits for whatever of it has not finished. A worker
that gets there after the exchange finished does not wait at all, and does not wait for the
other workers either: only the collective ties them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from gradsync.errors import UsageError
from gradsync.fragments import layers as module_layers
from gradsync.fragments import row_blocks, strided, tensor_rows
from gradsync.spec import SPLITS

#: One layer's size: its bytes, or its tensors' ``(rows, bytes)`` in parameter order.
Layer: TypeAlias = float | Sequence[tuple[int, float]]


def offsets(period: int, fragments: int) -> list[int]:
    """Fragment p starts its exchange after the steps t with ``(t + 1) % period`` equal to
    ``offsets[p]`` (``gradsync.strategies.streaming.offsets``)."""
    return [(p + 1) * period // fragments % period for p in range(fragments)]


def layer_bytes(model: Any) -> list[int]:
    """Bytes of each layer of a torch module, as streaming DiLoCo groups them: a module that
    holds trainable parameters directly, in module order; a tensor shared by two modules
    counts in the first. Read by duck typing (``parameters()``, ``modules()``,
    ``parameters(recurse=False)``), so the simulator stays importable without torch."""
    return [sum(nbytes for _, nbytes in layer) for layer in layer_tensors(model)]


def layer_tensors(model: Any) -> list[list[tuple[int, int]]]:
    """Each layer's tensors (as ``layer_bytes`` groups them, ``gradsync.fragments.layers`` on
    the trainable parameters, as the runtime's) as ``(rows, bytes)``: rows as the rows split
    counts them (``gradsync.fragments.tensor_rows``: the first dimension, 1 for a scalar or a
    non-contiguous tensor, which it takes whole). A layer of no bytes is left out. Duck-typed,
    as ``layer_bytes``."""
    params = [p for p in model.parameters() if p.requires_grad]
    out: list[list[tuple[int, int]]] = []
    for group in module_layers(model, params):
        layer = [
            (tensor_rows(params[i]), params[i].numel() * params[i].element_size()) for i in group
        ]
        if sum(nbytes for _, nbytes in layer):
            out.append(layer)
    return out


def fragment_shares(
    layers: Sequence[Layer] | None, fragments: int, split: str = SPLITS[0]
) -> list[float]:
    """Share of the model's bytes each fragment carries under ``split``: ``layers`` strided
    over the fragments (layer i to fragment i % F), or the rows split (``row_loads``), when
    the sizes are known, else 1/F each."""
    if fragments < 1:
        raise UsageError(f"fragments must be at least 1, got {fragments}")
    if split not in SPLITS:
        raise UsageError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if layers is None or fragments == 1:
        return [1.0 / fragments] * fragments
    sizes = [_layer_total(x) for x in layers]
    if not sizes or any(not (x > 0 and np.isfinite(x)) for x in sizes):
        raise UsageError(f"--layers needs sizes > 0, one per layer, got {list(layers)}")
    total = sum(sizes)
    if split == "rows":
        return [load / total for load in row_loads(layers, fragments)]
    if fragments > len(sizes):
        # The runtime refuses the same (gradsync.strategies.streaming.strided_fragments).
        raise UsageError(
            f"F={fragments} fragments, but --layers lists only {len(sizes)} layers; "
            f"use F <= {len(sizes)}"
        )
    return [sum(group) / total for group in strided(sizes, fragments)]


def _layer_total(layer: Layer) -> float:
    if isinstance(layer, Sequence):
        return float(sum(nbytes for _, nbytes in layer))
    return float(layer)


def row_loads(layers: Sequence[Layer], fragments: int) -> list[float]:
    """Bytes of each fragment under the rows split: the blocks the runtime cuts
    (``gradsync.fragments.row_blocks`` on the same ``(rows, bytes)``), a whole tensor its
    bytes, a block of rows its share of them. A layer given by its bytes alone is cut into F
    equal parts (as a tensor of F rows)."""
    sizes = [
        size
        for layer in layers
        for size in (layer if isinstance(layer, Sequence) else [(fragments, float(layer))])
    ]
    blocks = row_blocks(sizes, fragments)
    filled = sum(1 for held in blocks if held)
    if filled < fragments:
        # The runtime refuses the same (gradsync.strategies.streaming.row_fragments).
        raise UsageError(
            f"F={fragments} fragments, but the model's trainable tensors fill only "
            f"{filled} (a tensor with fewer than F rows is not cut); use F <= "
            f"{max(1, filled)}"
        )
    loads = []
    for held in blocks:
        load = 0.0
        for i, a, b in held:
            rows, nbytes = sizes[i]
            load += nbytes if (a, b) == (0, rows) else (b - a) * (nbytes / rows)
        loads.append(load)
    return loads


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What the timeline needs of a streaming spec: H, TAU, each fragment's exchange time in
    ms, and whether the end of training needs one more exchange of every fragment."""

    period: int
    delay: int
    costs: tuple[float, ...]  # ms per exchange, by fragment
    merge_replaces: bool  # one fragment and ALPHA 0: a merge leaves the replicas agreeing

    def starting(self, step: int) -> list[int]:
        at = (step + 1) % self.period
        return [p for p, o in enumerate(offsets(self.period, len(self.costs))) if o == at]


@dataclass(slots=True)
class Timeline:
    """``end[t, w]``: worker w finished step t's compute; ``resume[t, w]``: it could start step
    t + 1 (after waiting for the exchanges applied at t); ``release[t]``: when those were all
    finished (0 where none was); ``merged[t]``: whether any was applied at t."""

    end: np.ndarray
    resume: np.ndarray
    release: np.ndarray
    merged: np.ndarray


def timeline(c: np.ndarray, plan: Plan) -> Timeline:
    """Run the schedule on a ``(steps, workers)`` compute matrix (ms)."""
    steps, workers = c.shape
    tl = Timeline(
        end=np.empty_like(c),
        resume=np.empty_like(c),
        release=np.zeros(steps),
        merged=np.zeros(steps, dtype=bool),
    )
    free = np.zeros(workers)  # when each worker may start its next step
    link = 0.0  # when the last exchange started leaves the link
    pending: list[tuple[int, float]] = []  # (step it is applied after, finish time)
    for t in range(steps):
        tl.end[t] = free + c[t]
        slowest = float(tl.end[t].max())
        # The runtime applies what is due, then starts this step's fragments (so they wait
        # for it), then applies what is due at once (TAU 0, plain DiLoCo's timing).
        done, pending = _due(pending, t)
        for p in plan.starting(t):
            link = max([slowest, link, *done]) + plan.costs[p]
            pending.append((t + plan.delay, link))
        now, pending = _due(pending, t)
        done += now
        if t == steps - 1:
            done += _finish(plan, pending, bool(done), max([slowest, link, *done]))
        tl.merged[t] = bool(done)
        tl.release[t] = max(done, default=0.0)
        free = np.maximum(tl.end[t], tl.release[t])
        tl.resume[t] = free
    return tl


def _due(
    pending: list[tuple[int, float]], step: int
) -> tuple[list[float], list[tuple[int, float]]]:
    """(finish times of the exchanges due by ``step``, those still pending)."""
    due = [finish for at, finish in pending if at <= step]
    return due, [(at, f) for at, f in pending if at > step]


def _finish(
    plan: Plan, pending: list[tuple[int, float]], merged: bool, ready: float
) -> list[float]:
    """The end of training (``DiLoCo.finalize``): finish times of the exchanges in flight,
    waited for, then, unless a merge at the last step or of those left the replicas agreeing,
    of one exchange of every fragment, one after the other, from ``ready`` (the last step's
    compute, the link and what was applied at it all done)."""
    waited = [finish for _, finish in pending]
    if plan.merge_replaces and (merged or waited):
        return waited
    return [*waited, max([ready, *waited]) + sum(plan.costs)]


__all__ = [
    "Layer",
    "Plan",
    "Timeline",
    "fragment_shares",
    "layer_bytes",
    "layer_tensors",
    "offsets",
    "row_loads",
    "timeline",
]
