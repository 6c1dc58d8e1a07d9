"""Flat views of a list of tensors: one contiguous vector, and the way back.

Strategies and compressors move many tensors as one (a parameter-server shard, DiLoCo's
pseudo-gradient, PowerSGD's factors), always in the tensors' order, each tensor's elements
contiguous. ``torch._utils._flatten_dense_tensors`` does the first half, but it is private
and its counterpart returns new tensors rather than writing into the originals, so these three
small functions are ours.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One new 1-D tensor holding ``tensors`` in order (detached; cast to ``dtype`` if given)."""
    if not tensors:
        return torch.zeros(0, dtype=dtype or torch.float32)
    parts = [t.detach().reshape(-1) for t in tensors]
    if dtype is not None:
        parts = [p.to(dtype) for p in parts]
    return torch.cat(parts)


def views(flat: torch.Tensor, shapes: Sequence[torch.Tensor | torch.Size]) -> list[torch.Tensor]:
    """Views into ``flat``, one per entry of ``shapes`` (a tensor or a size), in order."""
    out, offset = [], 0
    for like in shapes:
        size = like.shape if isinstance(like, torch.Tensor) else torch.Size(like)
        n = size.numel()
        out.append(flat[offset : offset + n].view(size))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat tensor has {flat.numel()} elements, the shapes hold {offset}")
    return out


def copy_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Write ``flat`` back into ``tensors`` in place (without recording autograd history)."""
    with torch.no_grad():
        for t, part in zip(tensors, views(flat, tensors), strict=True):
            t.copy_(part)


def chunks(tensors: Sequence[torch.Tensor], max_bytes: int) -> list[list[torch.Tensor]]:
    """``tensors`` in order, in runs of at most ``max_bytes`` each (a larger tensor alone), so
    that moving them one flat run at a time never copies more than that at once."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or size + nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


__all__ = ["chunks", "copy_into", "flatten", "views"]
