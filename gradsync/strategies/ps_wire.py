"""The wire protocol that parameter-server workers and servers share.

Both roles build the same ``ShardPlan`` from the same model, optimizer and compressor (every
rank has them), so each knows, without asking the other, which parameters every server holds,
in what order, and what every message looks like. Neither role reads the other's state.

Sharding: whole parameter tensors, by size (largest first, onto the least loaded server), so
there may be no more servers than trainable parameter tensors.

Messages: every message a worker sends a server is one tensor: a header, then a payload of a
fixed size (``ShardPlan.wire``). The header is 8 bytes whose first element is the kind, then
the worker's current lr of each of the optimizer's G param groups as float64 (8 bytes each,
whatever the message's dtype); the payload is the shard's gradient in the parameters' dtype,
or with compression the push codec's bytes (the message is then uint8, and the header keeps
the payload 8-byte aligned for the codec's views). Kinds: ``GRADIENT`` (the payload is the
gradient; the server replies with parameters), ``CHECKPOINT`` (no payload, no reply: this
worker is inside ``sync.save()`` after its N-th push; the header alone is sent, see
``ShardPlan.control``; after the header, two int64: 1 when the worker's save waits for the
files, so the server writes its part at once, and rank 0's number for the directory,
``CheckpointHooks.handed_over``), ``FLUSH`` (no reply: the worker waits for its
checkpoints to be written, so the server writes the newest snapshot it holds, see
``gradsync.checkpoint.held_slots``), ``SKIPPED`` (no payload: this step's
gradient was not finite, so the worker pushes nothing; the server counts the push, applies
nothing and replies with parameters) or ``DONE`` (the worker finished; the
server replies with the final parameters once every worker is done). ``SAVED`` added to the
kind of a push, a skipped push or ``DONE`` is a checkpoint request as well, made after the
worker's previous push: the server snapshots before it applies the message. A reply is one
tensor in the parameters' dtype: the seconds the staleness bound held it (0 when the bound
allowed it at once, always under ``async``), then the shard's parameters.

Posting and waiting: ``post`` and ``wait`` turn a failed or late point-to-point operation into
a ``SyncTimeoutError`` naming the peer (gloo raises at posting time, not only at wait, when
the peer's connection is already closed because it died).
"""

from __future__ import annotations

import datetime
import math
from typing import Any

import torch
import torch.distributed as dist

from gradsync.compression._wire import derive_seed
from gradsync.compression.push import PushCodec, make_push_codec
from gradsync.errors import SyncTimeoutError, UsageError
from gradsync.strategies.base import SyncContext

# Message kinds (element 0 of every worker -> server message).
GRADIENT, DONE, CHECKPOINT, SKIPPED, FLUSH = 0.0, 1.0, 2.0, 3.0, 4.0
#: added to the kind of a push, a skipped push or ``DONE``: the worker saved after its previous
#: push, and asks for a checkpoint with this message instead of a ``CHECKPOINT`` of its own
SAVED = 8.0
_KIND_BYTES = 8  # the header's first part: the kind, then padding to 8 bytes
_LR_BYTES = 8  # then one float64 per param group: the worker's current lr
#: a control message's int64 words after the header, at most (``ShardPlan.control``)
CONTROL_WORDS = 2


def _write_header(header: torch.Tensor, kind: float, lrs: torch.Tensor) -> None:
    """Fill a message's header: the kind, then the worker's lr per param group (float64)."""
    header[0] = kind
    header.view(torch.uint8)[_KIND_BYTES:] = lrs.view(torch.uint8)


def shard_by_size(sizes: list[int], servers: int) -> list[list[int]]:
    """Parameter indices per server, balancing numel (largest first to the least loaded)."""
    load = [0] * servers
    shards: list[list[int]] = [[] for _ in range(servers)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(servers), key=lambda j: (load[j], j))
        shards[s].append(i)
        load[s] += sizes[i]
    return [sorted(s) for s in shards]


class ShardPlan:
    """Who holds what, and the shape of every message: the same on every rank."""

    def __init__(self, ctx: SyncContext, servers: int, timeout_s: float) -> None:
        self.group = ctx.group
        self.compressor = ctx.compressor
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.workers = ctx.layout.workers
        self.servers = servers
        self.params = [p for p in ctx.model.parameters() if p.requires_grad]
        if servers > len(self.params):
            raise UsageError(
                f"{servers} parameter servers for a model with {len(self.params)} "
                f"trainable parameter tensor(s): each server needs at least one; use at most "
                f"{len(self.params)} server(s)"
            )
        self.shards = shard_by_size([p.numel() for p in self.params], servers)
        groups = ctx.optimizer.param_groups
        self.groups = len(groups)  # param groups of the user's optimizer, fixed at setup
        where = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
        self._group_of = [where.get(id(p), -1) for p in self.params]  # -1: in no group

    # -- ranks ----------------------------------------------------------------------------------
    def server_rank(self, s: int) -> int:
        """The group rank of server ``s`` (the servers are the last ranks)."""
        return self.workers + s

    def global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # -- shards ---------------------------------------------------------------------------------
    def shard_params(self, s: int) -> list[torch.Tensor]:
        return [self.params[i] for i in self.shards[s]]

    def shard_numel(self, s: int) -> int:
        return sum(p.numel() for p in self.shard_params(s))

    def param_dtype(self, s: int) -> torch.dtype:
        shard = self.shards[s]
        return self.params[shard[0]].dtype if shard else torch.float32

    def group_of(self, s: int) -> list[int]:
        """The user's param group of each parameter of server ``s``'s shard (-1: none)."""
        return [self._group_of[i] for i in self.shards[s]]

    # -- messages -------------------------------------------------------------------------------
    @property
    def compressed(self) -> bool:
        return self.compressor.spec != "none"

    def codec(self, s: int, worker: int) -> PushCodec:
        """The codec for ``worker``'s pushes to server ``s``; the server builds the same one
        (same seed) to decode them, which is all randomk needs to draw the same indices."""
        return make_push_codec(
            self.compressor,
            self.shard_numel(s),
            self.param_dtype(s),
            shapes=[tuple(p.shape) for p in self.shard_params(s)],
            seed=derive_seed(worker, s),
        )

    def wire(self, s: int) -> tuple[torch.dtype, int, int]:
        """``(dtype, header, payload)`` of every message to server ``s``, in elements of dtype.
        Uncompressed, the payload is the gradient in the parameters' dtype; compressed, it is
        the codec's bytes (every worker's codec has the same size)."""
        if not self.compressed:
            dtype, payload = self.param_dtype(s), self.shard_numel(s)
        else:
            codec = self.codec(s, 0)
            dtype, payload = codec.payload_dtype, codec.payload_numel
        header_bytes = _KIND_BYTES + _LR_BYTES * self.groups
        itemsize = torch.empty(0, dtype=dtype).element_size()
        assert header_bytes % itemsize == 0, dtype
        return dtype, header_bytes // itemsize, payload

    def receive_numel(self, s: int) -> int:
        """The elements a server receives every message into: a push, or a control message
        where that is longer (a model of a few parameters)."""
        dtype, header, payload = self.wire(s)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return header + max(payload, CONTROL_WORDS * 8 // itemsize)

    def message(
        self, s: int, kind: float, lrs: torch.Tensor, payload: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A message of ``kind`` to server ``s``: the header (the kind and the worker's ``lrs``,
        one float64 per param group), then ``payload`` (zeros when None: a receive is posted
        for a push's size before the server knows what comes)."""
        dtype, header, size = self.wire(s)
        msg = torch.zeros(header + size, dtype=dtype)
        _write_header(msg[:header], kind, lrs)
        if payload is not None:
            msg[header:] = payload
        return msg

    def control(
        self, s: int, kind: float, lrs: torch.Tensor, words: tuple[int, ...] = ()
    ) -> torch.Tensor:
        """A payload-less message of ``kind`` to server ``s``: the header, then ``words`` as
        int64 (at most ``CONTROL_WORDS``). The server receives every message into a buffer of
        a push's size (it cannot know what comes; ``receive_numel``); gloo delivers a shorter
        message into a longer receive and leaves the rest of the buffer alone, which the
        server never reads for these kinds. A whole push's size of zeros was sent before:
        483 KB on charlm, about 0.3 ms of the worker's step for a checkpoint request every
        step (``test_ps_wire.py`` checks that gloo still does so)."""
        if len(words) > CONTROL_WORDS:
            raise ValueError(f"a control message carries at most {CONTROL_WORDS} words")
        dtype, header, _ = self.wire(s)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        msg = torch.zeros(header + len(words) * 8 // itemsize, dtype=dtype)
        _write_header(msg[:header], kind, lrs)
        if words:
            msg[header:].view(torch.int64)[:] = torch.tensor(words, dtype=torch.int64)
        return msg

    def read_words(self, s: int, message: torch.Tensor, count: int) -> list[int]:
        """The first ``count`` int64 words after the header of a control message to server
        ``s`` (``control``)."""
        _, header, _ = self.wire(s)
        itemsize = message.element_size()
        return message[header : header + count * 8 // itemsize].view(torch.int64).tolist()

    def read_lrs(self, message: torch.Tensor) -> list[float]:
        """The sending worker's lr per param group, from a message's header."""
        start, stop = _KIND_BYTES, _KIND_BYTES + _LR_BYTES * self.groups
        raw = message.view(torch.uint8)[start:stop].clone()
        return raw.view(torch.float64).tolist()

    def reply_numel(self, s: int) -> int:
        return 1 + self.shard_numel(s)

    # -- point-to-point -------------------------------------------------------------------------
    def post(self, op: str, tensor: torch.Tensor, peer: int, what: str) -> Any:
        """``isend`` (``op="send"``) or ``irecv`` of ``tensor`` with group rank ``peer``; a
        failure at posting time becomes a ``SyncTimeoutError`` about ``what``."""
        try:
            if op == "send":
                return dist.isend(tensor, dst=self.global_rank(peer), group=self.group)
            return dist.irecv(tensor, src=self.global_rank(peer), group=self.group)
        except RuntimeError as exc:
            raise SyncTimeoutError(f"{what} failed: {str(exc).splitlines()[0]}") from exc

    def wait(self, work: Any, what: str) -> None:
        """Wait for a posted operation, at most the timeout; failures name ``what``."""
        try:
            ok = work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise SyncTimeoutError(
                f"waiting for {what} failed: {str(exc).splitlines()[0]}"
            ) from exc
        if ok is False:
            raise SyncTimeoutError(
                f"{what} did not arrive within {self.timeout.total_seconds():.0f}s"
            )


def current_lrs(optimizer: torch.optim.Optimizer, groups: int) -> torch.Tensor:
    """The lr of each of the optimizer's param groups now (NaN where a group has none): what a
    scheduler on the workers set, for the server to apply."""
    found = optimizer.param_groups
    if len(found) != groups:
        raise UsageError(
            f"the optimizer has {len(found)} param groups, but had {groups} when the "
            "Synchronizer was built: the parameter servers cannot follow groups added later"
        )
    return torch.tensor([float(g.get("lr", math.nan)) for g in found], dtype=torch.float64)


__all__ = [
    "CHECKPOINT",
    "CONTROL_WORDS",
    "DONE",
    "FLUSH",
    "GRADIENT",
    "SAVED",
    "SKIPPED",
    "ShardPlan",
    "current_lrs",
    "shard_by_size",
]
