"""Parameter server: stale-synchronous (``ssp:S``) and asynchronous (``async``) training.

Layout: with K servers, the **last K ranks** are servers and ranks ``0..W-1`` are workers, so
rank 0 is always a worker (it writes the run's files). Parameters are sharded across servers
by size, whole tensors (largest first, onto the least loaded server), so there may be no more
servers than trainable parameter tensors.

A worker's step at clock c: compute a gradient, push each server its shard, and wait for the
server's reply, which carries the parameters to compute clock c+1 with. Under ``ssp:S`` a
server holds that reply until every worker's updates from clocks up to ``c+1 - S - 1`` have
been applied (the time held is the worker's ``idle``); under ``async`` it replies at once.

Update rule: each push is one ``step()`` of the user's optimizer class on the server, with each
param group's hyper-parameters (every parameter keeps its group; parameters in no group are
never updated, as with the optimizer itself) and its state (momentum, Adam moments) living on
the server. The gradient is divided by W first, and the push carries the worker's current lr
of every group, which the server uses for that step, so LR schedulers stepped on the workers
take effect. With plain SGD the W pushes of a round then add up to one BSP step, and ``ssp:0``
follows BSP's trajectory. With momentum the steady-state step per round is BSP's too, but the
buffer decays once per push, i.e. over W times fewer rounds. Adaptive optimizers (Adam, AdamW,
Adagrad, RMSprop) normalise the 1/W away: every push moves the parameters about as far as a
BSP step, so a round of W pushes moves about W times as far (measured: 4 pushes of g/4 under
AdamW, 4x one BSP step). That is asynchronous SGD's usual semantics (each push is an update,
as in Downpour SGD); it is kept because the design has the server apply the user's optimizer
with the user's hyper-parameters, and the user knows whether to divide an adaptive lr by W.

Transport: point-to-point ``isend``/``irecv`` of torch.distributed on the job's gloo (or NCCL)
group; a server waits for each worker in its own thread, so one slow worker never delays
another's reply. ``benchmarks/ps_transport.py`` times a push/pull round trip of S bytes against
an all-reduce of the same S bytes, and ``torch.distributed.rpc`` (TensorPipe) sending the same
tensor, 4 KiB to 16 MiB (BENCHMARKS.md, section "Parameter-server transport"). What it showed
on 2-core loopback (the figures in BENCHMARKS.md are from ``make bench``): with one worker,
from 1 MiB up a push/pull costs about what the all-reduce costs (0.75x to 1.04x; each moves S
bytes each way over one link); with two workers sharing one server it costs more (1.4x to 2.5x),
because the server's link carries every worker's push and pull while the all-reduce's per-rank
traffic does not grow with the workers: that is the price of decoupling the workers, which is
what ssp and async buy (add servers with ``--servers`` to split it). Below 1 MiB every method
is latency-bound and the ranking varied between runs. From 1 MiB up rpc was within about
1.5x of point-to-point either way (faster at some sizes, slower at others, and the ranking
changed between runs); below that it was slower (3.7x at 4 KiB with one worker). rpc would
also need a second rendezvous, its own agent threads and timeouts, and it serialises each call.
Point-to-point reuses the process group (and its timeouts) the job already has, moves tensors
as they are, and works on NCCL too: hence the choice.

Messages: every message a worker sends a server is one tensor: a header, then a payload of a
fixed size (``ParameterServer.wire``). The header is 8 bytes whose first element is the kind,
then the worker's current lr of each of the optimizer's G param groups as float64 (8 bytes
each, whatever the message's dtype); the payload is the shard's gradient in the parameters'
dtype, or with compression the push codec's bytes (the message is then uint8, and the header
keeps the payload 8-byte aligned for the codec's views). Kinds: ``_GRADIENT`` (the payload is
the gradient; the server replies with parameters), ``_CHECKPOINT`` (no payload, no reply: this
worker is inside ``sync.save()`` after its N-th push) or ``_DONE`` (the worker finished; the
server replies with the final parameters once every worker is done; see ``ps_server`` for the
order of the shutdown). Checkpoints: a server snapshots its state once
it holds every unfinished worker's ``_CHECKPOINT``; each request follows that worker's N-th push
on the same ordered channel, so the server has then applied exactly N pushes of each. See
``gradsync.fault.resume`` for the rest of the protocol.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync.compression._wire import derive_seed
from gradsync.compression.push import PushCodec, make_push_codec
from gradsync.errors import SyncTimeoutError, UsageError
from gradsync.strategies.base import StepOutcome, SyncContext

# Message kinds (element 0 of every worker -> server message).
_GRADIENT, _DONE, _CHECKPOINT = 0.0, 1.0, 2.0
_KIND_BYTES = 8  # the header's first part: the kind, then padding to 8 bytes
_LR_BYTES = 8  # then one float64 per param group: the worker's current lr


def shard_by_size(sizes: list[int], servers: int) -> list[list[int]]:
    """Parameter indices per server, balancing numel (largest first to the least loaded)."""
    load = [0] * servers
    shards: list[list[int]] = [[] for _ in range(servers)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(servers), key=lambda j: (load[j], j))
        shards[s].append(i)
        load[s] += sizes[i]
    return [sorted(s) for s in shards]


@dataclass(slots=True)
class AppliedUpdate:
    """One gradient the server applied: worker, its clock c, and k, the largest clock through
    which every worker's updates were in the parameters that gradient was computed from."""

    worker: int
    clock: int
    fresh_through: int

    @property
    def staleness(self) -> int:
        return self.clock - 1 - self.fresh_through


@dataclass(slots=True)
class ServerStats:
    """What one server did. ``updates`` and ``held_seconds`` cover this process only;
    ``clocks`` (pushes applied per worker) and ``checkpoints`` continue across a resume, and
    ``resumed_at`` is the step of the checkpoint this server started from (0: none)."""

    server_rank: int
    updates: list[AppliedUpdate] = field(default_factory=list)
    held_seconds: float = 0.0
    clocks: list[int] = field(default_factory=list)
    resumed_at: int = 0
    checkpoints: list[int] = field(default_factory=list)

    @property
    def max_staleness(self) -> int:
        return max((u.staleness for u in self.updates), default=0)


class ParameterServer:
    """Strategy object for both roles; ``is_server`` says which this rank plays."""

    barrier_free = True

    def __init__(self, staleness: float, servers: int = 1, timeout_s: float = 300.0) -> None:
        if not (staleness >= 0):
            raise UsageError(f"staleness bound S must be >= 0 or inf, got {staleness}")
        if not isinstance(servers, int) or servers < 1:
            raise UsageError(f"servers must be an integer >= 1, got {servers!r}")
        self.staleness = staleness
        self.servers = servers
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.name = "async" if math.isinf(staleness) else f"ssp:{int(staleness)}"
        self._ctx: SyncContext | None = None
        self._params: list[torch.Tensor] = []
        self._shards: list[list[int]] = []
        self._groups = 0  # param groups of the user's optimizer, fixed at setup
        self._group_of: list[int] = []  # each parameter's group (-1: in none)
        self._micro_batches = 1
        self._finished = False
        self._restored: dict[str, Any] | None = None  # a server's checkpointed state, for serve()
        self._codecs: list[PushCodec] = []

    # -- layout -------------------------------------------------------------------------------
    def setup(self, ctx: SyncContext) -> None:
        self._ctx = ctx
        self.world = dist.get_world_size(ctx.group)
        self.rank = dist.get_rank(ctx.group)
        self.num_workers = self.world - self.servers
        if self.num_workers < 1:
            raise UsageError(
                f"{self.servers} server(s) leave no worker in a group of {self.world} ranks; "
                "launch at least servers + 1 processes"
            )
        self._params = [p for p in ctx.model.parameters() if p.requires_grad]
        if self.servers > len(self._params):
            raise UsageError(
                f"{self.servers} parameter servers for a model with {len(self._params)} "
                f"trainable parameter tensor(s): each server needs at least one; use at most "
                f"{len(self._params)} server(s)"
            )
        self._shards = shard_by_size([p.numel() for p in self._params], self.servers)
        groups = ctx.optimizer.param_groups
        self._groups = len(groups)
        where = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
        self._group_of = [where.get(id(p), -1) for p in self._params]
        # Worker side: one codec per shard, holding its error-feedback residual.
        if self.compressed and not self.is_server:
            self._codecs = [self.codec(s, self.rank) for s in range(self.servers)]

    @property
    def is_server(self) -> bool:
        return self.rank >= self.num_workers

    def server_rank(self, s: int) -> int:
        return self.num_workers + s

    def _global(self, rank: int) -> int:
        assert self._ctx is not None
        group = self._ctx.group
        return rank if group is None else dist.get_global_rank(group, rank)

    def _shard_numel(self, s: int) -> int:
        return sum(self._params[i].numel() for i in self._shards[s])

    @property
    def compressed(self) -> bool:
        assert self._ctx is not None
        return self._ctx.compressor.spec != "none"

    def codec(self, s: int, worker: int) -> PushCodec:
        """The codec for ``worker``'s pushes to server ``s``; the server builds the same one
        (same seed) to decode them, which is all randomk needs to draw the same indices."""
        assert self._ctx is not None
        return make_push_codec(
            self._ctx.compressor,
            self._shard_numel(s),
            self._param_dtype(s),
            shapes=[tuple(self._params[i].shape) for i in self._shards[s]],
            seed=derive_seed(worker, s),
        )

    def _param_dtype(self, s: int) -> torch.dtype:
        shard = self._shards[s]
        return self._params[shard[0]].dtype if shard else torch.float32

    def wire(self, s: int) -> tuple[torch.dtype, int, int]:
        """``(dtype, header, payload)`` of every message to server ``s``, in elements of dtype
        (see the module docstring). Uncompressed, the payload is the gradient in the
        parameters' dtype; compressed, it is the codec's bytes."""
        if not self.compressed:
            dtype, payload = self._param_dtype(s), self._shard_numel(s)
        else:
            codec = self._codecs[s] if self._codecs else self.codec(s, 0)
            dtype, payload = codec.payload_dtype, codec.payload_numel
        header_bytes = _KIND_BYTES + _LR_BYTES * self._groups
        itemsize = torch.empty(0, dtype=dtype).element_size()
        assert header_bytes % itemsize == 0, dtype
        return dtype, header_bytes // itemsize, payload

    @property
    def layout(self) -> dict[str, int]:
        """Workers and servers: a checkpoint resumes only onto the same layout."""
        return {"workers": self.num_workers, "servers": self.servers}

    def _message(self, s: int, kind: float, payload: torch.Tensor | None = None) -> torch.Tensor:
        """A message of ``kind`` to server ``s``: the header (the kind and this worker's lr of
        every param group), then ``payload`` (zeros when None: a receive is posted for a push's
        size before the server knows what comes)."""
        dtype, header, size = self.wire(s)
        msg = torch.zeros(header + size, dtype=dtype)
        msg[0] = kind
        msg[:header].view(torch.uint8)[_KIND_BYTES:] = self._current_lrs().view(torch.uint8)
        if payload is not None:
            msg[header:] = payload
        return msg

    def _current_lrs(self) -> torch.Tensor:
        """The lr of each of the optimizer's param groups now (NaN where a group has none):
        what a scheduler on the workers set, for the server to apply."""
        assert self._ctx is not None
        groups = self._ctx.optimizer.param_groups
        if len(groups) != self._groups:
            raise UsageError(
                f"the optimizer has {len(groups)} param groups, but had {self._groups} when the "
                "Synchronizer was built: the parameter servers cannot follow groups added later"
            )
        return torch.tensor([float(g.get("lr", math.nan)) for g in groups], dtype=torch.float64)

    def read_lrs(self, message: torch.Tensor) -> list[float]:
        """Server side: the worker's lr per param group, from a message's header."""
        start, stop = _KIND_BYTES, _KIND_BYTES + _LR_BYTES * self._groups
        raw = message.view(torch.uint8)[start:stop].clone()
        return raw.view(torch.float64).tolist()

    def group_of(self, s: int) -> list[int]:
        """The user's param group of each parameter of server ``s``'s shard (-1: none)."""
        return [self._group_of[i] for i in self._shards[s]]

    def _control(self, kind: float) -> list[torch.Tensor]:
        """A payload-less message of ``kind`` for every server."""
        return [self._message(s, kind) for s in range(self.servers)]

    # -- worker side ----------------------------------------------------------------------------
    def begin_step(self, step: int, micro_batches: int) -> None:
        assert self._ctx is not None
        if self.is_server:
            raise UsageError("this rank is a parameter server: call sync.serve(), not sync.step()")
        if self._finished:
            raise UsageError("training already finished (report() ended it): no more steps")
        self._ctx.optimizer.zero_grad(set_to_none=True)
        self._micro_batches = micro_batches

    def finish_step(self, step: int) -> StepOutcome:
        pushes = []
        for s, shard in enumerate(self._shards):
            grads = [self._params[i].grad for i in shard]
            flat = torch.cat(
                [
                    torch.zeros(self._params[i].numel(), dtype=self._params[i].dtype)
                    if g is None
                    else g.detach().reshape(-1) / self._micro_batches
                    for i, g in zip(shard, grads, strict=True)
                ]
            )
            # The server decodes with its count of this worker's pushes, which equals this
            # step: one push per step, and both sides resume from the same checkpoint.
            payload = self._codecs[s].encode(flat, step) if self.compressed else flat
            pushes.append(self._message(s, _GRADIENT, payload))
        held = self._exchange(pushes, step)
        # The optimizer steps on the servers. Record that it ran, as torch's wrapper of
        # optimizer.step() does, so an LR scheduler stepped here does not warn that it never did.
        assert self._ctx is not None
        self._ctx.optimizer._opt_called = True  # type: ignore[attr-defined]
        nbytes = sum(p.numel() * p.element_size() for p in pushes)
        return StepOutcome(bytes_sent=nbytes, barrier=False, idle=held)

    def _exchange(self, pushes: list[torch.Tensor], step: int | str, sent: str = "push") -> float:
        """Send one message to every server and install the parameters they send back."""
        # Replies always carry parameters (in their dtype), whatever the pushes were encoded as.
        replies = [
            torch.empty(1 + self._shard_numel(s), dtype=self._param_dtype(s))
            for s in range(len(pushes))
        ]
        for what, work in self._post(pushes, replies, step, sent):
            self._wait(work, what)
        held = 0.0
        with torch.no_grad():
            for s, reply in enumerate(replies):
                held = max(held, float(reply[0]))
                self._install(s, reply[1:])
        return held

    def _post(
        self,
        msgs: list[torch.Tensor],
        replies: list[torch.Tensor] | None,
        step: int | str,
        sent: str,
    ) -> list[tuple[str, Any]]:
        """Post a send of ``msgs[s]`` to server s (and a receive of ``replies[s]``); returns
        each posted operation with what to call it when it fails (``sent``: what the send is)."""
        works = []
        for s, msg in enumerate(msgs):
            dst = self._global(self.server_rank(s))
            # gloo raises at posting time, not only at wait, when the server's connection is
            # already closed (it died): both must name the server.
            server = f"parameter server rank {self.server_rank(s)} at step {step}"
            try:
                works.append(
                    (f"the {sent} to {server}", dist.isend(msg, dst=dst, group=self._group))
                )
                if replies is not None:
                    recv = dist.irecv(replies[s], src=dst, group=self._group)
                    works.append((f"the reply of {server}", recv))
            except RuntimeError as exc:
                raise SyncTimeoutError(
                    f"sending to {server} failed: {str(exc).splitlines()[0]}"
                ) from exc
        return works

    def request_checkpoint(self, step: int) -> None:
        """Worker side of ``sync.save()``: ask every server to snapshot its state now, after
        this worker's ``step``-th push. No reply: the servers then join the save's collectives."""
        assert not self.is_server  # resume.save() refuses servers with a message
        if self._finished:
            raise UsageError("training already finished (report() ended it): nothing to save")
        for what, work in self._post(self._control(_CHECKPOINT), None, step, "checkpoint request"):
            self._wait(work, what)

    @property
    def _group(self) -> dist.ProcessGroup | None:
        assert self._ctx is not None
        return self._ctx.group

    def _wait(self, work: Any, what: str) -> None:
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

    def _install(self, s: int, flat: torch.Tensor) -> None:
        offset = 0
        for i in self._shards[s]:
            p = self._params[i]
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def finalize(self) -> None:
        """Tell the servers this worker is done and take the final parameters (identical on
        every worker: servers answer only when all workers are done)."""
        if self.is_server or self._finished:
            return
        self._finished = True
        self._exchange(self._control(_DONE), "end", "end-of-training message")

    def replicas_identical(self, step: int, final: bool) -> bool:
        """Workers agree only at the end, once every one has fetched the final parameters."""
        return final

    # -- server side ----------------------------------------------------------------------------
    def serve(self, checkpoint: Callable[[dict[str, Any]], None] | None = None) -> ServerStats:
        """Serve until every worker is done. ``checkpoint(state)`` is called with this server's
        state when the workers ask for a checkpoint; it writes it and joins their collectives
        (``Synchronizer.serve`` passes ``gradsync.fault.resume.save_server``)."""
        from gradsync.strategies.ps_server import run_server

        assert self._ctx is not None
        restored, self._restored = self._restored, None
        return run_server(self, self._ctx, checkpoint=checkpoint, restored=restored)

    def restore_server(self, state: dict[str, Any]) -> None:
        """Hold a server's checkpointed state (parameters, optimizer state, clocks) for the
        next ``serve()``, which starts from it."""
        if not self.is_server:
            raise UsageError("restore_server() is for parameter-server ranks")
        self._restored = state

    def state_dict(self) -> dict[str, Any]:
        """A worker's error-feedback residuals (and PowerSGD factors), one per shard; the
        servers' state is saved by the servers themselves (see ``serve``)."""
        return {"codecs": [c.state_dict() for c in self._codecs]} if self._codecs else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("codecs", [])
        if len(saved) != len(self._codecs):
            spec = self._ctx.compressor.spec if self._ctx else "?"
            raise UsageError(
                f"the saved state holds {len(saved)} push codec(s), this worker has "
                f"{len(self._codecs)} (compression {spec}, {self.servers} server(s)): resume "
                "with the same --compress and --servers"
            )
        for codec, codec_state in zip(self._codecs, saved, strict=True):
            codec.load_state_dict(codec_state)

    def close(self) -> None:
        pass


__all__ = ["AppliedUpdate", "ParameterServer", "ServerStats", "shard_by_size"]
