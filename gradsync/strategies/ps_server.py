"""The server role of the parameter server (``ssp:S``, ``async``): apply pushes, hold replies
to the staleness bound. ``PSServer`` is what ``Synchronizer.serve()`` runs on a server rank; it
knows the workers only through the shared ``ps_wire.ShardPlan`` and the messages they send.

One receiver thread per worker blocks on that worker's next message (threads waiting in
torch.distributed release the GIL, so an idle server costs no CPU); the main thread applies
updates and answers in arrival order, so the parameters a reply carries are a consistent
snapshot. A worker that disappears, or stays silent past the timeout, ends the server with an
error naming it. A worker that waits for a reply the server holds (the staleness bound, or
a checkpoint not yet taken) is not absent: when it gives up, the error names the workers
the server was waiting for instead (``_Server.absence``), each with how long it has been
silent and where its heartbeat last placed it (an evaluation between steps, say).

Checkpoints: a worker asks with a ``CHECKPOINT`` message, or with its next message (its kind
plus ``SAVED``: the server keeps that message aside, to apply once the checkpoint is taken).
Either pauses its receiver thread (it posts no receive until the checkpoint is over, so a
slow save does not count against the receive timeout). Once every unfinished worker has
asked, no reply is pending either (each worker waited for its last reply before asking), and
the server hands its state (its
parameters, its optimizer's state and the clocks) to the ``checkpoint`` callback (with
``durable=True`` when a worker's save waits for its files), then lets the receivers go on. A
worker's ``FLUSH`` (it waits for its checkpoints to be written) calls the ``flush`` callback:
the newest snapshot handed over is written at once (the writer holds most of them in memory,
``gradsync.checkpoint.held_slots``). It always follows that worker's newest request, whose snapshot
is therefore taken.

Shutdown, in order: a receiver thread returns right after delivering its worker's ``DONE``,
so once every worker is done no receive is posted; the server then sends every worker the
final parameters, waits until every send it made has completed, and joins the receiver
threads. Each worker, in ``finalize()``, has waited for its ``DONE`` send and for that reply.
Only then do servers and workers meet in the final collectives (replica check, telemetry) and
the final handshake (``Synchronizer._final_handshake``), so no rank leaves while a peer still
talks to it.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync.checks.guards import is_finite
from gradsync.errors import CheckpointError, SyncTimeoutError, UsageError
from gradsync.flat import flatten, views
from gradsync.strategies.base import CheckpointSink, SyncContext
from gradsync.strategies.ps_wire import CHECKPOINT, DONE, FLUSH, SAVED, SKIPPED, ShardPlan


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


#: how many of its earlier checkpoints' steps a server's checkpoint keeps (``ServerStats``)
CHECKPOINTS_SAVED = 100


@dataclass(slots=True)
class ServerStats:
    """What one server did. ``updates`` and ``held_seconds`` cover this process only;
    ``clocks`` (pushes applied per worker) and ``checkpoints`` continue across a resume (of
    the run before it, the newest ``CHECKPOINTS_SAVED`` checkpoints' steps), and
    ``resumed_at`` is the step of the checkpoint this server started from (0: none)."""

    server_rank: int
    updates: list[AppliedUpdate] = field(default_factory=list)
    held_seconds: float = 0.0
    clocks: list[int] = field(default_factory=list)
    resumed_at: int = 0
    checkpoints: list[int] = field(default_factory=list)
    #: pushes applied as nothing: skipped by their worker (a non-finite gradient), or refused
    #: here because they decoded to non-finite values
    skipped_pushes: int = 0
    refused_pushes: int = 0

    @property
    def max_staleness(self) -> int:
        return max((u.staleness for u in self.updates), default=0)


@dataclass(slots=True)
class _Pull:
    clock: int  # the clock the worker will compute next
    #: when the staleness bound began to hold this reply back (``time.perf_counter()``), None
    #: when the bound allowed it at once: its reply waits for nothing but the server's own
    #: processing, which is not idle (``async`` is always None)
    held_since: float | None


def _server_optimizer(
    user: torch.optim.Optimizer, params: list[torch.Tensor], group_of: list[int]
) -> tuple[torch.optim.Optimizer | None, list[int]]:
    """The user's optimizer class over this server's shard, each parameter in a group with the
    hyper-parameters of its group in ``user`` (``group_of``: its index there, -1 for none).

    Returns the optimizer (None when no parameter of the shard is in any group: nothing here is
    ever updated) and, for each of its groups, the index of the user's group it copies.
    Only the constructor's own keyword arguments are passed as defaults (the optimizer's
    ``defaults`` may hold others, such as AdamW's ``decoupled_weight_decay`` in recent torch),
    and only hyper-parameter keys (those in ``defaults``) are copied from a group, leaving out
    what schedulers add (``initial_lr``)."""
    accepted = inspect.signature(type(user).__init__).parameters
    defaults = {k: v for k, v in user.defaults.items() if k in accepted}
    groups: list[dict[str, Any]] = []
    source: list[int] = []
    for g, group in enumerate(user.param_groups):
        mine = [p for p, of in zip(params, group_of, strict=True) if of == g]
        if not mine:
            continue
        hyper = {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in group.items()
            if k != "params" and k in user.defaults
        }
        groups.append({"params": mine, **hyper})
        source.append(g)
    if not groups:
        return None, []
    return type(user)(groups, **defaults), source


class _Receivers:
    """One thread per worker posting receives for its messages into ``inbox``; a thread that
    delivers a ``CHECKPOINT`` waits for ``resume(w)`` before receiving again."""

    def __init__(self, plan: ShardPlan, rank: int, message_numel: int, dtype: torch.dtype):
        self.inbox: queue.Queue[tuple[int, torch.Tensor | BaseException]] = queue.Queue()
        self._go = [queue.SimpleQueue[None]() for _ in range(plan.workers)]
        self._plan, self._rank, self._numel, self._dtype = plan, rank, message_numel, dtype
        self.threads = [
            threading.Thread(target=self._receive, args=(w,), daemon=True)
            for w in range(plan.workers)
        ]
        for t in self.threads:
            t.start()

    def resume(self, w: int) -> None:
        self._go[w].put(None)

    def _receive(self, w: int) -> None:
        plan = self._plan
        src = plan.global_rank(w)
        while True:
            buf = torch.empty(self._numel, dtype=self._dtype)
            try:
                work = dist.irecv(buf, src=src, group=plan.group)
                assert work is not None
                if work.wait(timeout=plan.timeout) is False:
                    raise SyncTimeoutError(f"no message within {plan.timeout.total_seconds():.0f}s")
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.inbox.put((w, exc))
                return
            # Read before handing it over: the main thread may answer it at once.
            kind = float(buf[0])
            self.inbox.put((w, buf))
            if kind in (DONE, DONE + SAVED):
                return
            if kind == CHECKPOINT or kind >= SAVED:
                # The main thread owns the timeout meanwhile (it is in the save's collectives,
                # or waiting for the other workers' requests); it ends the process on failure.
                self._go[w].get()

    def join(self) -> None:
        """After every worker's ``DONE``: each thread returned right after delivering it, so
        no receive is left posted when the server goes on to the final collectives."""
        for w, t in enumerate(self.threads):
            t.join(timeout=self._plan.timeout.total_seconds())
            if t.is_alive():
                raise SyncTimeoutError(
                    f"parameter server rank {self._rank}: the receiver of worker rank {w} "
                    "did not end after that worker finished"
                )


class _Server:
    """The state of one server and what it does with each kind of message."""

    def __init__(
        self,
        plan: ShardPlan,
        ctx: SyncContext,
        staleness: float,
        rank: int,
        checkpoint: CheckpointSink | None,
        restored: dict[str, Any] | None,
        flush: Callable[[], None] | None = None,
    ) -> None:
        self.plan, self.staleness, self.rank, self.checkpoint = plan, staleness, rank, checkpoint
        self.flush = flush
        self.watch = ctx.watch  # the workers' heartbeats, for naming an absent one
        s = self.shard = rank - plan.workers
        # The server owns its own copies: the model object on this rank is only a shape template.
        self.params = [p.detach().clone().requires_grad_(True) for p in plan.shard_params(s)]
        self.optimizer, self.group_source = _server_optimizer(
            ctx.optimizer, self.params, plan.group_of(s)
        )
        self.numel = sum(p.numel() for p in self.params)
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.workers = plan.workers
        # What a message to this server looks like; compressed pushes are decoded with the
        # codec of the worker that sent them (the same seed it encoded with).
        self.wire_dtype, self.header, self.payload_numel = plan.wire(s)
        self.message_numel = plan.receive_numel(s)
        self.codecs = [plan.codec(s, w) for w in range(self.workers)] if plan.compressed else []
        self.stats = ServerStats(server_rank=rank)
        self.pushed = [0] * self.workers
        self.done = [False] * self.workers
        self.pending: dict[int, _Pull] = {}
        self.fresh_through = [-1] * self.workers  # k of the parameters last sent to each worker
        self.requested = [False] * self.workers  # sent CHECKPOINT, not yet served
        self.durable = False  # a request of the checkpoint not yet served waits for its files
        self.where = 0  # rank 0's number for the directory of its last request that had one
        #: messages that asked for the checkpoint not yet taken (``SAVED``), in arrival order,
        #: to apply after it: (worker, kind less ``SAVED``, message)
        self.deferred: list[tuple[int, float, torch.Tensor]] = []
        self.sends: list[Any] = []
        #: when each worker's last message arrived (``time.monotonic()``)
        self.heard = [time.monotonic()] * self.workers
        if restored is not None:
            self._restore(restored)
        self.stats.clocks = self.pushed

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only, so ``torch.load(weights_only=True)`` reads it. The
        tensors are the server's own, not copies: read them before serving goes on (the
        checkpoint callback's snapshot copies them; a clone here was a second copy of the
        shard at every checkpoint, inside ``serve()`` while the workers wait)."""
        state = self.checkpoint_state()
        state["params"] = [p.detach() for p in self.params]
        state["optimizer"] = self.optimizer.state_dict() if self.optimizer is not None else {}
        return state

    def checkpoint_state(self) -> dict[str, Any]:
        """What the checkpoint callback is handed: ``state_dict()``'s entries, but the shard
        and the optimizer themselves (``Checkpointer.save_server`` builds the optimizer's state
        dict only where its snapshot plan cannot vouch for the layout: 0.12 ms of the
        server's snapshot, inside ``serve()`` while the workers wait for it). Read before
        serving goes on."""
        return {
            "params": self.params,
            "optimizer": self.optimizer,
            "pushed": list(self.pushed),
            "fresh_through": list(self.fresh_through),
            # The newest only: with a checkpoint every step, the whole list made every
            # checkpoint of a long run larger than the one before.
            "checkpoints": self.stats.checkpoints[-CHECKPOINTS_SAVED:],
        }

    def _restore(self, state: dict[str, Any]) -> None:
        saved = state["params"]
        shapes = [tuple(p.shape) for p in self.params]
        if [tuple(t.shape) for t in saved] != shapes or len(state["pushed"]) != self.workers:
            raise CheckpointError(
                f"parameter server rank {self.rank}: the checkpoint holds a shard of shapes "
                f"{[tuple(t.shape) for t in saved]} for {len(state['pushed'])} workers; this "
                f"server's shard is {shapes} for {self.workers} workers (a different model or "
                "layout)"
            )
        with torch.no_grad():
            for p, t in zip(self.params, saved, strict=True):
                p.copy_(t)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.pushed = [int(c) for c in state["pushed"]]
        self.fresh_through = [int(k) for k in state["fresh_through"]]
        self.stats.checkpoints = [int(c) for c in state.get("checkpoints", [])]
        self.stats.resumed_at = min(self.pushed)

    def on_message(
        self, w: int, item: torch.Tensor, receivers: _Receivers, kind: float | None = None
    ) -> None:
        """Apply one message of worker ``w`` (module docstring), as of ``kind`` if given."""
        kind = float(item[0]) if kind is None else kind
        if kind >= SAVED:  # a checkpoint request first, then the message once it is taken
            self.requested[w] = True
            self.deferred.append((w, kind - SAVED, item))
            self.maybe_checkpoint(receivers)
        elif kind == DONE:
            self.done[w] = True
            self.maybe_checkpoint(receivers)
        elif kind == CHECKPOINT:
            self.on_checkpoint(w, item, receivers)
        elif kind == FLUSH:
            self.on_flush()
        elif kind == SKIPPED:
            self.on_skipped(w)
        else:
            self.on_gradient(w, item)

    def on_checkpoint(self, w: int, message: torch.Tensor, receivers: _Receivers) -> None:
        self._note_request(w, message)
        self.maybe_checkpoint(receivers)

    def _note_request(self, w: int, message: torch.Tensor) -> None:
        """Worker ``w`` asked for a checkpoint in a ``CHECKPOINT`` message of its own."""
        self.requested[w] = True
        durable, where = self.plan.read_words(self.shard, message, 2)
        self.durable |= bool(durable)
        if w == 0 and where:  # rank 0 published the directory (``CheckpointHooks.handed_over``)
            self.where = where

    def checkpoint_on_loss(self, lost: int, receivers: _Receivers | None = None) -> None:
        """Worker ``lost`` is gone: take the checkpoint of the step every worker has pushed,
        if the workers save every step (the last checkpoint was of the step before) or some
        have asked for it. A worker saving every step asks with its next message, which
        ``lost`` may have saved and died before sending. The writer, holding the snapshot,
        writes it as this process ends; where some rank never saved that step, its file is
        missing and the resume takes the step before, as it would have without this one.
        Requests still queued (``receivers``) count. A failure here is not raised: the loss
        is the error to report."""
        if receivers is not None:
            self._note_queued_requests(receivers)
        if self.checkpoint is None or len(set(self.pushed)) != 1:
            return
        step = self.pushed[0]
        taken = self.stats.checkpoints[-1] if self.stats.checkpoints else None
        if taken == step or not (any(self.requested) or taken == step - 1):
            return
        self.stats.checkpoints.append(step)
        with contextlib.suppress(Exception):
            self.checkpoint(self.checkpoint_state(), durable=False, where=self.where)

    def _note_queued_requests(self, receivers: _Receivers) -> None:
        """Mark the checkpoint requests among the messages not applied yet (nothing else of
        them is applied: the server is ending)."""
        while True:
            try:
                w, item = receivers.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, BaseException):
                continue
            kind = float(item[0])
            if kind == CHECKPOINT:
                self._note_request(w, item)
            elif kind >= SAVED:
                self.requested[w] = True

    def on_flush(self) -> None:
        """A worker waits for its checkpoints: write the newest snapshot now (module
        docstring). Without a callback there is nothing held to write."""
        if self.flush is not None:
            self.flush()

    def maybe_checkpoint(self, receivers: _Receivers) -> None:
        """Snapshot once every unfinished worker has asked; then let their receivers go on."""
        if not any(self.requested) or not all(
            self.done[v] or self.requested[v] for v in range(self.workers)
        ):
            return
        if self.checkpoint is None:
            raise UsageError(
                f"parameter server rank {self.rank}: the workers asked for a checkpoint, but "
                "serve() was given no checkpoint callback (call sync.serve(), which passes one)"
            )
        # Each worker waited for its last reply before asking, so nothing is held back here.
        assert not self.pending, self.pending
        self.stats.checkpoints.append(min(self.pushed))
        self.checkpoint(self.checkpoint_state(), durable=self.durable, where=self.where)
        self.durable = False
        asked = [v for v in range(self.workers) if self.requested[v]]
        self.requested = [False] * self.workers
        deferred, self.deferred = self.deferred, []
        for v, kind, message in deferred:  # after the snapshot, as if they came only now
            self.on_message(v, message, receivers, kind)
        for v in asked:
            receivers.resume(v)

    # -- diagnosis ------------------------------------------------------------------------------
    def absence(self, lost: int | None, cause: str) -> str:
        """The error when the wait for the workers fails: worker ``lost``'s receive failed with
        ``cause`` (None: no worker sent anything within the timeout). A worker whose reply is
        held here waits on the server, and gives up when its own wait times out: blaming it
        named the wrong rank (issue 42: rank 0 was evaluating, the server reported 'lost
        worker rank 1'). The absent workers are the others not done."""
        held = {v for v in self.pending} | {v for v, _kind, _msg in self.deferred}
        absent = [v for v in range(self.workers) if not self.done[v] and v not in held]
        head = f"parameter server rank {self.rank}: "
        if lost is not None and lost not in held:
            waiting = self._held_for(sorted(held), "it")
            return f"{head}lost worker rank {lost} ({self._silence(lost)}): {cause}{waiting}"
        if not absent:  # nothing else to blame (should not happen): report what failed
            return f"{head}lost worker rank {lost}: {cause}"
        silent = "; ".join(f"worker rank {v} {self._silence(v)}" for v in absent)
        whom = "it" if len(absent) == 1 else "them"
        if lost is None:
            return f"{head}{silent} ({cause}){self._held_for(sorted(held), whom)}"
        return (
            f"{head}{silent}; worker rank {lost} waited for a reply held for {whom} "
            f"({self._held_why()}) and gave up: {cause}"
        )

    def _silence(self, v: int) -> str:
        """How long worker ``v`` has sent nothing, and where its last heartbeat placed it."""
        quiet = f"sent nothing for {time.monotonic() - self.heard[v]:.1f}s"
        beat = None
        with contextlib.suppress(Exception):  # the store may be gone with the worker
            beat = self.watch.beat_of(v) if self.watch is not None else None
        return f"{quiet}, its last heartbeat: {beat.place()}" if beat is not None else quiet

    def _held_for(self, held: list[int], whom: str) -> str:
        if not held:
            return ""
        if len(held) == 1:
            waits = f"worker rank {held[0]} waits for a reply"
        else:
            waits = f"worker ranks {', '.join(map(str, held))} wait for replies"
        return f"; {waits} held for {whom} ({self._held_why()})"

    def _held_why(self) -> str:
        if any(self.requested) or math.isinf(self.staleness):  # async holds only for those
            return "a checkpoint every worker must ask for first"
        return f"the staleness bound of ssp:{int(self.staleness)}"

    # -- gradients and replies ------------------------------------------------------------------
    def on_gradient(self, w: int, message: torch.Tensor) -> None:
        # The receive buffer is at least a control message's size (``receive_numel``): a shard
        # of fewer elements than that has its push in the buffer's first part only.
        payload = message[self.header : self.header + self.payload_numel]
        # A worker's k-th push was encoded at its step k (pushed[w] counts them, across resumes).
        grad = self.codecs[w].decode(payload, self.pushed[w]) if self.codecs else payload
        if not is_finite(grad):
            # One worker's NaN would reach every worker through the parameters it pulls.
            self.stats.refused_pushes += 1
            self.on_skipped(w)
            return
        # Messages travel in host memory (gloo's send and receive take no device memory); a
        # shard held on a GPU takes its gradient there.
        for p, g in zip(self.params, views(grad, self.params), strict=True):
            p.grad = g.to(p.device) / self.workers
        if self.optimizer is not None:
            self._set_lrs(self.plan.read_lrs(message))
            self.optimizer.step()
        self.stats.updates.append(AppliedUpdate(w, self.pushed[w], self.fresh_through[w]))
        self._counted(w)

    def on_skipped(self, w: int) -> None:
        """A push that applies nothing still counts: the worker's clock moves on."""
        self.stats.skipped_pushes += 1
        self._counted(w)

    def _counted(self, w: int) -> None:
        self.pushed[w] += 1
        clock = self.pushed[w]
        held_since = None if self.allowed(clock) else time.perf_counter()
        self.pending[w] = _Pull(clock=clock, held_since=held_since)

    def _set_lrs(self, lrs: list[float]) -> None:
        """This push's step uses the lr the worker's optimizer had for each group (its
        scheduler's, if it has one)."""
        assert self.optimizer is not None
        for group, g in zip(self.optimizer.param_groups, self.group_source, strict=True):
            lr = lrs[g]
            if math.isnan(lr):  # the user's group has no lr
                continue
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    def allowed(self, clock: int) -> bool:
        # Clock c may start once every worker's updates from clocks <= c - S - 1 are applied,
        # i.e. each worker has pushed at least c - S gradients. Finished workers never block.
        if math.isinf(self.staleness):
            return True
        need = clock - int(self.staleness)
        return all(self.done[w] or self.pushed[w] >= need for w in range(self.workers))

    def answer_ready(self) -> None:
        """Reply to every pull the staleness bound now allows. The seconds a reply carries
        (the worker's ``idle``) are those the bound held it back: from its push being applied
        while the bound forbade its next clock to the message that lifted the bound (another
        worker's push applied, or its end), which was applied just before this call. A reply
        the bound allowed at once carries 0 (so always under ``async``): the server's own
        processing (the update, this snapshot) is the worker's ``comm``, not idle."""
        now = time.perf_counter()  # the bound lifted before the snapshot below
        ready = [v for v, pull in self.pending.items() if self.allowed(pull.clock)]
        if not ready:
            return
        flat = self.snapshot()
        k = min(self.pushed) - 1
        for v in sorted(ready):
            since = self.pending.pop(v).held_since
            held = 0.0 if since is None else max(0.0, now - since)
            self.stats.held_seconds += held
            self.fresh_through[v] = k
            self.reply(v, held, flat)

    def snapshot(self) -> torch.Tensor:
        """The shard's parameters as one host tensor: what every reply carries."""
        return flatten(self.params).cpu()

    def reply(self, w: int, held: float, flat: torch.Tensor) -> None:
        msg = torch.cat([flat.new_tensor([held]), flat])
        if len(self.sends) > 64:  # forget sends that completed; keep the rest (and their tensors)
            self.sends[:] = [x for x in self.sends if not x.is_completed()]
        try:
            self.sends.append(dist.isend(msg, dst=self.plan.global_rank(w), group=self.plan.group))
        except RuntimeError as exc:  # gloo raises here when the worker's connection is closed
            raise SyncTimeoutError(
                f"parameter server rank {self.rank}: lost worker rank {w}: "
                f"{str(exc).splitlines()[0]}"
            ) from exc

    def finish(self) -> None:
        """Send every worker the final parameters and wait until every send has completed (the
        earlier replies too), so none is in flight when the final collectives begin."""
        final = self.snapshot()
        for w in range(self.workers):
            self.reply(w, 0.0, final)
        timeout = self.plan.timeout
        for work in self.sends:
            try:
                ok = work.wait(timeout=timeout)
            except RuntimeError as exc:
                raise SyncTimeoutError(
                    f"parameter server rank {self.rank}: sending the final parameters "
                    f"failed: {str(exc).splitlines()[0]}"
                ) from exc
            if ok is False:
                raise SyncTimeoutError(
                    f"parameter server rank {self.rank}: a reply was not taken within "
                    f"{timeout.total_seconds():.0f}s"
                )
        self.sends.clear()


class PSServer:
    """The server role (``strategies.base.ServerRole``) of one server rank."""

    def __init__(self, plan: ShardPlan, ctx: SyncContext, staleness: float, rank: int) -> None:
        self._plan, self._ctx, self._staleness, self.rank = plan, ctx, staleness, rank
        self._restored: dict[str, Any] | None = None

    def restore(self, state: dict[str, Any]) -> None:
        """Hold a server's checkpointed state (parameters, optimizer state, clocks) for the
        next ``serve()``, which starts from it."""
        self._restored = state

    def serve(
        self,
        checkpoint: CheckpointSink | None = None,
        flush: Callable[[], None] | None = None,
    ) -> ServerStats:
        """Serve until every worker is done. ``checkpoint(state, durable=..., where=...)`` is
        called with this server's state when the workers ask for a checkpoint (``durable``: a
        worker's save waits for the files; ``where``: rank 0's number for the directory, see
        ``CheckpointHooks.handed_over``); it hands the state to this rank's writer
        (``Synchronizer.serve`` passes ``Checkpointer.save_server``). The state
        (``_Server.checkpoint_state``) is live: the server's own tensors and its optimizer
        object (None without one), whose ``state_dict()`` the callback takes; copy what it
        keeps within the call. ``restore`` takes it as written: tensors copied, the optimizer
        as its state dict. ``flush()`` is
        called when a worker waits for its checkpoints: write the newest state handed over."""
        restored, self._restored = self._restored, None
        server = _Server(
            self._plan, self._ctx, self._staleness, self.rank, checkpoint, restored, flush
        )
        return _serve(server)


def _serve(server: _Server) -> ServerStats:
    """The receive loop: apply every message in arrival order until every worker is done."""
    plan, rank = server.plan, server.rank
    receivers = _Receivers(plan, rank, server.message_numel, server.wire_dtype)
    timeout = plan.timeout.total_seconds()
    while not all(server.done):
        try:
            w, item = receivers.inbox.get(timeout=timeout)
        except queue.Empty:
            raise SyncTimeoutError(server.absence(None, f"timeout {timeout:g}s")) from None
        if isinstance(item, BaseException):
            server.checkpoint_on_loss(w, receivers)
            cause = str(item).splitlines()[0] if str(item) else type(item).__name__
            raise SyncTimeoutError(server.absence(w, cause)) from item
        server.heard[w] = time.monotonic()
        server.on_message(w, item, receivers)
        server.answer_ready()
    server.finish()
    receivers.join()
    return server.stats


__all__ = ["AppliedUpdate", "PSServer", "ServerStats"]
