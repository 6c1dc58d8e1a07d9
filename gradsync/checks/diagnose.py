"""Hang diagnosis: every synchronizing wait is bounded, and a wait that fails says who never came.

The bound is the Synchronizer's ``timeout_s``, made the collective timeout of its process group
(``GroupTimeout``) for as long as it is open: the backend itself then fails any collective that
waits longer, on gloo within the timeout and with the group's connections closed, so nothing is
left running that would keep the process alive past the error, and later collectives on the
group fail at once. (Abandoning a wait on the Python side instead would leave the collective
pending until the group's own, possibly much longer, timeout: the process could not exit
before it.) On NCCL the same timeout arms the watchdog, which by default tears the process
down itself, so the diagnosis may not get printed there.

Recording every arrival in the store would cost a round trip on every step. Instead a
watchdog thread records, once a wait has lasted ``arrive_after_s``, the furthest position at
which this rank has waited (one key per rank): the ranks waiting at a hung collective all
record themselves within seconds, the rank that hangs never does. A rank that got one step
further (its part of a ring all-reduce finished before the link died) is stuck at the next
wait and records that, which counts as having arrived at every earlier one.

A position is ``(step, n)``: the n-th consecutive wait at that step. Every rank runs the same
collectives in the same order, so positions agree across ranks even where several waits share
a step (an exchange, a telemetry gather and a divergence check after the same step) and a rank
that stopped after the first of them is not counted as having arrived at the later ones. Waits
before the first step use ``START``; those after the last (the final check and gathers of
``report()``) use ``END``, which orders after every step.

The same thread also publishes a heartbeat every ``beat_s``: where this rank is (between steps
in the user's code, inside its step block, at a step gate, in a wait) and a counter that
advances as long as the process runs. ``gradsync.checks.gate`` reads it to tell a peer busy in
the user's code (an evaluation on rank 0) from one that hangs or is gone. The thread needs the
GIL, so a silent peer may be holding it, not gone. Each rank therefore publishes its process's
identity once (``gradsync.checks.liveness``): a peer on this machine is asked of the kernel.
Where some peer is on another machine, each rank also starts a voucher at its first gate
(``gradsync.checks.voucher``), a process beside it that writes whether it runs: a peer on
another machine reads that.

Every key lives in the store under a name hashed with the run's secret
(``gradsync.checks.secret``), so that no other process can address the keys to come.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from gradsync import compat
from gradsync.checks import answered, liveness, secret, voucher
from gradsync.errors import DivergenceError, SyncTimeoutError

T = TypeVar("T")
_PREFIX = "gradsync/arrive"
#: position of waits before step 0 (the initial broadcast of parameters)
START = -1
#: position of waits after the last step (report()'s final check and gathers)
END = 1 << 62

Position = tuple[int, int]

#: phases a heartbeat names (see ``ArrivalWatch.enter``); ``USER_GATE``: at a gate before a
#: collective that the user's own code posts between steps (a forward of a ``zero:3`` model)
BETWEEN, BLOCK, GATE, WAIT, USER_GATE = "between", "block", "gate", "wait", "user-gate"


@dataclass(frozen=True, slots=True)
class Beat:
    """A peer's last heartbeat: ``seq`` advances while it lives; ``phase`` at ``step``
    (``detail``: the wait's name, or the gate's number)."""

    seq: int
    phase: str
    step: int
    detail: str

    @classmethod
    def parse(cls, value: bytes | str) -> Beat:
        text = value.decode() if isinstance(value, bytes) else value
        seq, phase, step, detail = text.split("|", 3)
        return cls(int(seq), phase, int(step), detail)

    def place(self) -> str:
        """Where the peer is, in words."""
        if self.phase == BETWEEN:
            if self.step == START:
                return "in its own code before step 0"
            return f"in its own code between steps {self.step} and {self.step + 1}"
        if self.phase == BLOCK:
            if self.detail:
                return f"in {self.detail} ({where(self.step)})"
            return f"inside its step {self.step} block"
        if self.phase in (GATE, USER_GATE):
            return f"waiting to begin {self.detail}"
        return f"at {where(self.step)} in {self.detail or 'a wait'}"


def where(step: int) -> str:
    """How a message names a wait's step."""
    if step == START:
        return "before step 0"
    if step == END:
        return "end of run"
    return f"step {step}"


class GroupTimeout:
    """Holds ``group``'s collective timeout at ``seconds`` until ``restore()``.

    ``seconds`` is what the timeout really is afterwards: the requested value, or the group's
    own where its backend cannot be changed (then that one bounds every wait, and messages
    say so)."""

    def __init__(self, group: dist.ProcessGroup | None, seconds: float) -> None:
        self.group = group
        self.previous = compat.collective_timeout(group)
        # Looked up once: enter() and leave() run at every step (issue 44).
        self._backends = compat.backends(group)
        self._ours = datetime.timedelta(seconds=seconds)
        self._theirs = (
            datetime.timedelta(seconds=self.previous) if self.previous is not None else None
        )
        self.applied = compat.set_backends_timeout(self._backends, self._ours)
        self.seconds = seconds if self.applied or self.previous is None else self.previous

        #: whether ``seconds`` is in force now (between ``enter`` and ``leave``)
        self.inside = self.applied

    def enter(self) -> None:
        """gradsync's own collectives follow: bound them by ``seconds``."""
        if self.applied and not self.inside:
            self.inside = compat.set_backends_timeout(self._backends, self._ours)

    def leave(self) -> None:
        """Back to the user's code: their own timeout bounds their collectives."""
        if self.applied and self.inside and self._theirs is not None:
            compat.set_backends_timeout(self._backends, self._theirs)
            self.inside = False

    def restore(self) -> None:
        self.leave()
        self.applied = False


def _parse(value: bytes | str) -> Position:
    text = value.decode() if isinstance(value, bytes) else value
    step, _, n = text.partition(":")
    return int(step), int(n or 0)


class ArrivalWatch:
    """Turns the failure of a synchronizing wait into a ``SyncTimeoutError`` naming the step,
    the collective, the ranks that arrived and the ranks that never did."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        store: Any | None = None,
        arrive_after_s: float | None = None,
        scope: str = "",
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        plain: Any = store if store is not None else compat.default_store()
        self._raw_tcp = voucher.tcp_store(plain)
        #: every call on the world's store server, from every thread (``checks.answered``); a
        #: store that is no TCPStore has no server to stop, and is not timed
        self.clock = None if self._raw_tcp is None else answered.clock_of(self._raw_tcp)
        self._plain_store: Any = (
            plain if self.clock is None else answered.TimedStore(plain, self.clock)
        )
        #: the store, its keys named through the run's secret where this process has one
        self.store: Any = secret.keyed(self._plain_store, secret.from_environment())
        self._identities: dict[int, str] = {}
        #: ranks whose heartbeat key is known to exist (``beat_of``)
        self._beating: set[int] = set()
        self.arrive_after_s = (
            arrive_after_s if arrive_after_s is not None else min(2.0, timeout_s / 4)
        )
        # Synchronizers on different process groups sharing one store keep separate records.
        self._prefix = f"{_PREFIX}/{scope}" if scope else _PREFIX
        self._position: Position | None = None  # of the latest wait begun on this rank
        self._waiting: tuple[Position, float, str] | None = None
        self._recorded: Position | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: how often the heartbeat is written; a peer silent for ``stale_s`` is not running
        self.beat_s = min(1.0, max(0.05, timeout_s / 4))
        self.stale_s = max(3 * self.beat_s, 1.0)
        self._phase: tuple[str, int, str] = (BETWEEN, START, "")
        self._beats = 0
        #: keys to delete from the watchdog thread, each with its store (None: this watch's)
        self._garbage: list[tuple[Any | None, str]] = []
        #: this rank's voucher, where a peer is on another machine (started by ``gathered``)
        self._voucher: voucher.Claim | None = None
        self._gathered = False
        self._vouches: dict[int, voucher.Vouch] = {}
        #: the store vouchers write to: under every prefix, where they and this rank agree
        tcp, clock = self._raw_tcp, self.clock
        self._tcp = None if tcp is None or clock is None else answered.TimedStore(tcp, clock)

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    @property
    def tcp_store(self) -> Any | None:
        """The TCPStore under this watch's store, or None where it is none (a FileStore)."""
        return self._raw_tcp

    def store_silence(self) -> float:
        """How long the world's store has left a call unanswered beyond what the calls in
        flight may take (``answered.Clock.silent_s``): a stopped or frozen server. Always 0.0
        for a store that is no TCPStore."""
        return 0.0 if self.clock is None else self.clock.silent_s()

    def silent_store(self) -> str:
        """What a wait that gave up on a silent world's store says of it: where it is, and
        rank 0's process (the likeliest server) as the kernel tells where rank 0 is on this
        machine (its voucher writes into the silent store itself)."""
        tcp = self._raw_tcp
        at = f" at {tcp.host}:{tcp.port}" if tcp is not None else ""
        said = (
            f"The world's store{at} has not answered a request for "
            f"{self.store_silence():.0f}s: its server is stopped, frozen or cut off."
        )
        state = liveness.running(self._identities.get(0, ""))
        if state is True:
            return said + " Rank 0's process is running: the store is served elsewhere."
        rank0 = (
            "Rank 0's process is not running (stopped, a zombie or gone)"
            if state is False
            else "Rank 0's process cannot be asked from here (another machine, or its identity "
            "was never read)"
        )
        return (
            f"{said} {rank0}: where rank 0 serves the store (gradsync run --max-restarts, a "
            "process group made with env:// or tcp:// outside torchrun), a stopped rank 0 "
            "stops it."
        )

    @property
    def prefix(self) -> str:
        """Where this watch's records live in the store (other records of it go beside)."""
        return self._prefix

    # -- heartbeat --------------------------------------------------------------------------
    def enter(self, phase: str, step: int, detail: str = "") -> None:
        """Say where this rank is now (a plain assignment: the thread publishes it)."""
        self._phase = (phase, step, detail)

    @property
    def phase(self) -> tuple[str, int, str]:
        """Where this rank is now, as ``enter`` last said: (phase, step, detail)."""
        return self._phase

    def start(self) -> None:
        """Start the watchdog thread (arrival records and the heartbeat), once."""
        if self._thread is None and self.store is not None and self.world_size > 1:
            # From this thread, before any peer can wait for this rank at a gate: a rank that
            # goes on into a call holding the GIL may never let the watchdog thread write it.
            self._publish_identity()
            with contextlib.suppress(Exception):  # without it, a voucher is started everywhere
                self.store.add(self._machine_key(), 1)
            self._thread = threading.Thread(target=self._run, name="gradsync-arrivals", daemon=True)
            self._thread.start()

    @property
    def secured(self) -> bool:
        """Whether this watch's keys are named through a run secret."""
        return isinstance(self.store, secret.KeyedStore)

    def secure(self) -> None:
        """Name this watch's keys through a secret agreed over the world's process group, where
        none was given (a script that made its group itself, under plain torchrun). A
        collective on the world group: called by every rank at the same point (the first step
        gate), and only where this watch's ranks are the whole world."""
        if self.secured or self._plain_store is None or self.world_size == 1:
            return
        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            return  # a subgroup's watch: its peers alone could not take part in a collective
        self.store = secret.KeyedStore(self._plain_store, secret.agree(None))
        self._beating.clear()  # their keys have new names: none is known to exist yet
        self._publish_identity()
        if self._voucher is not None:
            self._voucher.rename(self._vouch_key(self.rank))

    def _publish_identity(self) -> None:
        with contextlib.suppress(Exception):  # best effort: without it a peer is judged by beats
            self.store.set(f"{self._prefix}/process/{self.rank}", liveness.identity())

    def _machine_key(self) -> str:
        """The count of this watch's ranks on this rank's machine."""
        return f"{self._prefix}/machine/{liveness.machine()}"

    def _vouch_key(self, rank: int) -> str:
        """Where ``rank``'s voucher writes in the TCPStore itself (named through the secret)."""
        key = f"{self._prefix}/vouch/{rank}"
        return self.store.name(key) if isinstance(self.store, secret.KeyedStore) else key

    def gathered(self) -> None:
        """Every rank is at a gate, so each has started its watch (and counted itself on its
        machine): the first time, start this rank's voucher if a peer is on another machine.
        Before ``secure()``: the counts were made under the names in use before it."""
        if self._gathered or self.store is None or self.world_size == 1:
            return
        self._gathered = True
        try:
            here = int(self.store.add(self._machine_key(), 0))
        except Exception:  # noqa: BLE001 - without a count, assume a peer elsewhere
            here = 0
        if here < self.world_size and liveness.machine():
            self._voucher = voucher.claim(self._raw_tcp, self._vouch_key(self.rank), self.beat_s)
        self._identity(0)  # read now: rank 0 may serve the store, whose silence then names it

    @property
    def vouching(self) -> bool:
        """Whether this rank's voucher has written (peers on other machines can read it)."""
        return self._voucher is not None and self.vouched(self.rank) is not None

    def running(self, rank: int) -> bool | None:
        """Whether ``rank``'s process still runs (not stopped, not a zombie, not gone), asked
        of the kernel on this machine, else of its voucher; None where neither can tell."""
        here = liveness.running(self._identity(rank))
        return here if here is not None else self.vouched(rank)

    def _identity(self, rank: int) -> str:
        if rank not in self._identities:
            key = f"{self._prefix}/process/{rank}"
            try:
                if self.store is None or not self.store.check([key]):
                    return ""
                self._identities[rank] = self.store.get(key).decode()
            except Exception:  # noqa: BLE001 - the store may be gone with the peer
                return ""
        return self._identities[rank]

    def vouched(self, rank: int) -> bool | None:
        """Whether ``rank``'s voucher says its process runs (``gradsync.checks.voucher``); None
        where it has written nothing (no peer on another machine, or not started yet)."""
        key = self._vouch_key(rank)
        try:
            if self._tcp is None or not self._tcp.check([key]):
                return None
            value = self._tcp.get(key)
            vouch = self._vouches.setdefault(rank, voucher.Vouch())
            return vouch.running(value, time.monotonic(), self.stale_s)
        except Exception:  # noqa: BLE001 - the store may be gone with the peer
            return None

    def _beat(self) -> None:
        with self._lock:
            waiting = self._waiting
        phase, step, detail = self._phase
        if waiting is not None:
            (step, _), _, detail = waiting
            phase = WAIT
        self._beats += 1
        self.store.set(f"{self._prefix}/beat/{self.rank}", f"{self._beats}|{phase}|{step}|{detail}")

    def beat_of(self, rank: int) -> Beat | None:
        """``rank``'s last heartbeat, or None when it has written none. One request once it
        has written one (a beat is never deleted), two before (a ``get`` of a key not there
        would wait for it)."""
        key = f"{self._prefix}/beat/{rank}"
        if self.store is None:
            return None
        if rank not in self._beating:
            if not self.store.check([key]):
                return None
            self._beating.add(rank)
        return Beat.parse(self.store.get(key))

    def discard(self, keys: list[str], store: Any | None = None) -> None:
        """Delete ``keys`` from ``store`` (this watch's where None) soon, from the watchdog
        thread."""
        self._garbage.extend((store, key) for key in keys)

    def forget_store(self, store: Any) -> None:
        """Drop the deletions queued for ``store`` (a gate group's, let go of at close: the
        queue would keep its server listening)."""
        with self._lock:
            self._garbage = [(s, key) for s, key in self._garbage if s is not store]

    def _collect_garbage(self) -> None:
        while self._garbage:
            store, key = self._garbage.pop(0)
            (self.store if store is None else store).delete_key(key)

    def note_failure(self, step: int, text: str) -> None:
        """Leave word that this rank's step ``step`` failed (its block raised), for the peers'
        messages; best effort."""
        self._leave_word("failed", step, text)

    def note_ended(self, step: int, how: str) -> None:
        """Leave word that this rank's script has ended (``how``: returned, ``sys.exit(0)``)
        with its Synchronizer open after step ``step``, and stop the heartbeat: a process that
        lingers after its script (``gradsync run``'s worker waits for its peers to finish)
        would otherwise look alive between steps, and a peer at a gate would wait for it up
        to ``between_steps_timeout_s``. Best effort."""
        self._leave_word("ended", step, how)
        self.close()

    def failure_of(self, rank: int) -> tuple[int, str] | None:
        """The step and the words of ``rank``'s last failure note, if it left one."""
        return self._word_of("failed", rank)

    def ended_of(self, rank: int) -> tuple[int, str] | None:
        """The step and the words of ``rank``'s note that its script ended, if it left one."""
        return self._word_of("ended", rank)

    def _leave_word(self, kind: str, step: int, text: str) -> None:
        if self.store is not None and self.world_size > 1:
            with contextlib.suppress(Exception):
                self.store.set(f"{self._prefix}/{kind}/{self.rank}", f"{step}|{text}")

    def _word_of(self, kind: str, rank: int) -> tuple[int, str] | None:
        key = f"{self._prefix}/{kind}/{rank}"
        try:
            if self.store is None or not self.store.check([key]):
                return None
            step, _, text = self.store.get(key).decode().partition("|")
            return int(step), text
        except Exception:  # noqa: BLE001 - diagnosis is best effort
            return None

    def _record(self, position: Position, what: str = "") -> None:
        if self.store is None:
            return
        # The wait's name first, under its own key: whoever reads the position then finds the
        # name of that wait (or a later one) beside it.
        self.store.set(self._key(self.rank) + "/what", what)
        self.store.set(self._key(self.rank), f"{position[0]}:{position[1]}")
        self._recorded = position

    def _run(self) -> None:
        answered.free_to_block()  # nothing waits for this thread; a silent store only stops it
        tick = max(0.05, min(0.5, self.arrive_after_s / 4, self.beat_s / 2))
        next_beat = 0.0
        while not self._stop.wait(tick):
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.beat_s
                with contextlib.suppress(Exception):  # a dead store must not kill training
                    self._beat()
                    self._collect_garbage()
            with self._lock:
                waiting = self._waiting
            if waiting is None:
                continue
            position, since, what = waiting
            if self._recorded != position and time.monotonic() - since >= self.arrive_after_s:
                with contextlib.suppress(Exception):  # a dead store must not kill training
                    self._record(position, what)

    def next_position(self, step: int | None) -> Position:
        """The position of a wait about to begin at ``step`` (None: the latest wait's step)."""
        last = self._position
        if step is None:
            step = last[0] if last is not None else START
        position = (step, last[1] + 1) if last is not None and last[0] == step else (step, 0)
        self._position = position
        return position

    @contextmanager
    def waiting(self, position: Position, what: str = "") -> Iterator[None]:
        self.start()
        with self._lock:
            outer = self._waiting
            self._waiting = (position, time.monotonic(), what)
        try:
            yield
        finally:
            with self._lock:
                self._waiting = outer

    def run(self, step: int | None, what: str, wait: Callable[[], T]) -> T:
        """Run ``wait()`` (collectives and the wait for them) as the next wait at ``step``
        (None: at the latest wait's step); turn its failure into a ``SyncTimeoutError``."""
        position = self.next_position(step)
        started = time.monotonic()
        with self.waiting(position, what):
            try:
                return wait()
            except (SyncTimeoutError, DivergenceError):
                raise  # already diagnosed (a nested wait), or not a failed wait at all
            except (RuntimeError, dist.DistBackendError) as exc:
                waited = time.monotonic() - started
                self._record_failure(position, what)
                raise SyncTimeoutError(self.describe(position, what, waited, exc)) from exc

    @contextmanager
    def in_block(self, step: int, what: str) -> Iterator[None]:
        """The user's block as one wait at ``step``, for a strategy whose collectives run inside
        it (FSDP2's gathers under ``zero:3``): a collective that fails there becomes a
        ``SyncTimeoutError`` naming the ranks that never arrived; other exceptions pass."""
        position = self.next_position(step)
        started = time.monotonic()
        with self.waiting(position, what):
            try:
                yield
            except (RuntimeError, dist.DistBackendError) as exc:
                if isinstance(exc, SyncTimeoutError | DivergenceError) or not _failed_collective(
                    exc
                ):
                    raise
                waited = time.monotonic() - started
                self._record_failure(position, what)
                raise SyncTimeoutError(self.describe(position, what, waited, exc)) from exc

    def _record_failure(self, position: Position, what: str) -> None:
        """A wait that failed fast (a peer vanished) left no time for the watchdog: record
        this rank's arrival now and give the other survivors a moment to record theirs."""
        try:
            self._record(position, what)
        except Exception:  # noqa: BLE001 - the store may have died with the peer
            return
        if self.store is not None:
            time.sleep(min(1.0, self.arrive_after_s))

    def describe(
        self, position: int | Position, what: str, waited: float, exc: BaseException
    ) -> str:
        pos = (position, 0) if isinstance(position, int) else position
        arrived, absent, readable = self._arrivals(pos)
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        who = f"arrived: ranks {arrived}; never arrived: ranks {absent}"
        if not readable:
            who = (
                f"arrived: ranks {arrived}; the others are unknown (the store holding arrival "
                "records could not be read)"
            )
        raised = "".join(
            f" Rank {r}'s step {failed[0]} block raised {failed[1]}."
            for r, failed in ((r, self.failure_of(r)) for r in absent)
            if failed is not None
        )
        silent = f" {self.silent_store()}" if self.store_silence() >= answered.ANSWER_S else ""
        return (
            f"{where(pos[0])}: {what} failed after {waited:.1f}s "
            f"(timeout {self.timeout_s:g}s): {who}.{raised}{self._elsewhere(pos, what)}"
            f"{silent} Cause: {cause}"
        )

    def _elsewhere(self, pos: Position, what: str) -> str:
        """Where each rank is waiting, when some are not at this very wait: ranks in different
        collectives or steps (one called only on some ranks, such as sync.save() on rank 0)."""
        places = {self.rank: (pos, what)}
        for r in range(self.world_size):
            if r == self.rank or self.store is None:
                continue
            try:
                key = self._key(r)
                if self.store.check([key]):
                    at = _parse(self.store.get(key))
                    if at >= pos:  # arrived; an older record is a rank that never did
                        named = self.store.check([key + "/what"])
                        places[r] = (at, self.store.get(key + "/what").decode() if named else "")
            except Exception:  # noqa: BLE001 - diagnosis is best effort
                return ""
        if len(set(places.values())) < 2:
            return ""
        each = "; ".join(
            f"rank {r} at {where(p[0])} in {w or 'a wait'}" for r, (p, w) in sorted(places.items())
        )
        return (
            f" The ranks are not all in the same collective: {each}. A collective called on "
            "some ranks only (sync.save() or report() on rank 0 alone, a skipped step) does this."
        )

    def arrivals(self, position: int | Position) -> tuple[list[int], list[int]]:
        """Ranks recorded at ``position`` or further (this one included), and the rest."""
        arrived, absent, _ = self._arrivals(
            (position, 0) if isinstance(position, int) else position
        )
        return arrived, absent

    def _arrivals(self, pos: Position) -> tuple[list[int], list[int], bool]:
        arrived = [self.rank]
        readable = self.store is not None
        if self.store is not None:
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                try:
                    key = self._key(r)
                    if self.store.check([key]) and _parse(self.store.get(key)) >= pos:
                        arrived.append(r)
                except Exception:  # noqa: BLE001 - diagnosis is best effort
                    readable = False
                    break
        arrived.sort()
        absent = [r for r in range(self.world_size) if r not in arrived]
        return arrived, absent, readable

    def close(self) -> None:
        self._stop.set()
        if self._voucher is not None:
            self._voucher.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close and wait (at most ``timeout_s``) for the heartbeat thread to end: at exit, a
        thread returning from a store call into a finalizing interpreter aborts the process
        (``gradsync.exit_safety``). The voucher is waited for too, so none is left behind."""
        self.close()
        if self._voucher is not None:
            self._voucher.stop()
        thread = self._thread
        if self.store_silence() >= answered.ANSWER_S:
            return  # the thread is inside a call that a silent store will not end
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)


#: what gloo's and NCCL's errors say when a collective's peer is gone or late
_COLLECTIVE_FAILURES = ("Timed out", "timed out", "Connection closed", "Connection reset", "NCCL")


def _failed_collective(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed (a backend error, a gloo or NCCL timeout or a
    closed connection) rather than an error of the user's own code."""
    if isinstance(exc, dist.DistBackendError):
        return True
    return any(text in str(exc) for text in _COLLECTIVE_FAILURES)
