"""The world's store with its calls timed, and bounded on the threads that must not hang.

Why: torch's TCPStore client does not give up on a server that stopped answering. Against a
SIGSTOPped server, a ``get`` and a new connection stayed blocked past their timeouts (2026-12-01,
torch 2.13: a client made with a 2 s timeout, still blocked after 8 s; torch logs that the poll
timed out, then keeps waiting), as did the gate's ``wait`` and ``check`` (a stopped rank 0's
peers, found blocked there). And one blocked call holds the client's lock, so every other
thread's call on that client, a ``set`` included, waits behind it. Where rank 0's
own process serves the world's store (``gradsync run --max-restarts``, a script that makes its
process group with ``env://`` or ``tcp://`` itself, ``mp.spawn``), a stopped rank 0 therefore
left every peer blocked for ever: in the step gate, and after a collective that timed out, in
the store reads that name who never arrived. The client has no way to cancel a call, so the
call is left where it is and the thread that needs the answer stops waiting for it:

- every call through :class:`TimedStore` is timed on the :class:`Clock` of its server (one per
  server address in the process, :func:`clock_of`, shared by every Synchronizer's watch), which
  says how long the store has gone unanswered past what the calls in flight may take
  (:meth:`Clock.silent_s`: a ``wait``'s own timeout, nothing for the others). The step gate's
  thread blocks in the store as before (:func:`free_to_block`); the training thread that joins
  it reads the clock and gives up after ``timeout_s`` of silence, and never under
  :data:`ANSWER_S` (``gradsync.checks.gate_ahead``);
- a call from any other thread (the training thread's own reads and writes: the gate waited in
  place, the records of a failed collective, the notes a rank leaves) runs on a courier thread,
  and its caller waits until the store has been silent for :data:`ANSWER_S` beyond the calls'
  own timeouts; then it raises :class:`StoreSilent`, and so does every later one at once while
  the store stays silent.

What this does not cover: torch's own calls on the same client (a ``new_group``'s barrier, the
process group's set-up) are neither timed nor bounded; and a thread left in a call (the gate's,
the heartbeat's, a courier) returns from it only if the server answers or goes, which may be
while this process exits: the exit may then abort, as ``gradsync.exit_safety`` says of
collectives left in flight. Only a TCPStore is timed: a FileStore or a HashStore has no server
to stop.

What this costs the usual step (``python -m benchmarks.store_calls``, BENCHMARKS.md, on this
2-core machine): the timing adds 0.5 us to a call, made twice a step by the gate's thread under
``bsp``. A call handed to the courier took 48 us against 6 us made directly from the main
thread (TCPStore ``check`` on loopback). The training thread hands over each call it makes
itself: none a step under ``bsp``, the gate's two under the strategies that wait for it in
place (``zero:3``'s every step, the periodic ones' at their averages). Side by side by hand,
9 launches each alternated, ``zero:3`` on a 3,000-parameter mlp on 2 ranks took a median
12.8 ms a step after against 13.0 ms before: not visible at that spread.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: how long a store may leave a request unanswered, beyond the request's own timeout, before it
#: is taken for silent: a store on a loaded machine answers in milliseconds; a stopped server
#: never does
ANSWER_S = 3.0

_local = threading.local()


def free_to_block() -> None:
    """Mark the calling thread as one whose store calls may block for as long as the store
    takes (a thread nothing waits for, or one whose joiner reads the clock)."""
    _local.free = True


def _bounded_here() -> bool:
    return not getattr(_local, "free", False)


class StoreSilent(RuntimeError):
    """A store call that was given up: the store has not answered within its bound."""


class Clock:
    """The calls in flight on one store server, from every thread and client of this process,
    and when one last ended; and the courier that makes the bounded ones."""

    def __init__(self) -> None:
        #: thread ident -> (when its call began, how long that call may take by itself)
        self._in_flight: dict[int, tuple[float, float]] = {}
        self._answered_at = time.monotonic()
        self._courier: _Courier | None = None
        self._lock = threading.Lock()

    def forget_threads(self) -> None:
        """Start afresh in a forked child (``_forget_threads_in_child``)."""
        self._in_flight = {}
        self._courier = None
        self._lock = threading.Lock()
        self._answered_at = time.monotonic()

    def courier(self) -> _Courier:
        """The courier to hand a call to: a new one where the last was abandoned or retired."""
        with self._lock:
            courier = self._courier
            if courier is None or courier.retired:
                courier = self._courier = _Courier(self._lock)
            return courier

    def abandon(self, courier: _Courier) -> None:
        """``courier``'s thread stays in its call: the next call gets another."""
        with self._lock:
            if self._courier is courier:
                self._courier = None

    def begin(self, bound_s: float) -> None:
        self._in_flight[threading.get_ident()] = (time.monotonic(), bound_s)

    def end(self) -> None:
        self._in_flight.pop(threading.get_ident(), None)
        self._answered_at = time.monotonic()

    def silent_s(self) -> float:
        """How long the store has left a call unanswered beyond what the calls in flight may
        take (0.0 while none is in flight or none is overdue). Calls on one client are served
        one at a time, so a call queued behind a long ``wait`` is not overdue until that wait
        is: the largest bound in flight counts for all (for calls on other clients of the same
        server too, which only delays a verdict)."""
        calls = list(self._in_flight.values())
        if not calls:
            return 0.0
        since = max(min(began for began, _ in calls), self._answered_at)
        return max(0.0, time.monotonic() - since - max(bound for _, bound in calls))


#: how long a courier waits for its next call before its thread ends (the next call starts
#: another): a process that makes many Synchronizers keeps no idle thread per store
_IDLE_S = 2.0


class _Courier:
    """A thread that makes the bounded calls, one at a time; abandoned (and replaced at the
    next call) when a call outlasts its bound, and ended once idle for ``_IDLE_S``."""

    def __init__(self, lock: threading.Lock) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.retired = False
        self._lock = lock  # its store's: a call is handed over only to a courier not retired
        thread = threading.Thread(target=self._run, name="gradsync-store-courier", daemon=True)
        thread.start()

    def _run(self) -> None:
        free_to_block()  # its caller does the bounding
        while True:
            try:
                job = self.jobs.get(timeout=_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self.jobs.empty():
                        self.retired = True
                        return
                continue
            job()


class TimedStore:
    """``store`` (the methods gradsync's checks use) with each call timed on ``clock``, and
    bounded where the calling thread is not :func:`free_to_block`."""

    def __init__(self, store: Any, clock: Clock, answer_s: float = ANSWER_S) -> None:
        self.store = store
        self.clock = clock
        self.answer_s = answer_s

    def _call(self, fn: Callable[[], T], bound_s: float = 0.0) -> T:
        if _bounded_here():
            return self._bounded(fn, bound_s)
        clock = self.clock
        clock.begin(bound_s)
        try:
            return fn()
        finally:
            clock.end()

    def _bounded(self, fn: Callable[[], T], bound_s: float) -> T:
        silent = self.clock.silent_s()
        if silent >= self.answer_s:
            raise StoreSilent(f"the store has not answered for {silent:.1f}s")
        box: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

        def job() -> None:
            try:
                box.put((True, self._call(fn, bound_s)))
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
                box.put((False, exc))

        courier = self.clock.courier()
        courier.jobs.put(job)  # a courier retires only with its queue empty, under the lock
        while True:
            try:
                ok, value = box.get(timeout=0.05)
            except queue.Empty:
                # Not a deadline of its own: behind another thread's long wait on the same
                # client, this call waits as long, and the clock counts that wait's bound.
                silent = self.clock.silent_s()
                if silent < self.answer_s:
                    continue
                self.clock.abandon(courier)
                raise StoreSilent(f"the store has not answered for {silent:.1f}s") from None
            if ok:
                return value  # type: ignore[no-any-return]
            raise value

    def set(self, key: str, value: str | bytes) -> None:
        self._call(lambda: self.store.set(key, value))

    def get(self, key: str) -> bytes:
        return bytes(self._call(lambda: self.store.get(key)))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(lambda: self.store.add(key, amount)))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call(lambda: self.store.check(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._call(lambda: self.store.delete_key(key)))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:  # the store's own timeout bounds it, as torch has it
            self._call(lambda: self.store.wait(keys), self._own_timeout_s())
        else:
            self._call(lambda: self.store.wait(keys, timeout), timeout.total_seconds())

    def _own_timeout_s(self) -> float:
        own = getattr(self.store, "timeout", None)
        return own.total_seconds() if isinstance(own, datetime.timedelta) else 0.0


#: (host, port) -> the clock of that store server, for every watch of this process
_CLOCKS: dict[tuple[str, int], Clock] = {}
_CLOCKS_LOCK = threading.Lock()


def _forget_threads_in_child() -> None:
    """In a forked child: the parent's calls in flight and couriers are not this process's
    (their threads are not here), and a clock that counted them would take the store for
    silent, or hand calls to a courier that never runs."""
    global _CLOCKS_LOCK
    _CLOCKS_LOCK = threading.Lock()
    for clock in _CLOCKS.values():
        clock.forget_threads()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads_in_child)


def clock_of(tcp_store: Any) -> Clock:
    """The clock of ``tcp_store``'s server (a ``dist.TCPStore``), shared by every watch of this
    process: calls on one client wait behind each other whichever watch made them, and a
    server that stopped answering one client answers no other."""
    where = (str(tcp_store.host), int(tcp_store.port))
    with _CLOCKS_LOCK:
        clock = _CLOCKS.get(where)
        if clock is None:
            clock = _CLOCKS[where] = Clock()
        return clock


__all__ = ["ANSWER_S", "Clock", "StoreSilent", "TimedStore", "clock_of", "free_to_block"]
