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

The encoding itself is the compressor family's codec (``Compressor.codec``, defined in the
family's module next to its hook, the same encoding the hook puts on the wire); this module only
frames it: checks, packing the codec's pieces into one uint8 payload, error feedback and state.
A compressor without a codec (a hook-only custom one) is refused with a ``UsageError``.

The payload length depends only on ``(spec, numel, dtype, shapes)``, so the server can post the
``irecv`` before anything arrives. Error feedback lives on the worker: the residual (corrected
gradient minus the decoded payload, i.e. what was actually sent) is added to the next gradient,
so over T steps ``sum(decode(payload_t)) + residual == sum(gradients)``. Decoding needs no state
from previous steps: the server keeps one codec per worker only because randomk's indices come
from the worker's seed.

Wire format (``_wire.to_payload`` of the pieces, in this order; ``n`` = numel, ``d`` = the gradient
dtype, ``c`` = int8's chunk, 1024 by default, ``s`` = sign's chunk, 64 by default; 4-byte pieces
first so they stay aligned):

==============  ==============================================================  =============
spec            pieces                                                          fp32 ratio
==============  ==============================================================  =============
``none``        ``n`` values in ``d``                                           1
``fp16/bf16``   ``n`` values in fp16 / bf16                                     0.5
``int8``        ``ceil(n/c)`` fp32 scales, ``n`` int8 codes (stochastic)        ~0.251
``topk:F``      ``k`` int32 indices, ``k`` values in ``d``                      2F
``randomk:F``   ``k`` fp32 values, scaled by stratum size; no indices           F
``sign``        ``ceil(n/s)`` fp32 scales ``mean|x|``, ``ceil(n/8)`` sign bytes  ~0.047
``powersgd:R``  every matrix's P (rows x R) then Q (cols x R) in fp32, then     shapes
                the uncompressed elements (vectors, small matrices) in ``d``
==============  ==============================================================  =============

``k = ceil(F * n)`` (at least 1). randomk sends no indices: both ends compute them from
``(seed, step)`` (one position per stratum, ``fused.strata``), which halves the payload (4k bytes
instead of 8k) for O(k) integer arithmetic on each side; the server knows the step because a
worker's pushes arrive in order, and the arithmetic gives the same positions on any device.
PowerSGD computes P and Q locally (one power iteration, warm-started from the previous Q) and
sends both, so the decode ``P Q^T`` needs no server state. Unlike the all-reduce hook it has no
``start_iter`` phase of plain steps: those would change the payload size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from gradsync.compression._wire import accumulator_dtype, from_payload, to_payload
from gradsync.compression.base import Codec, Compressor
from gradsync.compression.spec import VALID_FORMS, parse_compression
from gradsync.errors import UsageError


class PushCodec:
    """Encode one worker's flat gradient shard into a fixed-size payload, and decode it.

    Build with :func:`make_push_codec`. The worker calls :meth:`encode` (which also keeps the
    error-feedback residual, for the biased specs); the server calls :meth:`decode` on a codec
    built with the same arguments. ``state_dict()`` holds tensors and plain values only.
    """

    __slots__ = (
        "_codec",
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
        self, spec: str, numel: int, dtype: torch.dtype, codec: Codec, error_feedback: bool
    ) -> None:
        self.spec, self.numel, self.dtype = spec, numel, dtype
        self._codec = codec
        self.error_feedback = error_feedback
        #: what this worker has not sent yet (accumulator dtype); None before the first encode.
        self.residual: torch.Tensor | None = None
        #: payload bytes produced by encode() so far.
        self.bytes_sent = 0
        #: bytes of every payload (uint8 elements): what the server's ``irecv`` buffer holds.
        self.payload_numel = sum(
            torch.empty((), dtype=d).element_size() * n for d, n in codec.layout
        )

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
            to_payload(self._codec.encode(x, step))
            if self.numel
            else x.new_empty(0, dtype=torch.uint8)
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
        return self._codec.decode(from_payload(payload, self._codec.layout), step)

    def state_dict(self) -> dict[str, Any]:
        """The residual, plus whatever the codec carries between encodes (PowerSGD: ``q``)."""
        state = {"spec": self.spec, "numel": self.numel, "residual": self.residual}
        state.update(self._codec.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["spec"] != self.spec or int(state["numel"]) != self.numel:
            raise UsageError(
                f"push codec state is for {state['spec']!r} over {state['numel']} elements, "
                f"not {self.spec!r} over {self.numel}"
            )
        residual = state["residual"]
        self.residual = None if residual is None else residual.clone()
        try:
            self._codec.load_state_dict(state)
        except UsageError as err:
            raise UsageError(f"push codec state for {self.spec!r}: {err}") from None


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
    if compressor.codec is None:
        raise UsageError(
            f"compression {compressor.spec!r} has no codec (its Compressor was built without "
            "codec=...), so it cannot compress parameter-server pushes; give it a codec "
            f"factory, or use one of the built-in forms: {VALID_FORMS}"
        )
    codec = compressor.codec(numel, dtype, _shapes(compressor.spec, numel, shapes), seed)
    return PushCodec(compressor.spec, numel, dtype, codec, compressor.feedback)


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
