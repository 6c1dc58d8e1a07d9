"""Parameter server: stale-synchronous (``ssp:S``) and asynchronous (``async``) training.

Layout: with K servers, the **last K ranks** are servers and ranks ``0..W-1`` are workers, so
rank 0 is always a worker (it writes the run's files). Parameters are sharded across servers
by size, whole tensors (see ``ps_wire``).

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

Transport: point-to-point ``isend``/``irecv`` of torch.distributed on the job's gloo group
(messages are host tensors on both ends, also when the model is on a GPU, so NCCL, which sends
device memory only, cannot carry them; ``gradsync run --backend auto`` takes gloo here); a
server waits for each worker in its own thread, so one slow worker never delays another's
reply. ``benchmarks/ps_transport.py`` times a push/pull round trip of S bytes against
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
Point-to-point reuses the process group (and its timeouts) the job already has and moves
tensors as they are: hence the choice.

Roles: this module is the worker role, and the strategy object: on a server rank
``server_role()`` hands the ``Synchronizer`` a ``ps_server.ServerRole`` to run instead of
training. Both build the same ``ps_wire.ShardPlan`` (the shards and the message layout) and
share nothing else. Checkpoints: workers ask every server to snapshot after their N-th push
(``checkpoint_held``, once the worker's own snapshot is with its writer); each request follows
that worker's N-th push on the same ordered channel, so the server has then applied exactly N
pushes of each. A worker that waits for its checkpoints tells the servers to write theirs
(``flush_checkpoints``). See ``gradsync.checkpoint.checkpointer`` for the rest of the protocol.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradsync import compat
from gradsync.compression.push import PushCodec
from gradsync.errors import SyncTimeoutError, UsageError
from gradsync.flat import copy_into
from gradsync.strategies.base import (
    CheckpointHooks,
    StepOutcome,
    StepPlan,
    Strategy,
    SyncContext,
    local_gradient,
)
from gradsync.strategies.passes import PassCounter
from gradsync.strategies.ps_server import AppliedUpdate, PSServer, ServerStats
from gradsync.strategies.ps_wire import (
    CHECKPOINT,
    DONE,
    FLUSH,
    GRADIENT,
    SAVED,
    SKIPPED,
    ShardPlan,
    current_lrs,
    shard_by_size,
)


class ParameterServer(Strategy):
    """``ssp:S`` and ``async``: the worker role; on server ranks ``server_role()`` is the server.

    ``servers`` ranks (the last ones) serve; the others train."""

    barrier_free = True

    def __init__(self, staleness: float, servers: int = 1, timeout_s: float = 300.0) -> None:
        if not (staleness >= 0):
            raise UsageError(f"staleness bound S must be >= 0 or inf, got {staleness}")
        if not isinstance(servers, int) or servers < 1:
            raise UsageError(f"servers must be an integer >= 1, got {servers!r}")
        self.staleness = staleness
        self.servers = servers
        self.timeout_s = timeout_s
        self.name = "async" if math.isinf(staleness) else f"ssp:{int(staleness)}"
        self._ctx: SyncContext | None = None
        self._plan: ShardPlan | None = None
        self._server: PSServer | None = None
        self._passes = PassCounter([])  # a worker's (setup)
        self._average_over = 1
        self._finished = False
        self._codecs: list[PushCodec] = []
        #: control messages posted and not yet waited for: (what, work, the message)
        self._unsettled: list[tuple[str, Any, torch.Tensor]] = []
        #: a checkpoint request that goes with the next message (``checkpoint_held``)
        self._request_pending = False
        self._where_sent = 0  # the directory number of the last request sent with one
        self._last_saved = -2  # the step of this worker's last save

    def setup(self, ctx: SyncContext) -> None:
        if ctx.scaling:
            raise UsageError(
                f"a GradScaler cannot drive {self.name} while enabled: the parameter servers "
                "step the optimizer, and a worker's push cannot be skipped. A disabled one "
                "(GradScaler(enabled=False)) is accepted. Unscale the gradient at "
                "s.synchronize() yourself (grad / scaler.get_scale()), or use bsp, zero:N, "
                "local:H or diloco:H with scaler="
            )
        self._ctx = ctx
        # A server snapshots once every worker has asked, and answers a worker's next push only
        # after: a worker is at most one checkpoint ahead of the others (``holds_snapshots``).
        # Each worker asks once its own snapshot is held, so a rank that dies leaves a step
        # every rank holds.
        ctx.register_checkpoint_hooks(
            CheckpointHooks(
                before_save=self.prepare_checkpoint,
                handed_over=self.checkpoint_held,
                flush=self.flush_checkpoints,
                holds_snapshots=True,
            )
        )
        plan = self._plan = ShardPlan(ctx, self.servers, self.timeout_s)
        if ctx.layout.role(ctx.rank) == "server":
            self._server = PSServer(plan, ctx, self.staleness, ctx.rank)
            return
        self._passes = PassCounter(plan.params)
        if plan.compressed:
            # One codec per shard, holding this worker's error-feedback residual.
            self._codecs = [plan.codec(s, ctx.rank) for s in range(self.servers)]

    def close(self) -> None:
        self._passes.close()

    def server_role(self) -> PSServer | None:
        return self._server

    @property
    def plan(self) -> ShardPlan:
        assert self._plan is not None, "setup() has not run"
        return self._plan

    # -- steps ----------------------------------------------------------------------------------
    def begin_step(self, plan: StepPlan) -> None:
        assert self._ctx is not None
        if self._server is not None:
            raise UsageError("this rank is a parameter server: call sync.serve(), not sync.step()")
        if self._finished:
            raise UsageError("training already finished (report() ended it): no more steps")
        self._ctx.optimizer.zero_grad(set_to_none=True)
        self._average_over = plan.average_over
        self._passes.arm(plan.micro_batches)

    def gradients_ready(self, step: int) -> StepOutcome:
        """This worker's own gradient, the mean over micro-batches: it is what gets pushed,
        unless it is not finite: then this worker skips the step (it pushes nothing)."""
        assert self._ctx is not None
        self._passes.check()
        return local_gradient(self.plan.params, self._ctx, self._average_over)

    def abandon(self, step: int) -> StepOutcome:
        """This worker's block raised: it skips the step, and ``update`` tells the servers so
        (a payload-less message), as for a non-finite gradient."""
        assert self._ctx is not None
        self._ctx.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(barrier=False, skipped=True)

    def update(self, step: int, outcome: StepOutcome) -> StepOutcome:
        """Push each server its shard's gradient; install the parameters it sends back."""
        plan = self.plan
        if outcome.skipped:  # the servers count the push and reply; no codec sees the NaN
            outcome.idle = self._exchange(self._control(SKIPPED), step, "skipped push")
            return outcome
        lrs = self._current_lrs()
        kind = GRADIENT + self._take_request()
        pushes = []
        for s in range(self.servers):
            flat = torch.cat(
                [
                    torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                    if p.grad is None
                    else p.grad.detach().reshape(-1)
                    for p in plan.shard_params(s)
                ]
            )
            # The server decodes with its count of this worker's pushes, which equals this
            # step: one push per step, and both sides resume from the same checkpoint.
            payload = self._codecs[s].encode(flat, step) if plan.compressed else flat
            pushes.append(plan.message(s, kind, lrs, payload))
        held = self._exchange(pushes, step)
        # The optimizer steps on the servers. Record that it ran, as torch's wrapper of
        # optimizer.step() does, so an LR scheduler stepped here does not warn that it never did.
        assert self._ctx is not None
        compat.mark_optimizer_stepped(self._ctx.optimizer)
        outcome.bytes_sent += sum(p.numel() * p.element_size() for p in pushes)
        outcome.idle = held
        return outcome

    def _current_lrs(self) -> torch.Tensor:
        assert self._ctx is not None
        return current_lrs(self._ctx.optimizer, self.plan.groups)

    def _control(self, kind: float) -> list[torch.Tensor]:
        """A payload-less message of ``kind`` for every server (with a checkpoint request
        pending, ``SKIPPED`` and ``DONE`` carry it)."""
        lrs = self._current_lrs()
        if kind in (SKIPPED, DONE):
            kind += self._take_request()
        return [self.plan.control(s, kind, lrs) for s in range(self.servers)]

    def _take_request(self) -> float:
        """``SAVED`` if a checkpoint request goes with the next message (then no longer
        pending), else 0."""
        pending, self._request_pending = self._request_pending, False
        return SAVED if pending else 0.0

    def _exchange(self, pushes: list[torch.Tensor], step: int | str, sent: str = "push") -> float:
        """Send one message to every server and install the parameters they send back."""
        plan = self.plan
        # Replies always carry parameters (in their dtype), whatever the pushes were encoded as.
        replies = [
            torch.empty(plan.reply_numel(s), dtype=plan.param_dtype(s)) for s in range(len(pushes))
        ]
        for what, work in self._post(pushes, replies, step, sent):
            try:
                plan.wait(work, what)
            except SyncTimeoutError as exc:
                raise SyncTimeoutError(f"{exc}{self._peers()}") from exc
        held = 0.0
        for s, reply in enumerate(replies):
            held = max(held, float(reply[0]))
            copy_into(reply[1:], plan.shard_params(s))
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
        plan = self.plan
        self._settle()
        works = []
        for s, msg in enumerate(msgs):
            peer = plan.server_rank(s)
            server = f"parameter server rank {peer} at step {step}"
            works.append(
                (f"the {sent} to {server}", plan.post("send", msg, peer, f"sending to {server}"))
            )
            if replies is not None:
                recv = plan.post("recv", replies[s], peer, f"sending to {server}")
                works.append((f"the reply of {server}", recv))
        return works

    def _peers(self) -> str:
        """Where the other workers' heartbeats place them, for a wait that failed: a server
        holds a reply for the slowest worker (the staleness bound, a checkpoint, the end of
        training), so the one absent is likely among them, not the server (issue 42)."""
        ctx = self._ctx
        if ctx is None or ctx.watch is None:
            return ""
        places = []
        for v in range(self.plan.workers):
            if v == ctx.rank:
                continue
            try:
                beat = ctx.watch.beat_of(v)
            except Exception:  # noqa: BLE001 - diagnosis is best effort; the store may be gone
                return ""
            if beat is not None:
                places.append(f"worker rank {v} is {beat.place()}")
        if not places:
            return ""
        bound = "" if math.isinf(self.staleness) else f"the staleness bound of {self.name}, "
        return (
            f". A server holds a reply while it waits for other workers ({bound}a checkpoint, "
            f"the end of training); their heartbeats: {'; '.join(places)} (the server's own "
            "error names the worker it waited for)"
        )

    # -- end of training and checkpoints --------------------------------------------------------
    def finalize(self) -> None:
        """Tell the servers this worker is done and take the final parameters (identical on
        every worker: servers answer only when all workers are done)."""
        if self._server is not None or self._finished:
            return
        self._finished = True
        self._exchange(self._control(DONE), "end", "end-of-training message")

    def replicas_identical(self, step: int, final: bool) -> bool:
        """Workers agree only at the end, once every one has fetched the final parameters."""
        return final

    def prepare_checkpoint(self, step: int) -> None:
        """Worker side of ``sync.save()``: refused once training has finished (the servers
        have stopped serving)."""
        if self._finished:
            raise UsageError("training already finished (report() ended it): nothing to save")

    def checkpoint_held(self, step: int, durable: bool, where: int = 0) -> None:
        """Ask every server to snapshot its state after this worker's ``step``-th push: with
        this worker's next message (``SAVED``), or at once in a ``CHECKPOINT`` of its own
        when the save waits for its files (``durable``) or, on rank 0, names another
        directory than the last request did (``where``: a server reads it from the store
        only when it changes). A message of its own per save cost about 0.2 ms median and
        0.5 ms mean of the worker's save (a send posted right after a step; charlm, 2 workers
        and a server), as much as the model's copy. It rides only when this worker saved at the
        step before too (saving every step). Each save asks once."""
        if self._request_pending:  # a second save since the last message: its own request
            self._request(self._where_sent, step)
        # Riding only when saving every step: with saves k steps apart, a rank that died before
        # its next message would lose k steps (with every step, the server takes the step
        # anyway when a worker is lost: ``ps_server._Server.checkpoint_on_loss``).
        every_step = step == self._last_saved + 1
        self._last_saved = step
        if durable or (where and where != self._where_sent) or not every_step:
            self._request(where or self._where_sent, step, durable)
        else:
            self._request_pending = True

    def _request(self, where: int, step: int | str, durable: bool = False) -> None:
        """A ``CHECKPOINT`` message to every server; waited for only with ``durable``."""
        self._request_pending = False
        lrs = self._current_lrs()
        msgs = [
            self.plan.control(s, CHECKPOINT, lrs, (int(durable), where))
            for s in range(self.servers)
        ]
        self._send_control(msgs, step, "checkpoint request")
        self._where_sent = where or self._where_sent
        if durable:
            self._settle()

    def flush_checkpoints(self) -> None:
        """Tell every server to write the newest snapshot it holds, after asking for the one
        pending (none once training has finished: a server writes its newest when it stops
        serving)."""
        if self._server is not None or self._finished or self._plan is None:
            return
        if self._request_pending:
            self._request(self._where_sent, "flush")
        self._send_control(self._control(FLUSH), "flush", "checkpoint flush")
        self._settle()

    def _send_control(self, msgs: list[torch.Tensor], step: int | str, sent: str) -> None:
        """Post ``msgs`` (one per server, no reply) without waiting for them."""
        posted = self._post(msgs, None, step, sent)
        self._unsettled += [(what, work, m) for (what, work), m in zip(posted, msgs, strict=True)]

    def _settle(self) -> None:
        """Wait for the control messages posted without waiting (``_send_control``)."""
        unsettled, self._unsettled = self._unsettled, []
        for what, work, _msg in unsettled:
            self.plan.wait(work, what)

    def state_dict(self) -> dict[str, Any]:
        """A worker's error-feedback residuals (and PowerSGD factors), one per shard; the
        servers' state is saved by the servers themselves (see ``ps_server``)."""
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


__all__ = ["AppliedUpdate", "ParameterServer", "ServerStats", "shard_by_size"]
