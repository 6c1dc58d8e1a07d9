"""The step gate: gradsync posts a collective only once every rank has come back from its own
code, so ``timeout_s`` bounds gradsync's waits and nothing else.

Why a gate of our own: a rank that runs the user's code between steps (an evaluation or a
checkpoint on rank 0) is not hung, and DDP would wait for it as long as the process group's
timeout allows. But a gloo collective cannot be given up once posted: its threads keep the
process from exiting until the backend's own timeout, so a Python-side watchdog cannot end it
early. The wait for a peer that is still in the user's code therefore happens before anything
is posted, in the store, where a wait can be abandoned at any moment. Once every rank is at the
gate, the step's collectives run under ``timeout_s`` as before.

At gate ``g`` each rank sets a key of its own named after ``g``, its step and what follows (a
step, a save, an average), then waits until every rank's key of that gate is set: one store
round trip per gate, as a ``set`` is sent without waiting for an answer (before 2026-11-30 a
counter took two: an ``add``, then a wait for a "go" key the last arrival set; both requests
are answered, and a store round trip on loopback here is about 80 us). Ranks at different
steps or collectives set and wait for different names and never meet: the gate then says which
rank is where, instead of pairing their exchanges. From 64 ranks the ranks arrive in groups
(``gradsync.checks.gate_groups``).

While it waits, the gate reads its peers' heartbeats (``ArrivalWatch``) and judges each rank
that has not arrived:

- running the user's code between steps, and alive: wait for it, up to
  ``between_steps_timeout_s`` in all;
- inside its step block, at another gate or wait, or silent (stopped, frozen, gone): gradsync's
  own business; fail once that has lasted ``timeout_s``;
- silent after leaving word that its block raised: fail at once, naming the exception;
- silent after leaving word that its script ended (returned, or ``sys.exit(0)``, with its
  Synchronizer open: under ``gradsync run`` its process lingers until its peers finish): fail
  at once, naming how it ended;
- silent, but its process still runs (asked of the kernel where the peer is on this machine,
  else of the peer's voucher, a process beside it that needs no GIL: ``ArrivalWatch.running``):
  it is in its own code holding the GIL, which keeps its heartbeat thread from running (a long
  C call); wait for it, as for a rank between steps, up to ``between_steps_timeout_s``.

The store itself may stop answering: rank 0's process serves it in some launches, and a stopped
rank 0 stops it too, while torch's client never gives up on a call. The gate's calls are timed
(``gradsync.checks.answered``); while the store is silent nothing of the peers can be read, so
nobody is judged, and once it has been silent for ``timeout_s`` the gate fails, naming it and
rank 0's state.

Whatever the store holds, the wait is bounded. The keys are named through the run's secret
(``gradsync.checks.secret``), so no process outside the run can address a gate to come; one
that reaches the store can still delete or set a key that exists. Every rank at the gate while
it never opens fails it after ``timeout_s``.

A gate may also come before a collective of the user's own code between steps (``zero:3``'s
forward, where FSDP2 gathers the parameters: ``before_user_collective``). A rank there while a
peer waits at another gate (the next step's) can never meet it: each waits for the other. Ranks
at different gates are otherwise taken for a moment's lag and blamed after ``timeout_s``; with
a user's collective on either side the mismatch is reported once it has lasted a few heartbeats
(``mismatch_s``), so that an evaluation run on rank 0 alone fails in seconds, each rank saying
where the other is, instead of leaving rank 0 in an all-gather for the group's timeout.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gradsync.checks import answered, gate_groups
from gradsync.checks.diagnose import BETWEEN, GATE, USER_GATE, ArrivalWatch, Beat, where
from gradsync.errors import SyncTimeoutError

#: the default bound on waiting for a peer in the user's code: torch's default collective
#: timeout for gloo, which is what DDP would wait
DEFAULT_BETWEEN_STEPS_S = 1800.0


@dataclass
class _Peer:
    """What the gate has seen of one rank that has not arrived."""

    beat: Beat | None = None
    #: when its heartbeat last advanced (this process's clock)
    alive_at: float = 0.0
    #: since when it has not been excused (not seen alive in the user's code)
    blamed_since: float = 0.0
    #: since when it has been seen at another gate than this one (None: it is not)
    elsewhere_since: float | None = None


#: what a store call's error says when it only ran out of time or was interrupted, not when
#: the store is gone ("Connection reset", "Broken pipe", "Connection refused" are not here)
_TRANSIENT = ("timeout", "timed out", "temporarily unavailable", "interrupted system call")


def transient_store_error(exc: BaseException) -> bool:
    """Whether a store call's ``exc`` is worth another try: a timeout, or EAGAIN / EINTR from
    its socket under load (issue 43, item 6: "Resource temporarily unavailable" failed a run
    at a load of 7 on 2 cores)."""
    text = str(exc).lower()
    return any(word in text for word in _TRANSIENT)


@dataclass
class _Passing:
    """The gate being passed: its name, step and what follows it, and the keys this rank set
    at it, each with its store (``StepGate._forget`` deletes them two gates on)."""

    name: str
    step: int
    what: str
    written: list[tuple[Any, str]] = field(default_factory=list)


@dataclass
class StepGate:
    """Gates of one Synchronizer: every rank must pass the same gates in the same order."""

    watch: ArrivalWatch
    timeout_s: float
    between_steps_s: float = DEFAULT_BETWEEN_STEPS_S
    _count: int = 0
    _label: str = ""
    #: the keys this rank set at each of the latest gates, with their stores (``_forget``)
    _history: list[list[tuple[Any, str]]] = field(default_factory=list)
    #: False once the user's code may have run since the last gate
    _fresh: bool = False
    #: whether the gate being waited at comes before a collective of the user's code
    _user: bool = False
    #: set by ``cancel``: a wait in flight (on ``GateAhead``'s thread) gives up
    _cancelled: bool = False
    #: ranks counted together at a store of their own (``Limits.gate_group_size``; None:
    #: automatic, see ``gradsync.checks.gate_groups``)
    group_size: int | None = None
    #: serves a group's store on the address given, its calls bounded as given (None: the gate
    #: stays flat)
    make_server: Callable[[str, datetime.timedelta], Any] | None = None
    #: how this rank's gate is grouped, from its first gate on (None: flat)
    _layout: gate_groups.Layout | None = None
    #: the group's store this rank serves, if any, kept open while the gate is
    _server: Any | None = None
    #: ``_layout`` once the first gate (passed flat) has been passed: gates are grouped
    _group: gate_groups.Layout | None = None
    #: the group's store as the gate uses it, keys named as the world's (None in a group of one)
    _group_store: Any | None = None
    #: a member's waits at its group's store (``_await_served``)
    _waiter: gate_groups.Waiter = field(default_factory=gate_groups.Waiter)
    #: the gate being passed (or last passed)
    _passing: _Passing = field(default_factory=lambda: _Passing("", 0, ""))

    def cancel(self) -> None:
        """Make a wait in flight on another thread give up at its next poll (the
        Synchronizer is closing, or the process exits)."""
        self._cancelled = True

    def close(self) -> None:
        """Let go of the group's store (``gradsync.checks.gate_groups``) when the
        Synchronizer closes; the gate is not passed again."""
        if self._group_store is not None:  # its keys' deletions still queued hold the server
            self.watch.forget_store(self._group_store)
        self._waiter.stop()
        self._group = self._group_store = self._server = None
        self._history.clear()  # the keys set at the last gates, each with its store
        self._passing = _Passing("", 0, "")

    def left(self) -> None:
        """Control went back to the user's code: the next collective needs a gate."""
        self._fresh = False

    def ensure(self, step: int, what: str) -> None:
        """Pass a gate at ``step`` unless one was passed since the user's code last ran."""
        if not self._fresh:
            self.wait(step, what)

    def before_user_collective(self, step: int, what: str) -> None:
        """Pass a gate before a collective that the user's code posts between steps (``what``,
        which should say how to do without it), then hand control back to the user's code.
        ``SyncTimeoutError`` when a peer is at another gate (see the module's docstring)."""
        before = self.watch.phase
        try:
            self.wait(step, what, user=True)
        finally:
            self.watch.enter(*before)
            self.left()

    @property
    def mismatch_s(self) -> float:
        """How long ranks at different gates, one of them before a user's collective, are
        taken for a lag: several heartbeats, so that a peer's last beat from the gate it just
        passed is never read as where it waits (and never more than the other bounds)."""
        return min(self.timeout_s, self.between_steps_s, max(5.0, 3 * self.watch.stale_s))

    def wait(self, step: int, what: str, *, user: bool = False) -> None:
        """Block until every rank is at this gate; ``SyncTimeoutError`` naming the ranks that
        are not, and where they are, when the bounds above run out. ``user``: the gate comes
        before a collective of the user's own code (``before_user_collective``)."""
        try:
            self._wait(step, what, user)
        except answered.StoreSilent as exc:  # a call the gate makes once (its first gate's)
            raise self.silent_store_error(step, what) from exc

    def _wait(self, step: int, what: str, user: bool) -> None:
        watch = self.watch
        self._fresh = True
        if watch.store is None or watch.world_size == 1:
            return
        watch.start()
        first = self._count == 0
        if first:
            self._plan_groups()
        # Named after the step and the collective too: ranks at different places never meet;
        # and after the group size, so that ranks grouping differently never meet either.
        name = f"{watch.prefix}/gate/{self._count}/{step}/{what}"
        if self._group is not None:
            name += f"/in{self._group.size}"
        self._count += 1
        self._label = f"{what} ({where(step)})"
        self._user = user
        before, here = watch.phase, (USER_GATE if user else GATE, step, self._label)
        watch.enter(*here)
        self._passing = _Passing(name, step, what)
        if self._group is None:
            self._arrive(watch.store, range(watch.world_size), watch.rank)
        else:
            self._arrive_grouped(self._group)
        self._forget(self._passing.written)
        address = self._check_groups() if first else None
        watch.gathered()  # every rank is here: those with a peer on another machine get a voucher
        # Where no secret was given, the ranks agree on one at their first gate, all present.
        try:
            watch.secure()
        except RuntimeError as exc:
            raise SyncTimeoutError(
                f"{where(step)}: {what}: agreeing on the run's secret failed: {exc}"
            ) from exc
        if first and self._layout is not None:
            store = gate_groups.reach(watch, self._layout, self._server, address)
            self._group, self._group_store = self._layout, gate_groups.keyed(store, watch.store)
        if watch.phase == here:
            # Passed: back to where the rank was (inside its block, for the step's gate), so a
            # peer that times out later does not say it is still waiting to begin the step.
            # Unless the rank moved on meanwhile (the gate waited ahead, on its own thread).
            watch.enter(*before)

    def _plan_groups(self) -> None:
        """Before the first gate (passed flat): how this rank's gate is grouped, rank 0's plan
        left for the others to check, and a group's store started on its first rank, which
        must be up before its peers pass that gate (``gradsync.checks.gate_groups``)."""
        watch, make_server = self.watch, self.make_server
        self._layout = gate_groups.plan(watch, self.group_size, make_server is not None)
        gate_groups.announce(watch, self._layout)
        if self._layout is not None and make_server is not None:
            self._server = gate_groups.serve(watch, self._layout, make_server)

    def _check_groups(self) -> str | None:
        """Past the first gate, before the keys are named through an agreed secret
        (``secure``), as rank 0's plan and the first ranks' addresses were written: the plan
        checked against rank 0's, and where this rank's group's store is."""
        gate_groups.same_plan(self.watch, self._layout)
        if self._layout is None:
            return None
        return gate_groups.address_of(self.watch, self._layout, self._server)

    def _set(self, store: Any, key: str) -> None:
        """Set ``key`` of the gate being passed (``_forget`` deletes it two gates on). A
        ``set`` is sent without waiting for an answer, but after any call in flight on the same
        client: behind one that a silent store left there, it is given up on the training
        thread (``answered.StoreSilent``) and tried again until the store answers or the gate
        fails for it."""
        while True:
            try:
                store.set(key, "1")
                break
            except answered.StoreSilent:
                self._store_silent()  # raises once the store has been silent for long enough
                time.sleep(0.05)
        self._passing.written.append((store, key))

    def _arrive(self, store: Any, members: range, me: int) -> None:
        """Set ``me``'s key of the gate being passed in ``store``, then wait for every one of
        ``members``' (the ranks; at the world's store of a grouped gate, the groups)."""
        name = self._passing.name
        self._set(store, f"{name}/at/{me}")
        self._await(store, [f"{name}/at/{m}" for m in members])

    def _arrive_grouped(self, group: gate_groups.Layout) -> None:
        """The gate in two levels (``gradsync.checks.gate_groups``): the group's first rank
        waits for its group, arrives at the world's store for it, then opens the group's."""
        watch, store, name = self.watch, self._group_store, self._passing.name
        if len(group.ranks) == 1:  # a group of one arrives at the world's store for itself
            self._arrive(watch.store, range(group.groups), group.index)
            return
        assert store is not None  # set with the group, past the first gate
        if watch.rank != group.ranks[0]:
            self._set(store, f"{name}/at/{watch.rank}")
            self._await_served(store, [f"{name}/go"], group.ranks[0])
            return
        self._arrive(store, group.ranks, watch.rank)
        self._arrive(watch.store, range(group.groups), group.index)
        self._set(store, f"{name}/go")

    def _forget(self, written: list[tuple[Any, str]]) -> None:
        """Delete the keys this rank set two gates back: every rank has passed that gate by
        now (a rank reaches this one only after all of them arrived at the previous one)."""
        self._history.append(written)
        if len(self._history) > 2:
            for store, key in self._history.pop(0):  # by the watchdog thread, off the step
                self.watch.discard([key], store=store)

    def _await(self, store: Any, keys: list[str]) -> None:
        """Until every one of ``keys`` is set in ``store``; the peers judged meanwhile (the
        module's docstring)."""
        watch = self.watch
        step, what = self._passing.step, self._passing.what
        started = time.monotonic()
        peers: dict[int, _Peer] = {}
        try:
            # The usual case: every rank arrives within moments, answered by one blocking wait.
            store.wait(keys, datetime.timedelta(seconds=watch.arrive_after_s))
            return
        except RuntimeError as exc:  # DistStoreError: nobody set it in that time
            if not transient_store_error(exc) and not isinstance(exc, answered.StoreSilent):
                raise SyncTimeoutError(
                    f"{where(step)}: {what}: the store holding the gate failed: {exc}"
                ) from exc
        # A long wait (an evaluation on a peer) polls instead: every store wait that times out
        # makes torch log a warning, which would fill stderr twice a second.
        all_here: float | None = None  # since when every peer's heartbeat says it is here
        here: set[int] = set()  # peers seen at this gate: not read again
        while True:
            judge_at = time.monotonic() + min(0.5, watch.beat_s)
            while time.monotonic() < judge_at:
                if self._opened(store, keys):
                    return
                if self._cancelled:
                    raise SyncTimeoutError(f"{where(step)}: {what}: the wait was cancelled")
                time.sleep(0.02)
            if self._store_silent():
                continue  # nothing can be read of the peers meanwhile
            reasons = self._judge(peers, started, here)
            all_here = (all_here or time.monotonic()) if not peers else None
            if all_here is not None and time.monotonic() - all_here >= self.timeout_s:
                reasons = [
                    "Every rank is at this gate, but it never opened: its keys in the store "
                    "were changed by a process outside this run (see README's trust model)."
                ]
            # A peer that passed already may have moved on by the time its beat was read.
            if reasons and not self._opened(store, keys):
                raise self._gave_up(peers, reasons, started)

    def _await_served(self, store: Any, keys: list[str], server: int) -> None:
        """A member's wait for its group's ``go``, made on the waiter's thread
        (``gate_groups.Waiter``: a frozen server never answers) and judged here meanwhile,
        ``server``, the rank serving the group's store, among the peers."""
        watch, waiter = self.watch, self._waiter
        step, what = self._passing.step, self._passing.what
        if waiter.abandoned:
            raise SyncTimeoutError(
                f"{where(step)}: {what}: this rank's gate group's store, served by rank "
                f"{server}, stopped answering at an earlier gate"
            )
        bound = datetime.timedelta(seconds=self.between_steps_s + self.timeout_s)
        waiter.start(lambda: store.wait(keys, bound))
        started = time.monotonic()
        peers: dict[int, _Peer] = {}
        here: set[int] = set()
        host = _Peer(alive_at=started, blamed_since=started)
        while True:
            ended, error = waiter.result(min(0.5, watch.beat_s))
            if ended:
                if error is not None:
                    raise self._served_failure(server, error) from error
                return
            try:
                if self._store_silent():
                    continue
            except SyncTimeoutError:
                waiter.abandoned = True  # its wait is still in flight: no later gate may take it
                raise
            reasons = self._judge(peers, started, here)
            if server not in peers:  # by its heartbeat it is here: is it still running?
                reasons += self._judge_server(server, host)
            if reasons or self._cancelled:
                waiter.abandoned = True
                if self._cancelled:
                    raise SyncTimeoutError(f"{where(step)}: {what}: the wait was cancelled")
                raise self._gave_up(peers, reasons, started)

    def _heard(self, rank: int, peer: _Peer, now: float) -> Beat | None:
        """``rank``'s heartbeat as it reads now (None where there is none), ``peer`` told when
        it last advanced."""
        try:
            beat = self.watch.beat_of(rank)
        except Exception:  # noqa: BLE001 - the store may be gone with the peer
            beat = None
        if beat is not None and (peer.beat is None or beat.seq != peer.beat.seq):
            peer.alive_at = now
        peer.beat = beat
        return beat

    def _judge_server(self, server: int, peer: _Peer) -> list[str]:
        """Why to give up on ``server``, at the gate by its last heartbeat but serving the
        store this rank waits at: silent, and not running (stopped, frozen, gone)."""
        watch, now = self.watch, time.monotonic()
        self._heard(server, peer, now)
        if now - peer.alive_at < watch.stale_s or self._busy(server):
            peer.blamed_since = now  # a rank holding the GIL: its store (C++) still serves
            return []
        reason = self._blame(server, peer, False, now)
        return [] if reason is None else [f"{reason} It serves this rank's gate group's store."]

    def _served_failure(self, server: int, error: BaseException) -> SyncTimeoutError:
        """The error of a member's wait that failed (its group's store gone with ``server``),
        naming that rank and what it left word of."""
        watch = self.watch
        step, what = self._passing.step, self._passing.what
        said = ""
        failed, ended = watch.failure_of(server), watch.ended_of(server)
        if failed is not None:
            said = f" Rank {server}'s step {failed[0]} block raised {failed[1]}."
        elif ended is not None:
            said = f" Rank {server}'s script ended ({ended[1]}) after step {ended[0]}."
        return SyncTimeoutError(
            f"{where(step)}: {what}: the store of this rank's gate group, served by rank "
            f"{server}, failed: {error}.{said}"
        )

    def _gave_up(self, peers: dict[int, _Peer], reasons: list[str], started: float) -> Exception:
        step, what = self._passing.step, self._passing.what
        waited = time.monotonic() - started
        return SyncTimeoutError(
            f"{where(step)}: {what} (waiting for every rank to arrive before the "
            f"collectives) failed after {waited:.1f}s (timeout {self.timeout_s:g}s; "
            f"{self.between_steps_s:g}s for a rank in its own code between steps): "
            f"never arrived: ranks {sorted(peers)}. " + " ".join(reasons)
        )

    @property
    def silence_limit_s(self) -> float:
        """How long the world's store may leave a call unanswered before the gate fails for
        it: ``timeout_s``, and never less than ``answered.ANSWER_S`` (a store on a loaded
        machine may take a moment; a stopped one never answers)."""
        return max(self.timeout_s, answered.ANSWER_S)

    def _store_silent(self) -> bool:
        """Whether the world's store is silent (its calls given up on this thread, its
        peers' heartbeats unreadable); its error once that has lasted ``silence_limit_s``."""
        silent = self.watch.store_silence()
        if silent >= self.silence_limit_s:
            raise self.silent_store_error()
        return silent >= answered.ANSWER_S

    def silent_store_error(self, step: int | None = None, what: str = "") -> SyncTimeoutError:
        """The error of the gate being passed (or of ``step``'s, ``what``) when the world's
        store stopped answering it (a stopped rank 0 serving it: ``gradsync.checks.answered``)."""
        if step is None:
            step, what = self._passing.step, self._passing.what
        return SyncTimeoutError(
            f"{where(step)}: {what} (waiting for every rank to arrive before the collectives) "
            f"failed (timeout {self.timeout_s:g}s): {self.watch.silent_store()}"
        )

    def _opened(self, store: Any, keys: list[str]) -> bool:
        """Whether the gate's ``keys`` are all set. A store call that fails for a moment (on an
        oversubscribed machine a socket read can give up with EAGAIN, issue 43 item 6) reads
        as "not yet": the peers' heartbeats, not one store call, decide when to give up."""
        try:
            return bool(store.check(keys))
        except RuntimeError as exc:
            if transient_store_error(exc) or isinstance(exc, answered.StoreSilent):
                return False  # a silent store: ``_store_silent`` decides when to give up
            step, what = self._passing.step, self._passing.what
            raise SyncTimeoutError(
                f"{where(step)}: {what}: the store holding the gate failed: {exc}"
            ) from exc

    def _judge(self, peers: dict[int, _Peer], started: float, here: set[int]) -> list[str]:
        """Update what is known of every rank not at the gate (``peers`` keeps only those);
        the reasons to give up, if any. A rank once seen at this gate (``here``) is not read
        again: its key is set, so it no longer holds the gate, wherever it goes next (with the
        gate waited ahead, into its forward pass). So a long wait for one late rank reads that
        rank's heartbeat alone, not every rank's: N reads a judging round across the world's
        waiting ranks instead of N squared."""
        watch, now = self.watch, time.monotonic()
        reasons = []
        for rank in range(watch.world_size):
            if rank == watch.rank or rank in here:
                continue
            peer = peers.setdefault(rank, _Peer(alive_at=started, blamed_since=started))
            beat = self._heard(rank, peer, now)
            gated = beat is not None and beat.phase in (GATE, USER_GATE)
            if gated and beat is not None and beat.detail == self._label:
                del peers[rank]  # here (or just passed): not one holding the gate
                here.add(rank)
                continue
            alive = beat is not None and now - peer.alive_at < watch.stale_s
            if alive and gated and beat is not None and (self._user or beat.phase == USER_GATE):
                reason = self._mismatch(rank, peer, beat, now)
                if reason is not None:
                    reasons.append(reason)
                continue
            peer.elsewhere_since = None
            if alive and beat is not None and beat.phase == BETWEEN:
                peer.blamed_since = now
                if now - started >= self.between_steps_s:
                    reasons.append(f"Rank {rank} is still {beat.place()}.")
                continue
            # Two beats missed is silence enough to ask the kernel: a peer that went back to its
            # own code and into a call holding the GIL may have last said it was in a wait.
            if now - peer.alive_at >= 2 * watch.beat_s and self._busy(rank):
                peer.blamed_since = now
                if now - started >= self.between_steps_s:
                    reasons.append(
                        f"Rank {rank} is busy in its own code: its process runs, but its "
                        f"heartbeat has not been written for {now - peer.alive_at:.0f}s (a call "
                        "that holds the GIL, such as a long C extension call)."
                    )
                continue
            reason = self._blame(rank, peer, alive, now)
            if reason is not None:
                reasons.append(reason)
        return reasons

    def _busy(self, rank: int) -> bool:
        """Whether silent ``rank`` is alive nonetheless: its process runs (by the kernel, or its
        voucher on another machine) and left no word of a failed block. Its heartbeat's last
        phase says nothing here: a step is often shorter than a beat, so a rank that went back
        to its own code and into a call holding the GIL may have last said it was in its block
        or at the previous gate."""
        watch = self.watch
        return (
            watch.failure_of(rank) is None
            and watch.ended_of(rank) is None
            and watch.running(rank) is True
        )

    def _mismatch(self, rank: int, peer: _Peer, beat: Beat, now: float) -> str | None:
        """``rank`` is alive at another gate, and this gate or that one comes before a
        collective of the user's code: why the wait ends, once that has lasted ``mismatch_s``."""
        if peer.elsewhere_since is None:
            peer.elsewhere_since = now
        if now - peer.elsewhere_since < self.mismatch_s:
            return None
        return (
            f"Rank {rank} is {beat.place()}, and neither rank can go on until the other comes "
            "to the same point: every rank must run the same collectives in the same order."
        )

    def _blame(self, rank: int, peer: _Peer, alive: bool, now: float) -> str | None:
        """Why ``rank`` (not at the gate, not in the user's code) ends the wait, or None yet."""
        failed = self.watch.failure_of(rank)
        beat = peer.beat
        if not alive and failed is not None:
            return (
                f"Rank {rank}'s step {failed[0]} block raised {failed[1]}, and it has not been "
                "heard from since (the exception was not caught there)."
            )
        ended = self.watch.ended_of(rank) if not alive else None
        if ended is not None:
            return (
                f"Rank {rank}'s script ended ({ended[1]}) after step {ended[0]}, its "
                "Synchronizer open: no more steps come from it (every rank must run the same "
                "steps; a rank that leaves its loop early leaves the others waiting)."
            )
        if now - peer.blamed_since < self.timeout_s:
            return None
        if beat is None:
            return f"Rank {rank} has not been heard from."
        if not alive:
            return (
                f"Rank {rank} stopped responding {now - peer.alive_at:.0f}s ago, last "
                f"{beat.place()} (stopped, frozen or gone)."
            )
        return f"Rank {rank} is {beat.place()}."


__all__ = ["DEFAULT_BETWEEN_STEPS_S", "StepGate"]
