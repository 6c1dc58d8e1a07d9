"""Streaming DiLoCo's bookkeeping: which tensors form each fragment, when each fragment
synchronizes, and an outer exchange in flight.

``diloco:H:F:TAU:ALPHA[:SPLIT]`` (``DiLoCo(H, fragments=F, delay=TAU, alpha=ALPHA,
split=SPLIT)``) splits the model into F fragments. Each fragment synchronizes every H steps, at
its own offset, the offsets spread H/F apart, so one exchange carries one fragment, and the
peak bytes on the wire are the largest fragment's. A fragment's outer exchange starts after its
step and is applied TAU inner steps later, overlapped with them; the worker's fragment then
becomes ``ALPHA * local + (1 - ALPHA) * global`` (ALPHA 0: the new global parameters, as in
DiLoCo), which drops the TAU local steps taken meanwhile (ALPHA 0) or half-keeps them.
``keep`` in ALPHA's place (``diloco:H:F:TAU:keep``, ``keep_local=True``) keeps them whole:
the fragment becomes ``global + (local - sent)``, ``sent`` being its local values when the
exchange started, so the delay costs no local work; those steps then count in the fragment's
next pseudo-gradient.

Two splits (``SPLITS``):

- ``rows`` (the default, ``row_fragments``): every tensor with at least F rows is cut into F
  blocks of contiguous rows, block p to fragment p; smaller tensors go whole to the fragment
  with the fewest bytes so far. Each fragment holds 1/F of the bytes to within about one row,
  however uneven the layers, so the peak bytes per exchange are 1/F of plain DiLoCo's.
- ``layers`` (``strided_fragments``, the Streaming DiLoCo paper's form): whole layers, strided
  (fragment p holds layers p, p + F, p + 2F, ...: each fragment spans the whole depth). The
  peak is the largest fragment's, far above 1/F when one layer dominates.

With one fragment both are the model's tensors in order: plain DiLoCo's flat layout. The
rules themselves, on plain sizes and without torch (``layers``, ``row_blocks``), are
``gradsync.fragments``, which the simulator prices the fragments with too. The strategy itself
is ``gradsync.strategies.local_sgd.DiLoCo``; docs/streaming.md has the schedule and what each
knob trades.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradsync.errors import UsageError
from gradsync.fragments import layers, row_blocks, strided, tensor_rows
from gradsync.spec import SPLITS


def strided_fragments(
    model: torch.nn.Module, params: list[torch.Tensor], fragments: int, spec: str
) -> list[list[int]]:
    """Indices into ``params`` of each fragment: layer i goes to fragment ``i % fragments``,
    and each fragment lists its tensors in the model's order (one fragment: all of them, in
    order, which is plain DiLoCo's flat layout)."""
    if fragments == 1:
        return [list(range(len(params)))]
    found = layers(model, params)
    if fragments > len(found):
        raise UsageError(
            f"strategy {spec!r}: F={fragments} fragments, but the model has only {len(found)} "
            "layers (modules holding trainable parameters); use F <= "
            f"{max(1, len(found))}"
        )
    return [sorted(i for layer in group for i in layer) for group in strided(found, fragments)]


def row_fragments(
    params: list[torch.Tensor], fragments: int, spec: str
) -> list[list[torch.Tensor]]:
    """The tensors of each fragment under the rows split (``row_blocks``): a whole parameter,
    or a block of its rows as a view sharing its storage (``p.detach().narrow``), so that
    flattening a fragment reads the model and ``copy_into`` writes into it. One fragment: the
    parameters themselves."""
    if fragments == 1:
        return [list(params)]
    sizes = [(tensor_rows(p), p.numel() * p.element_size()) for p in params]
    blocks = row_blocks(sizes, fragments)
    filled = sum(1 for held in blocks if held)
    if filled < fragments:
        raise UsageError(
            f"strategy {spec!r}: F={fragments} fragments, but the model's trainable tensors "
            f"fill only {filled} (a tensor with fewer than F rows is not cut); use F <= "
            f"{max(1, filled)}"
        )
    return [
        [
            params[i] if (a, b) == (0, sizes[i][0]) else params[i].detach().narrow(0, a, b - a)
            for i, a, b in held
        ]
        for held in blocks
    ]


def fragment_tensors(
    model: torch.nn.Module, params: list[torch.Tensor], fragments: int, split: str, spec: str
) -> list[list[torch.Tensor]]:
    """The tensors of each fragment under ``split`` (one of ``SPLITS``)."""
    if split not in SPLITS:
        raise UsageError(f"strategy {spec!r}: split {split!r} is not one of {', '.join(SPLITS)}")
    if split == "layers":
        groups = strided_fragments(model, params, fragments, spec)
        return [[params[i] for i in group] for group in groups]
    return row_fragments(params, fragments, spec)


def check_saved_fragments(saved: dict[str, Any], fragments: int, split: str, spec: str) -> None:
    """Refuse a checkpoint's streaming state (``saved``: DiLoCo's ``state_dict()["streaming"]``,
    empty for plain DiLoCo) that this run, ``spec`` with ``fragments`` cut by ``split``, would
    read back wrongly: ``global`` is the fragments' flat global copies end to end, which
    another number of fragments or another split would put into the wrong elements. A
    checkpoint that records no split was written before the rows split existed: by "layers".
    With one fragment every split is the same flat layout. Used by ``DiLoCo.load_state_dict``
    and, before any worker starts, by ``gradsync run --resume``."""
    if int(saved.get("fragments", 1)) != fragments:
        raise UsageError(
            f"the checkpoint was saved by diloco with {saved.get('fragments', 1)} "
            f"fragment(s); this run is {spec} with {fragments}: resume with the "
            "same number of fragments"
        )
    if fragments == 1:
        return
    was = str(saved.get("split", "layers"))
    if was != split:
        raise UsageError(
            f"the checkpoint was saved by diloco with its fragments split by {was}; this run is "
            f"{spec}, split by {split}: resume with the same split (diloco:H:F:TAU:ALPHA:{was})"
        )


def offsets(period: int, fragments: int) -> list[int]:
    """Fragment p synchronizes after the steps where ``(step + 1) % period`` equals
    ``offsets[p]``: spread ``period / fragments`` apart, the last fragment on plain DiLoCo's
    schedule (every ``period`` steps), the first after ``period // fragments`` steps."""
    return [(p + 1) * period // fragments % period for p in range(fragments)]


@dataclass(slots=True)
class Exchange:
    """A fragment's outer exchange: started after one step, applied after step ``due``.

    ``result`` is the future of the mean pseudo-gradient while it is in flight, the tensor
    once waited for (a checkpoint holds the tensor, so a resumed run applies it at ``due``
    exactly as the uninterrupted run does)."""

    fragment: int
    due: int
    result: torch.futures.Future[torch.Tensor] | torch.Tensor
    #: under ``keep``: the fragment's local values when the exchange started, so that the
    #: local steps taken while it was in flight are kept where it is applied
    sent: torch.Tensor | None = None


__all__ = [
    "Exchange",
    "check_saved_fragments",
    "fragment_tensors",
    "layers",
    "offsets",
    "row_blocks",
    "row_fragments",
    "strided_fragments",
]
