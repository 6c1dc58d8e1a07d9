"""Streaming DiLoCo's bookkeeping: which tensors form each fragment, when each fragment
synchronizes, and an outer exchange in flight.

``diloco:H:F:TAU:ALPHA`` (``DiLoCo(H, fragments=F, delay=TAU, alpha=ALPHA)``) splits the model
into F fragments, strided across its layers (fragment p holds layers p, p + F, p + 2F, ...: each
fragment spans the whole depth). Each fragment synchronizes every H steps, at its own offset,
the offsets spread H/F apart, so one exchange carries about 1/F of the model and the peak bytes
on the wire drop F-fold. A fragment's outer exchange starts after its step and is applied TAU
inner steps later, overlapped with them; the worker's fragment then becomes
``ALPHA * local + (1 - ALPHA) * global`` (ALPHA 0: the new global parameters, as in DiLoCo).
The strategy itself is ``gradsync.strategies.local_sgd.DiLoCo``; docs/streaming.md has the
schedule and what each knob trades.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradsync.errors import UsageError


def layers(model: torch.nn.Module, params: list[torch.Tensor]) -> list[list[int]]:
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
    return [sorted(i for layer in found[p::fragments] for i in layer) for p in range(fragments)]


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


__all__ = ["Exchange", "layers", "offsets", "strided_fragments"]
