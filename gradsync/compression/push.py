"""Push codecs: compression split from communication, for parameter-server pushes.

The compressor hooks (``hook(state, bucket) -> Future``) run their own collectives: they
all-reduce or all-gather a bucket and return the mean over ranks. A parameter-server push is
point-to-point instead (one ``isend`` from a worker, one ``irecv`` on the server per shard), so
those collectives cannot be used. A :class:`PushCodec` does only the byte part::

    codec = make_push_codec("topk:0.01", shard_numel, torch.float32, seed=worker)   # worker
    payload = codec.encode(flat_grad, step)        # 1-D uint8, always codec.payload_numel long
    dist.isend(payload, dst=server)

    codecs = {w: make_push_codec("topk:0.01", shard_numel, torch.float32, seed=w) ...}  # server
    buf = torch.empty(codecs[w].payload_numel, dtype=codecs[w].payload_dtype)
    dist.irecv(buf, src=w).wait()
    flat = codecs[w].decode(buf, step)            # the worker's step: its push count

The payload length depends only on ``(spec, numel, dtype, shapes)``, so the server can post the
``irecv`` before anything arrives. Error feedback lives on the worker: the residual (corrected
gradient minus the decoded payload, i.e. what was actually sent) is added to the next gradient,
so over T steps ``sum(decode(payload_t)) + residual == sum(gradients)``. Decoding needs no state
from previous steps: the server keeps one codec per worker only because randomk's indices come
from the worker's seed.

Wire format (``_wire.pack`` of the pieces, in this order; ``n`` = numel, ``d`` = the gradient
dtype, ``c`` = int8's chunk, 1024 by default, ``s`` = sign's chunk, 64 by default; 4-byte pieces
first so they stay aligned):

==============  ==============================================================  =============
spec            pieces                                                          fp32 ratio
==============  ==============================================================  =============
``none``        ``n`` values in ``d``                                           1
``fp16/bf16``   ``n`` values in fp16 / bf16                                     0.5
``int8``        ``ceil(n/c)`` fp32 scales, ``n`` int8 codes (stochastic)        ~0.251
``topk:F``      ``k`` int32 indices, ``k`` values in ``d``                      2F
``randomk:F``   ``k`` fp32 values, already scaled by ``n/k``; no indices        F
``sign``        ``ceil(n/s)`` fp32 scales ``mean|x|``, ``ceil(n/8)`` sign bytes  ~0.047
``powersgd:R``  every matrix's P (rows x R) then Q (cols x R) in fp32, then     shapes
                the uncompressed elements (vectors, small matrices) in ``d``
==============  ==============================================================  =============

``k = ceil(F * n)`` (at least 1). randomk sends no indices: both ends draw them from a CPU
generator seeded by ``(seed, step)``, which halves the payload (4k bytes instead of 8k) for an
O(n) ``randperm`` on each side; the server knows the step because a worker's pushes arrive in
order, and the CPU generator makes the draw independent of the device on either end. PowerSGD
computes P and Q locally (one power iteration, warm-started from the previous Q) and sends both,
so the decode ``P Q^T`` needs no server state. Unlike the all-reduce hook it has no
``start_iter`` phase of plain steps: those would change the payload size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from gradsync.compression._wire import accumulator_dtype, derive_seed, generator, pack, unpack
from gradsync.compression.allreduce import AllReduceState
from gradsync.compression.base import Compressor
from gradsync.compression.errorfeedback import ErrorFeedbackState
from gradsync.compression.fp import CastState
from gradsync.compression.int8 import Int8State, dequantize, quantize
from gradsync.compression.powersgd import (
    Plan,
    PowerSGDState,
    _factor_views,
    _orthonormalize,
    plan_shapes,
)
from gradsync.compression.sign import SignState, pack_signs, unpack_signs
from gradsync.compression.sparse import RandomKState, TopKState, kept
from gradsync.compression.spec import VALID_FORMS, parse_compression
from gradsync.errors import UsageError

Layout = tuple[tuple[torch.dtype, int], ...]


class _Format(Protocol):
    """One spec's encoding of a flat tensor ``x`` (accumulator dtype) into payload pieces."""

    layout: Layout

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]: ...
    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor: ...


class _Plain:
    """``none``, ``fp16``, ``bf16``: every element, cast to ``wire``."""

    __slots__ = ("acc", "layout", "wire")

    def __init__(self, numel: int, wire: torch.dtype, acc: torch.dtype) -> None:
        self.wire, self.acc = wire, acc
        self.layout: Layout = ((wire, numel),)

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        return [x.to(self.wire)]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        return parts[0].to(self.acc, copy=True)  # not a view of the receive buffer


class _Int8:
    __slots__ = ("acc", "chunk", "layout", "numel", "seed")

    def __init__(self, numel: int, chunk: int, seed: int, acc: torch.dtype) -> None:
        self.numel, self.chunk, self.seed, self.acc = numel, chunk, seed, acc
        self.layout: Layout = ((torch.float32, -(-numel // chunk)), (torch.int8, numel))

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        # Rounding noise is the worker's alone: the server never needs to redraw it.
        gen = generator(derive_seed(self.seed, step), x.device)
        scale, codes = quantize(x, self.chunk, gen)
        return [scale, codes]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        return dequantize(parts[0], parts[1], self.chunk).to(self.acc)


class _TopK:
    __slots__ = ("acc", "k", "layout", "numel", "wire")

    def __init__(self, numel: int, k: int, wire: torch.dtype, acc: torch.dtype) -> None:
        self.numel, self.k, self.wire, self.acc = numel, k, wire, acc
        self.layout: Layout = ((torch.int32, k), (wire, k))

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        index = x.abs().topk(self.k, sorted=False).indices
        return [index.to(torch.int32), x[index].to(self.wire)]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=self.acc, device=parts[0].device)
        out[parts[0].long()] = parts[1].to(self.acc)
        return out


class _RandomK:
    __slots__ = ("acc", "k", "layout", "numel", "seed")

    def __init__(self, numel: int, k: int, seed: int, acc: torch.dtype) -> None:
        self.numel, self.k, self.seed, self.acc = numel, k, seed, acc
        self.layout: Layout = ((acc, k),)

    def _chosen(self, step: int, device: torch.device) -> torch.Tensor:
        # CPU generator on both ends: a CUDA generator draws a different permutation.
        gen = generator(derive_seed(self.seed, step), torch.device("cpu"))
        return torch.randperm(self.numel, generator=gen)[: self.k].to(device)

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        # Each coordinate is kept with probability k/n: scaling by n/k makes it unbiased.
        return [x[self._chosen(step, x.device)].mul_(self.numel / self.k)]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=self.acc, device=parts[0].device)
        out[self._chosen(step, out.device)] = parts[0]
        return out


class _Sign:
    __slots__ = ("acc", "chunk", "layout", "numel")

    def __init__(self, numel: int, chunk: int, acc: torch.dtype) -> None:
        self.numel, self.chunk, self.acc = numel, chunk, acc
        self.layout: Layout = ((torch.float32, -(-numel // chunk)), (torch.uint8, -(-numel // 8)))

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        scale, bits = pack_signs(x, self.chunk)
        return [scale, bits]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        return unpack_signs(parts[0], parts[1], self.numel, self.chunk).to(self.acc)


class _PowerSGD:
    """Local rank-R power iteration per matrix; P and Q both travel, so decode is stateless."""

    __slots__ = ("acc", "layout", "numel", "plan", "q", "seed", "wire")

    def __init__(
        self, numel: int, plan: Plan, seed: int, wire: torch.dtype, acc: torch.dtype
    ) -> None:
        self.numel, self.plan, self.seed, self.wire, self.acc = numel, plan, seed, wire, acc
        #: every matrix's Q (cols x R), concatenated: the warm start of the next encode.
        self.q: torch.Tensor | None = None
        self.layout: Layout = (
            (acc, sum(r * k for _, r, _, k in plan.matrices)),
            (acc, sum(c * k for _, _, c, k in plan.matrices)),
            (wire, sum(b - a for a, b in plan.plain)),
        )

    def _p_shapes(self) -> list[tuple[int, int]]:
        return [(r, k) for _, r, _, k in self.plan.matrices]

    def _q_shapes(self) -> list[tuple[int, int]]:
        return [(c, k) for _, _, c, k in self.plan.matrices]

    def _warm_q(self, device: torch.device) -> list[torch.Tensor]:
        if self.q is None:
            gen = generator(self.seed, torch.device("cpu"))
            self.q = torch.randn(self.layout[1][1], generator=gen, dtype=self.acc)
            for view in _factor_views(self.q, self._q_shapes()):
                _orthonormalize(view)
        return _factor_views(self.q.to(device), self._q_shapes())

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        warm = self._warm_q(x.device)
        p_flat = torch.empty(self.layout[0][1], dtype=self.acc, device=x.device)
        q_flat = torch.empty(self.layout[1][1], dtype=self.acc, device=x.device)
        ps, qs = _factor_views(p_flat, self._p_shapes()), _factor_views(q_flat, self._q_shapes())
        for (o, r, c, _), q0, p, q in zip(self.plan.matrices, warm, ps, qs, strict=True):
            m = x[o : o + r * c].view(r, c)
            torch.matmul(m, q0, out=p)
            _orthonormalize(p)
            torch.matmul(m.t(), p, out=q)
        # A new tensor, never written again: a state_dict taken earlier stays valid.
        self.q = q_flat
        plain = [x[a:b] for a, b in self.plan.plain]
        rest = torch.cat(plain).to(self.wire) if plain else x.new_empty(0, dtype=self.wire)
        return [p_flat, q_flat, rest]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        p_flat, q_flat, rest = parts
        out = torch.zeros(self.numel, dtype=self.acc, device=p_flat.device)
        ps, qs = _factor_views(p_flat, self._p_shapes()), _factor_views(q_flat, self._q_shapes())
        for (o, r, c, _), p, q in zip(self.plan.matrices, ps, qs, strict=True):
            torch.mm(p, q.t(), out=out[o : o + r * c].view(r, c))
        start = 0
        for a, b in self.plan.plain:
            out[a:b] = rest[start : start + b - a]
            start += b - a
        return out


class PushCodec:
    """Encode one worker's flat gradient shard into a fixed-size payload, and decode it.

    Build with :func:`make_push_codec`. The worker calls :meth:`encode` (which also keeps the
    error-feedback residual, for the biased specs); the server calls :meth:`decode` on a codec
    built with the same arguments. ``state_dict()`` holds tensors and plain values only.
    """

    __slots__ = (
        "_format",
        "bytes_sent",
        "dtype",
        "error_feedback",
        "numel",
        "payload_numel",
        "residual",
        "spec",
    )

    payload_dtype = torch.uint8

    def __init__(
        self, spec: str, numel: int, dtype: torch.dtype, fmt: _Format, error_feedback: bool
    ) -> None:
        self.spec, self.numel, self.dtype = spec, numel, dtype
        self._format = fmt
        self.error_feedback = error_feedback
        #: what this worker has not sent yet (accumulator dtype); None before the first encode.
        self.residual: torch.Tensor | None = None
        #: payload bytes produced by encode() so far.
        self.bytes_sent = 0
        #: bytes of every payload (uint8 elements): what the server's ``irecv`` buffer holds.
        self.payload_numel = sum(torch.empty((), dtype=d).element_size() * n for d, n in fmt.layout)

    @property
    def nominal_ratio(self) -> float:
        """Payload bytes over the fp32 bytes of the shard (1.0 for an empty shard)."""
        return self.payload_numel / (4 * self.numel) if self.numel else 1.0

    def encode(self, flat: torch.Tensor, step: int) -> torch.Tensor:
        """The payload for this worker's gradient at ``step`` (1-D, ``payload_numel`` bytes)."""
        if flat.numel() != self.numel:
            raise ValueError(
                f"push codec {self.spec!r} expects {self.numel} elements, got {flat.numel()}"
            )
        # A private copy: the residual is computed in place and the caller's tensor is left alone.
        x = flat.detach().reshape(-1).to(accumulator_dtype(self.dtype), copy=True)
        if self.error_feedback and self.residual is not None:
            x.add_(self.residual.to(x.device))
        payload = (
            pack(self._format.encode(x, step)) if self.numel else x.new_empty(0, dtype=torch.uint8)
        )
        self.bytes_sent += payload.numel()
        if self.error_feedback:
            # From the bytes actually sent, so decode + residual conserves the gradient's mass.
            self.residual = x.sub_(self._decode(payload, step))
        return payload

    def decode(self, payload: torch.Tensor, step: int) -> torch.Tensor:
        """The gradient a worker encoded at ``step``: ``numel`` elements in ``dtype``."""
        if payload.dtype != torch.uint8 or payload.numel() != self.payload_numel:
            raise ValueError(
                f"push codec {self.spec!r} expects a uint8 payload of {self.payload_numel} bytes,"
                f" got {payload.dtype} x {payload.numel()}"
            )
        return self._decode(payload, step).to(self.dtype)

    def _decode(self, payload: torch.Tensor, step: int) -> torch.Tensor:
        if not self.numel:
            return torch.zeros(0, dtype=accumulator_dtype(self.dtype), device=payload.device)
        return self._format.decode(unpack(payload, self._format.layout), step)

    def state_dict(self) -> dict[str, Any]:
        q = getattr(self._format, "q", None)
        return {"spec": self.spec, "numel": self.numel, "residual": self.residual, "q": q}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["spec"] != self.spec or int(state["numel"]) != self.numel:
            raise UsageError(
                f"push codec state is for {state['spec']!r} over {state['numel']} elements, "
                f"not {self.spec!r} over {self.numel}"
            )
        residual = state["residual"]
        self.residual = None if residual is None else residual.clone()
        if isinstance(self._format, _PowerSGD):
            q = state["q"]
            if q is not None and q.numel() != self._format.layout[1][1]:
                raise UsageError(
                    f"push codec state for {self.spec!r} has {q.numel()} Q elements, "
                    f"this codec's shapes need {self._format.layout[1][1]}"
                )
            self._format.q = None if q is None else q.to(self._format.acc, copy=True)


def make_push_codec(
    spec: str | Compressor | None,
    numel: int,
    dtype: torch.dtype,
    *,
    shapes: Sequence[Sequence[int]] | None = None,
    seed: int = 0,
) -> PushCodec:
    """A codec for pushing ``numel``-element gradients of ``dtype`` with ``spec``.

    ``spec`` is anything :func:`parse_compression` accepts (a Compressor built with options,
    such as ``int8(chunk=256)`` or ``topk(0.1)`` without error feedback, keeps them).
    ``shapes`` are the parameter shapes concatenated in the shard, in order (PowerSGD
    compresses the matrix-shaped ones; without shapes the shard is one vector, sent plain).
    ``seed`` names the worker's (and shard's) random stream: give every worker a different one;
    the server builds that worker's codec with the same seed.
    Raises ``UsageError`` for a bad spec, a non-float dtype or shapes that do not add up.
    """
    compressor = parse_compression(spec)
    if numel < 0:
        raise UsageError(f"push codec numel must be >= 0, got {numel}")
    if not dtype.is_floating_point:
        raise UsageError(f"push codec dtype must be a floating-point dtype, got {dtype}")
    if numel >= 2**31:
        raise UsageError(f"push codec shards are limited to 2**31 - 1 elements, got {numel}")
    state = compressor.make_state(None)
    ef = isinstance(state, ErrorFeedbackState)
    inner = state.inner if ef else state
    acc = accumulator_dtype(dtype)
    name = compressor.spec.partition(":")[0]
    fmt: _Format
    if isinstance(inner, AllReduceState):
        fmt = _Plain(numel, dtype, acc)
    elif isinstance(inner, CastState):
        fmt = _Plain(numel, torch.bfloat16 if name == "bf16" else torch.float16, acc)
    elif isinstance(inner, Int8State):
        fmt = _Int8(numel, inner.chunk, derive_seed(inner.seed, seed), acc)
    elif isinstance(inner, TopKState):
        fmt = _TopK(numel, kept(inner.fraction, numel), dtype, acc)
    elif isinstance(inner, RandomKState):
        fmt = _RandomK(numel, kept(inner.fraction, numel), derive_seed(inner.seed, seed), acc)
    elif isinstance(inner, SignState):
        fmt = _Sign(numel, inner.chunk, acc)
    elif isinstance(inner, PowerSGDState):
        layout = _shapes(compressor.spec, numel, shapes)
        plan = plan_shapes(layout, inner.matrix_rank, inner.min_compression_rate)
        fmt = _PowerSGD(numel, plan, derive_seed(inner.seed, seed), dtype, acc)
    else:
        raise UsageError(
            f"compression {compressor.spec!r} has no push codec (its state is "
            f"{type(inner).__name__}); valid forms: {VALID_FORMS}"
        )
    return PushCodec(compressor.spec, numel, dtype, fmt, ef)


def _shapes(spec: str, numel: int, shapes: Sequence[Sequence[int]] | None) -> list[list[int]]:
    if shapes is None:
        return [[numel]]
    out = [[int(d) for d in s] for s in shapes]
    total = sum(math.prod(s) for s in out)
    if total != numel:
        raise UsageError(
            f"push codec {spec!r}: shapes {out} hold {total} elements, not the shard's {numel}"
        )
    return out


__all__ = ["PushCodec", "make_push_codec"]
