"""The step gate passed ahead of the step's first collective, on a thread of its own.

Why: the gate (``gradsync.checks.gate``) goes to the store on rank 0 at every step (then two
round trips: an ``add``, then a ``set`` or a ``wait``; since 2026-11-30 a ``set`` nothing
answers and a ``wait``). Waited at the block's entry, they were on the critical path of every
step: ``benchmarks.gate`` measured +12% of a 2.2 ms step on 2 ranks and
+7% of a 27 ms step on 8 (issue 44). What the gate guarantees only needs every rank to be
there before gradsync *posts* its first collective of the step, and under ``bsp`` and
``zero:1``/``zero:2`` that comes from the backward pass. So at the block's entry the wait is
handed to this thread, and the strategy joins it just before its first collective
(``SyncContext.before_collective``): the forward pass, and the backward up to the first
bucket, hide the round trips, and a step where every rank arrives together pays the join.
Under ``bsp`` a bucket ready before the gate has opened is not posted then: the reducer asks
``SyncContext.collective_ready`` (``poll``, which does not wait) at each gradient's hook and
posts what is ready once it answers yes, or at the block's end, which joins. So the backward
pass goes on while a peer is still on its way, where it used to stop at its first bucket until
that peer arrived (DDP's backward never stops for a peer: its all-reduce waits instead).

What stays as it was: gradsync posts a collective of the step only once every rank is at the
gate, and gradsync's collective timeout (``timeout_s``) is put on the group only then (the
Synchronizer does it at the join): a collective the user's code posts inside the block before
that runs under the group's own timeout, as it would between steps. The wait itself, its
bounds and its messages are the gate's own (``StepGate.wait``); its error is raised on the
thread that joins, and again at every later join of the same step, so nothing is posted after
a failed gate. Strategies whose collectives come first in the block (``zero:3``'s forward) or
at times of their own (periodic averages) keep the gate waited where it is.
"""

from __future__ import annotations

import queue
import threading

from gradsync.checks import answered
from gradsync.checks.gate import StepGate

#: how long ``stop`` waits for a gate wait in flight to give up (it polls every 20 ms once its
#: first blocking wait, at most ``ArrivalWatch.arrive_after_s``, has ended)
_STOP_WAIT_S = 5.0

#: how often a joining thread waiting for the gate comes back to the interpreter. A signal sent
#: to the process (a Ctrl-C to the run's process group) may be taken by any of its threads, the
#: gate's own among them; Python then runs its handler on the main thread only when that thread
#: next executes bytecode, so an untimed wait here kept a worker waiting out the gate's bound
#: (and the launcher its 30 s grace) with its KeyboardInterrupt unraised.
_SIGNAL_CHECK_S = 0.1


class GateAhead:
    """One Synchronizer's gate waits begun at ``arm`` and finished at ``join``.

    The hand-over is two ``queue.SimpleQueue``s (a job in, its error or None out), not a
    ``threading.Condition``: twice a step on a step that is all host overhead (issue 44), the
    condition's Python (a lock made per wait, its waiter list, notify) and the extra lock
    hand-overs between the two threads showed in the profile; a queue's put and get are one
    C call each."""

    def __init__(self, gate: StepGate) -> None:
        self.gate = gate
        self._jobs: queue.SimpleQueue[tuple[int, str] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._pending = False  # armed and not joined
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # arm and stop, from different threads at exit
        self._stopping = False
        #: the error that left the thread in a silent store's call, for every later wait
        self._stranded: BaseException | None = None

    @property
    def pending(self) -> bool:
        """Whether a wait was armed and not joined yet."""
        return self._pending

    def arm(self, step: int, what: str) -> None:
        """Begin the gate at ``step`` (``what`` names it in messages) and return at once."""
        if self._pending:
            raise RuntimeError("a gate wait is already armed: join() it first")
        if self._stranded is not None:
            try:
                self._done.get_nowait()  # the late end of the wait given up on: dropped
            except queue.Empty:  # the thread is still inside a silent store's call
                self._error, self._pending = self._stranded, False
                return
            self._stranded = None
        if self._thread is None:
            with self._lock:
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="gradsync-gate", daemon=True)
                self._thread.start()
        self._error = None
        self._pending = True
        self._jobs.put((step, what))

    def join(self) -> None:
        """Until the armed wait has ended; its error (``SyncTimeoutError``) if it failed, and
        again at every call until the next ``arm``. Nothing to do when nothing is armed.

        The thread's store calls cannot be given up (``gradsync.checks.answered``): where the
        world's store has left them unanswered for ``StepGate.silence_limit_s``, the wait fails
        here and the thread is left in its call; every later ``arm`` fails at once with the
        same error, until the thread is back from it (the store answered again)."""
        if self._pending:
            watch, gate = self.gate.watch, self.gate
            while True:
                try:
                    error = self._done.get(timeout=_SIGNAL_CHECK_S)
                except queue.Empty:
                    if watch.store_silence() < gate.silence_limit_s:
                        continue
                    error = self._stranded = gate.silent_store_error()
                break
            self._pending, self._error = False, error
        if self._error is not None:
            raise self._error

    def poll(self) -> bool:
        """Whether the armed wait has ended, without waiting for it (its error raised as
        ``join`` raises it); True when nothing is armed."""
        if self._pending:
            try:
                error = self._done.get_nowait()
            except queue.Empty:
                return False
            self._pending, self._error = False, error
        if self._error is not None:
            raise self._error
        return True

    def _run(self) -> None:
        answered.free_to_block()  # ``join`` reads the store's clock instead
        while True:
            job = self._jobs.get()
            if job is None or self._stopping:  # a job handed over before stop() is not begun
                return
            try:
                self.gate.ensure(*job)
            except BaseException as exc:  # noqa: BLE001 - raised on the joining thread
                self._done.put(exc)
            else:
                self._done.put(None)

    def stop(self) -> None:
        """End the thread (at ``close()`` and at exit: it must not run on into the
        interpreter's shutdown, issue 49); a wait in flight is cancelled."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stopping = thread is not None
        self.gate.cancel()
        if thread is None:
            return
        self._jobs.put(None)
        if self._stranded is None and thread is not threading.current_thread():
            thread.join(_STOP_WAIT_S)


__all__ = ["GateAhead"]
