"""Error feedback as a wrapper: what a compressor did not send is added to the next gradient.

``error_feedback(compressor)`` returns a compressor whose hook, per bucket index,

1. adds the stored residual into the bucket buffer (``g + e``),
2. runs the inner hook, which, because the wrapper set ``inner_state.sent = {}``, records this
   rank's *decoded* contribution (the part of the mean that came from this rank), and
3. when the exchange completes, keeps ``e = (g + e) - contribution``.

The residual is therefore computed from what was actually sent, never from a re-compression,
and mass is conserved: over T steps, ``sum(contributions) + e_T == sum(g)`` (to float rounding).

The wrapping protocol is one attribute: an inner state that supports error feedback has
``sent: dict[int, Tensor] | None`` (None = do not record) and its hook fills ``sent[index]``
before its future completes, with the contribution as a tensor or as a ``base.Contribution``
that subtracts itself from the corrected gradient in place. Every lossy gradsync compressor
does; the plain all-reduce has no error to feed back. Residuals live in
``state_dict()["residuals"]`` keyed by bucket index (tensors only), so a resumed run continues
exactly. If a bucket index's size changes (DDP's bucket rebuild after its first step), that
index's residual is dropped rather than misapplied. The hook reuses a residual's memory for the
next corrected gradient of its bucket (no bucket-sized allocation per step), so a tensor from
``state_dict()`` is live, as an optimizer's state is: copy it to keep it past the next exchange
(checkpoint snapshots do); ``load_state_dict`` copies the tensors it is given.

The wrapped compressor keeps the inner codec and sets ``Compressor.feedback``: a
parameter-server push (``gradsync.compression.push.PushCodec``) then keeps the same kind of
residual on the worker, computed from the same codec's decode of what it sent.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from gradsync import exit_safety
from gradsync.compression._wire import accumulator_dtype, blocks
from gradsync.compression.base import BucketLike, Compressor, Group, Hook


class ErrorFeedbackState:
    """The inner compressor's state plus one residual per bucket index."""

    __slots__ = ("inner", "residuals")

    def __init__(self, inner: Any) -> None:
        if not hasattr(inner, "sent"):
            raise TypeError(
                f"{type(inner).__name__} does not record what it sent (no 'sent' attribute); "
                "error feedback needs the compressor's decoded contribution"
            )
        inner.sent = {}
        self.inner = inner
        self.residuals: dict[int, torch.Tensor] = {}

    @property
    def group(self) -> Group:
        group: Group = self.inner.group
        return group

    @group.setter
    def group(self, value: Group) -> None:
        self.inner.group = value

    @property
    def bytes_sent(self) -> int:
        return int(self.inner.bytes_sent)

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:
        self.inner.bytes_sent = value

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        # Copies: the hook reuses a residual's memory for the next corrected gradient, which
        # must not write into the caller's tensors.
        self.residuals = {int(k): v.clone() for k, v in state["residuals"].items()}


def error_feedback_hook(
    inner_hook: Hook, state: ErrorFeedbackState, bucket: BucketLike
) -> torch.futures.Future[torch.Tensor]:
    """Bind ``inner_hook`` with ``functools.partial`` to get a ``hook(state, bucket)``."""
    buf, index = bucket.buffer(), bucket.index()
    residual = state.residuals.pop(index, None)
    if residual is not None and residual.numel() != buf.numel():
        residual = None
    # The inner hook may overwrite the buffer with the mean; keep the corrected input.
    if residual is not None and _reusable(residual, buf):
        corrected = _add_and_keep(buf.view(-1), residual.view(-1)).view_as(buf)
    else:
        if residual is not None:
            buf.add_(residual.to(device=buf.device, dtype=buf.dtype).view_as(buf))
        corrected = buf.to(accumulator_dtype(buf.dtype), copy=True)
    fut = inner_hook(state.inner, bucket)

    def keep_residual(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        value = done.value()
        sent = state.inner.sent.pop(index)
        if isinstance(sent, torch.Tensor):
            residual = corrected.sub_(sent.view_as(corrected).to(corrected.dtype))
        else:
            residual = sent.subtract_from(corrected)
        state.residuals[index] = residual
        return value

    return exit_safety.then(fut, keep_residual)


def _reusable(residual: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``residual`` can hold the corrected gradient in place: the same device and
    dtype as the buffer (the accumulator dtype already, so no cast is lost), both contiguous."""
    return (
        residual.dtype == buf.dtype == accumulator_dtype(buf.dtype)
        and residual.device == buf.device
        and residual.is_contiguous()
        and buf.is_contiguous()
    )


def _add_and_keep(buf: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``buf += residual``, then ``residual[:] = buf``, a block at a time so the copy reads the
    sum while it is still in cache; returns ``residual``, now the corrected gradient. The last
    residual's memory is reused: no bucket-sized allocation, whose page faults cost more than
    the copy on a CPU (same values as adding and then copying into a new tensor)."""
    for start, stop in blocks(buf.numel(), device=buf.device):
        part = buf[start:stop].add_(residual[start:stop])
        residual[start:stop].copy_(part)
    return residual


def _make_state(make_inner: Any, group: Group) -> ErrorFeedbackState:
    return ErrorFeedbackState(make_inner(group))


def error_feedback(compressor: Compressor) -> Compressor:
    """Wrap a compressor so its residual is added to the next gradient of the same bucket.

    Raises ``TypeError`` when the compressor's state does not record what it sent. Same spec,
    nominal ratio and codec: error feedback changes no bytes on the wire.
    """
    return Compressor(
        spec=compressor.spec,
        make_state=functools.partial(_make_state, compressor.make_state),
        hook=functools.partial(error_feedback_hook, compressor.hook),
        nominal_ratio=compressor.nominal_ratio,
        codec=compressor.codec,
        feedback=True,
    )
