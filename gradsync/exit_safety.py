"""A finished run exits 0: nothing gloo's threads do can abort the interpreter's shutdown.

The cause (issue 49, found with a core dump of the aborting rank, "terminate called without an
active exception", SIGABRT): a gloo worker thread completes a collective whose future carries a
Python callback (``Future.then(fn)``: every comm hook and the bucket reducer's span recorder).
It runs the callback, marks the child future done, and only then destroys the callback, which
takes the GIL to drop its reference to ``fn``. The main thread, which waited on the child
future, may meanwhile have finished the script and begun finalizing the interpreter; a thread
taking the GIL then is ended with ``pthread_exit``, whose unwinding through a ``noexcept`` C++
destructor calls ``std::terminate``. The window is a few microseconds after the last exchange of
the script, so it opens under CPU load whatever the script does at its end (``report()``,
``destroy_process_group()`` or nothing). A second, rarer path is the same thread dropping the last
reference to a collective's tensors (freeing a tensor Python has seen needs the GIL too).

What this module does about it, without reading interpreter internals:

- ``then(future, fn)`` attaches ``fn`` as ``future.then`` would, and remembers the callback
  object by a weak reference: it dies exactly when gloo's thread has destroyed it.
- ``keep(name, work)`` keeps a collective that may still be in flight when the script ends (the
  last telemetry gather, the final handshake's barrier) referenced from the main thread.
- ``stop_at_exit(stop)`` stops a thread of gradsync's own (the heartbeat) at exit, before it
  could return from a store call into a finalizing interpreter.
- An ``atexit`` handler, which runs before the interpreter starts finalizing (a thread can still
  take the GIL then), waits until every tracked callback is gone and every kept collective is
  complete, bounded by ``DRAIN_TIMEOUT_S`` (a stopped peer leaves its collectives incomplete:
  then a notice names them and the exit goes on; after an uncaught exception the bound is
  ``FAILED_DRAIN_S``, so a failed rank's exit is not held). If ``gs.init()`` made the process
  group, it is then destroyed, which joins gloo's threads: none is left running at
  finalization.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["DRAIN_TIMEOUT_S", "drain", "keep", "own_the_group", "stop_at_exit", "then"]

log = logging.getLogger("gradsync.exit")

#: the longest the exit waits for collectives still in flight (a peer still finishing its last
#: step under load takes seconds; a dead peer never answers)
DRAIN_TIMEOUT_S = 30.0
#: the same after an uncaught exception
FAILED_DRAIN_S = 1.0


class _Callback:
    """``fn`` behind an object of our own, so that a weak reference tells when it is freed."""

    __slots__ = ("fn", "__weakref__")

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, fut: Any) -> Any:
        return self.fn(fut)


_callbacks: weakref.WeakSet[_Callback] = weakref.WeakSet()
#: what stops gradsync's own threads (weakly held: a closed Synchronizer is not kept alive)
_stoppers: list[weakref.WeakMethod[Callable[[], None]]] = []
_kept: dict[str, Any] = {}
_owned_group = False
_registered = False
_lock = threading.Lock()


def _register() -> None:
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_at_exit)
            _registered = True


def then(future: Any, fn: Callable[[Any], Any]) -> Any:
    """``future.then(fn)``, with the callback tracked until gloo has destroyed it."""
    _register()
    callback = _Callback(fn)
    _callbacks.add(callback)
    return future.then(callback)


def keep(name: str, work: Any) -> None:
    """Keep ``work`` (an object with ``is_completed()``, or one holding such a ``work``)
    referenced here until the process exits; a later ``keep`` of the same ``name`` replaces it."""
    _register()
    _kept[name] = work


def stop_at_exit(stop: Callable[[], None]) -> None:
    """Call the bound method ``stop`` at exit, before the wait: it stops and joins a thread of
    gradsync's (the heartbeat), which would otherwise run on into the interpreter's shutdown
    and, returning from a store call there, abort the same way."""
    _register()
    # Synchronizers come and go in one process (a test suite): drop the dead ones as we go.
    _stoppers[:] = [ref for ref in _stoppers if ref() is not None]
    _stoppers.append(weakref.WeakMethod(stop))  # type: ignore[arg-type]


def own_the_group() -> None:
    """``gs.init()`` made the default process group: destroy it at exit if still there."""
    global _owned_group
    _register()
    _owned_group = True


def _in_flight() -> list[str]:
    waiting = [f"a callback of {_describe(c.fn)}" for c in list(_callbacks)]
    for name, held in _kept.items():
        work = getattr(held, "work", held)
        if not work.is_completed():
            waiting.append(name)
    return waiting


def _describe(fn: Callable[[Any], Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def drain(timeout_s: float = DRAIN_TIMEOUT_S) -> list[str]:
    """Wait until no tracked callback is alive and every kept collective is complete; what is
    still in flight after ``timeout_s`` (empty when everything finished)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0005
    while (waiting := _in_flight()) and time.monotonic() < deadline:
        time.sleep(pause)  # releases the GIL: gloo's threads need it to finish
        pause = min(pause * 2, 0.05)
    return waiting


def _stop_threads() -> None:
    for ref in list(_stoppers):
        stop = ref()
        if stop is not None:
            try:
                stop()
            except Exception as exc:  # the exit goes on
                log.debug("stopping a thread at exit failed: %s", exc)
    _stoppers.clear()


def _at_exit() -> None:
    # A second Ctrl-C while the process already exits (the terminal's and the launcher's both
    # come) asks for what is under way: a traceback of it ("Exception ignored in atexit
    # callback") was all it added to the run's one-line stop. It comes as a KeyboardInterrupt,
    # or as SystemExit(130) where gradsync's launch turned interrupts into exits
    # (``processes.launch._on_interrupt``).
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        _exit_cleanly()


def _exit_cleanly() -> None:
    _stop_threads()
    # An uncaught exception ends the script (Python set sys.last_value as it printed it): its
    # collectives may never complete, and holding a failed rank's exit only delays the restart.
    failed = getattr(sys, "last_value", None) is not None
    bound = FAILED_DRAIN_S if failed else DRAIN_TIMEOUT_S
    waiting = drain(bound)
    if waiting:
        log.log(
            logging.DEBUG if failed else logging.WARNING,
            "exiting with collectives still in flight after %.0fs (%s): a peer may have "
            "died; the exit may abort",
            bound,
            ", ".join(waiting),
        )
        return
    if _owned_group:
        _destroy_the_group()


def _destroy_the_group() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # the exit goes on; the group is then freed at finalization
        log.debug("destroying the process group at exit failed: %s", exc)
