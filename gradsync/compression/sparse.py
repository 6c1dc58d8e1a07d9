"""Sparsifiers: ``topk:F`` and ``randomk:F`` keep ``k = ceil(F * n)`` of a bucket's n elements.

``topk`` keeps the k largest magnitudes. Ranks pick different indices, so the values cannot be
summed on the wire: each rank all-gathers its int32 indices plus values (k is the same on every
rank, so no size exchange is needed) and every rank scatters all payloads in rank order. It is
biased (small coordinates never move on their own), so ``parse_compression`` wraps it in error
feedback. Bytes this rank hands to the collective: ``k * (4 + element size)``, 8k for fp32.

``randomk`` cuts the bucket into k strata of ``n / k`` elements (``floor`` or ``ceil`` of it
where k does not divide n) and keeps one uniformly random position in each, drawn from
``(seed, bucket index, step)``: the same on every rank, so the k values are all-reduced like a
dense tensor. Each kept value is scaled by its stratum's size (each coordinate of a stratum is
kept with probability one over its size), which makes the estimate unbiased; its variance per
coordinate is ``x**2 (size - 1)``, about ``x**2 (n/k - 1)``. Bytes: ``k * element size``.

Why strata, not a uniformly random k-subset (until 2026-11-30): the positions are integer
arithmetic on a hash of ``(seed, stratum)`` (``fused.strata``), so every device
draws the same ones with no generator, no sort and nothing read back by the host. The encode +
decode of a 256 MB gradient on an H200 took 47 ms with the subset's sort-based draw (made on the
CPU, as a push's had to be for both ends to agree), 0.35 ms with the strata drawn inside the
compiled gather and scatter (BENCHMARKS.md, "gradsync on one GPU"); the draw now runs as torch
ops before them (``fused.strata`` says why), a form not yet timed on a GPU. Each coordinate is
still kept with probability about ``k / n``; two kept positions are never in one stratum.

:class:`TopKCodec` and :class:`RandomKCodec` are the encodings, shared by the hooks and by
parameter-server pushes, whose positions come from ``(derive_seed(seed, worker stream), step)``.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsync import exit_safety
from gradsync.compression import fused
from gradsync.compression._select import top_magnitudes
from gradsync.compression._wire import (
    accumulator_dtype,
    all_gather_mean,
    all_reduce_async,
    derive_seed,
    record_sent,
    world_and_rank,
)
from gradsync.compression.base import BucketLike, Compressor, Group, Layout, Stateless


def kept(fraction: float, numel: int) -> int:
    """How many of ``numel`` elements a fraction keeps: at least one, at most all."""
    return min(numel, max(1, math.ceil(fraction * numel)))


def check_fraction(name: str, fraction: float) -> None:
    if not (0.0 < fraction <= 1.0) or math.isnan(fraction):
        raise ValueError(f"{name} fraction must be in (0, 1], got {fraction}")


@dataclass(slots=True)
class TopKState:
    group: Group = None
    bytes_sent: int = 0
    fraction: float = 0.01
    sent: dict[int, torch.Tensor] | None = field(default=None, repr=False)

    def state_dict(self) -> dict[str, Any]:
        return {"fraction": self.fraction}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fraction = float(state["fraction"])


class TopKCodec(Stateless):
    """``k`` int32 indices, then the ``k`` values in ``wire``.

    Indices first: int32 at offset 0 is aligned; values follow at 4k, aligned for <= 4 bytes.
    """

    __slots__ = ("acc", "k", "layout", "numel", "wire")

    def __init__(self, numel: int, k: int, wire: torch.dtype, acc: torch.dtype) -> None:
        self.numel, self.k, self.wire, self.acc = numel, k, wire, acc
        self.layout: Layout = ((torch.int32, k), (wire, k))

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        index, values = top_magnitudes(x, self.k)
        return [index.to(torch.int32), values.to(self.wire)]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=self.acc, device=parts[0].device)
        out[parts[0].long()] = parts[1].to(self.acc)
        return out

    def accumulate(self, parts: list[torch.Tensor], out: torch.Tensor, step: int) -> None:
        # One encode's indices are distinct, so index_add_ has no colliding (racy) adds on GPU.
        out.index_add_(0, parts[0].long(), parts[1].to(out.dtype))

    def contribution(self, parts: list[torch.Tensor], step: int) -> TopKSent:
        return TopKSent(parts)


class TopKSent:
    """This rank's k values, for error feedback: subtracted from the corrected gradient at
    their k positions (``x - v`` there, ``x`` elsewhere, as ``x - decode(...)`` gives), with
    no dense n-element tensor."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts

    def subtract_from(self, corrected: torch.Tensor) -> torch.Tensor:
        flat = corrected.view(-1)
        flat.index_add_(0, self.parts[0].long(), self.parts[1].to(flat.dtype), alpha=-1)
        return corrected


def topk_hook(state: TopKState, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    """Mean over ranks of each rank's top-k, via one async all-gather of indices plus values."""
    buf = bucket.buffer()
    n = buf.numel()
    codec = TopKCodec(n, kept(state.fraction, n), buf.dtype, accumulator_dtype(buf.dtype))
    return all_gather_mean(state, bucket, codec, 0)


def topk_codec(
    numel: int, dtype: torch.dtype, shapes: list[list[int]], stream: int, *, fraction: float
) -> TopKCodec:
    """``Compressor.codec`` for topk (deterministic: ``stream`` is not used)."""
    del shapes, stream
    return TopKCodec(numel, kept(fraction, numel), dtype, accumulator_dtype(dtype))


@dataclass(slots=True)
class RandomKState:
    group: Group = None
    bytes_sent: int = 0
    fraction: float = 0.01
    seed: int = 0
    #: calls per bucket index: the step part of the index seed, equal on all ranks.
    steps: dict[int, int] = field(default_factory=dict)
    sent: dict[int, torch.Tensor] | None = field(default=None, repr=False)

    def state_dict(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "seed": self.seed, "steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fraction = float(state["fraction"])
        self.seed = int(state["seed"])
        self.steps = {int(k): int(v) for k, v in state["steps"].items()}


class RandomKCodec(Stateless):
    """``k`` values in the accumulator dtype, each already scaled by its stratum's size; no
    indices.

    Encoder and decoder draw the same positions from ``derive_seed(*key, step)``, on any
    device. :meth:`positions`, :meth:`gather` and :meth:`scatter` are the steps of encode and
    decode, for a caller that needs the positions more than once per step (the hook).
    """

    __slots__ = ("acc", "k", "key", "layout", "numel")

    def __init__(self, numel: int, k: int, key: tuple[int, ...], acc: torch.dtype) -> None:
        if numel >= fused.MAX_STRATA_NUMEL:
            raise ValueError(
                f"randomk draws from buckets of fewer than {fused.MAX_STRATA_NUMEL:,} elements "
                f"(its positions are exact in int64 only below that); got {numel:,}: use "
                "smaller buckets (bucket_mb) or parameter-server shards"
            )
        self.numel, self.k, self.key, self.acc = numel, k, key, acc
        self.layout: Layout = ((acc, k),)

    def seed(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return fused.seed_words(derive_seed(*self.key, step), device)

    def positions(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(position, stratum size) of each kept value."""
        return fused.strata(self.numel, self.k, *self.seed(step, device))

    def gather(self, x: torch.Tensor, chosen: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The kept values of ``x`` (flat), each times its stratum's size."""
        position, size = chosen
        return _fused(fused.RANDOMK_GATHER, x, x.reshape(-1), position, size, self.acc)

    def scatter(
        self, values: torch.Tensor, chosen: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """A bucket of zeros with ``values`` at the kept positions."""
        return _fused(fused.RANDOMK_SCATTER, values, values, chosen[0], self.numel)

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        return [self.gather(x, self.positions(step, x.device))]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        return self.scatter(parts[0], self.positions(step, parts[0].device))


def _fused(kernel: fused.Kernel, on: torch.Tensor, *args: Any) -> Any:
    """``kernel``'s function of ``args``: compiled where ``on`` is on a GPU, as separate torch
    ops elsewhere or where compilation is off or failed."""
    got = kernel.run_on(on, *args)
    return kernel.fn(*args) if got is None else got


def randomk_hook(state: RandomKState, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    """Mean over ranks of an unbiased random-k estimate, via one async all-reduce of k values."""
    buf = bucket.buffer()
    flat = buf.reshape(-1)
    n, index_key = flat.numel(), bucket.index()
    step = state.steps.get(index_key, 0)
    state.steps[index_key] = step + 1
    world, _ = world_and_rank(state.group)
    codec = RandomKCodec(
        n, kept(state.fraction, n), (state.seed, index_key), accumulator_dtype(buf.dtype)
    )
    # Drawn once: the all-reduce sums values only, and the callback scatters them back here.
    chosen = codec.positions(step, flat.device)
    values = codec.gather(flat, chosen)
    state.bytes_sent += values.numel() * values.element_size()
    if state.sent is not None:
        record_sent(state, index_key, codec.scatter(values, chosen))
    work = all_reduce_async(values, state.group)

    def scatter(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = codec.scatter(fut.value()[0].div_(world), chosen)
        return out.to(buf.dtype).view_as(buf)

    return exit_safety.then(work.get_future(), scatter)


def randomk_codec(
    numel: int,
    dtype: torch.dtype,
    shapes: list[list[int]],
    stream: int,
    *,
    fraction: float,
    seed: int,
) -> RandomKCodec:
    """``Compressor.codec`` for randomk: positions the same on either end, on any device."""
    del shapes
    key = (derive_seed(seed, stream),)
    return RandomKCodec(numel, kept(fraction, numel), key, accumulator_dtype(dtype))


def topk(fraction: float) -> Compressor:
    """Top-k without error feedback (``parse_compression("topk:F")`` adds it)."""
    check_fraction("topk", fraction)
    return Compressor(
        spec=f"topk:{fraction}",
        make_state=functools.partial(TopKState, fraction=fraction),
        hook=topk_hook,
        nominal_ratio=min(1.0, fraction) * 2.0,
        codec=functools.partial(topk_codec, fraction=fraction),
    )


#: randomk fractions below this get a warning (see ``randomk``).
RANDOMK_WARN_BELOW = 0.1


def randomk(fraction: float, seed: int = 0) -> Compressor:
    """Unbiased random-k; identical indices on every rank for a given step and bucket."""
    check_fraction("randomk", fraction)
    if fraction < RANDOMK_WARN_BELOW:
        # Unbiased, but each kept value is scaled by n/k: the variance per coordinate grows
        # like 1/F, which is what made small fractions diverge or lag in our measurements.
        warnings.warn(
            f"randomk:{fraction}: every kept value is scaled by n/k (about {1 / fraction:.0f}), "
            f"so the estimate's variance per element is about {1 / fraction - 1:.0f}x the "
            "squared gradient; below 0.1 training slows sharply or diverges (charlm: +27% loss "
            "after 200 steps at 0.01; a 6M-parameter mlp with SGD diverged). Raise the "
            f"fraction, or use topk:{fraction} (error feedback) or powersgd:R.",
            UserWarning,
            stacklevel=2,
        )
    return Compressor(
        spec=f"randomk:{fraction}",
        make_state=functools.partial(RandomKState, fraction=fraction, seed=seed),
        hook=randomk_hook,
        nominal_ratio=fraction,
        codec=functools.partial(randomk_codec, fraction=fraction, seed=seed),
    )
