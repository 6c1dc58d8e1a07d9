"""Hang diagnosis: when a synchronizing wait times out, say who never arrived.

Recording every arrival in the store would cost a round trip on every step. Instead a
watchdog thread records, once a wait has lasted ``arrive_after_s``, the furthest step at which
this rank has waited (one key per rank): the ranks waiting at a hung barrier all record
themselves within seconds, the rank that hangs never does. A rank that got one step further
(its part of a ring all-reduce finished before the link died) is stuck at the next step and
records that, which counts as having arrived at every earlier one. When the wait finally
fails (torch.distributed's own timeout, or a peer that vanished), the error names the step,
the collective, the ranks that arrived and those that did not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

from gradsync.errors import SyncTimeoutError

T = TypeVar("T")
_PREFIX = "gradsync/arrive"


def default_store() -> Any | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class ArrivalWatch:
    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        store: Any | None = None,
        arrive_after_s: float | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.store = store if store is not None else default_store()
        self.arrive_after_s = (
            arrive_after_s if arrive_after_s is not None else min(2.0, timeout_s / 4)
        )
        self._waiting: tuple[int, float] | None = None
        self._recorded: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _key(self, rank: int) -> str:
        return f"{_PREFIX}/{rank}"

    def _run(self) -> None:
        tick = max(0.05, min(0.5, self.arrive_after_s / 4))
        while not self._stop.wait(tick):
            with self._lock:
                waiting = self._waiting
            if waiting is None or self.store is None:
                continue
            step, since = waiting
            if self._recorded != step and time.monotonic() - since >= self.arrive_after_s:
                try:
                    self.store.set(self._key(self.rank), str(step))
                    self._recorded = step
                except Exception:  # noqa: BLE001 - a dead store must not kill training
                    pass

    @contextmanager
    def waiting(self, step: int) -> Iterator[None]:
        if self._thread is None and self.store is not None and self.world_size > 1:
            self._thread = threading.Thread(target=self._run, name="gradsync-arrivals", daemon=True)
            self._thread.start()
        with self._lock:
            self._waiting = (step, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._waiting = None

    def run(self, step: int, what: str, wait: Callable[[], T]) -> T:
        """Run ``wait()``; turn its failure into a ``SyncTimeoutError`` naming absent ranks."""
        started = time.monotonic()
        with self.waiting(step):
            try:
                return wait()
            except (RuntimeError, dist.DistBackendError) as exc:
                waited = time.monotonic() - started
                self._record_failure(step)
                raise SyncTimeoutError(self.describe(step, what, waited, exc)) from exc

    def _record_failure(self, step: int) -> None:
        """A wait that failed fast (a peer vanished) left no time for the watchdog: record
        this rank's arrival now and give the other survivors a moment to record theirs."""
        if self.store is None:
            return
        try:
            self.store.set(self._key(self.rank), str(step))
        except Exception:  # noqa: BLE001 - the store may have died with the peer
            return
        time.sleep(min(1.0, self.arrive_after_s))

    def describe(self, step: int, what: str, waited: float, exc: BaseException) -> str:
        arrived, absent = self.arrivals(step)
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        who = (
            f"arrived: ranks {arrived}; never arrived: ranks {absent}"
            if arrived
            else "no arrival records (the store is unreachable or the wait failed at once)"
        )
        return (
            f"step {step}: {what} failed after {waited:.1f}s "
            f"(timeout {self.timeout_s:.0f}s): {who}. Cause: {cause}"
        )

    def arrivals(self, step: int) -> tuple[list[int], list[int]]:
        arrived = [self.rank]
        if self.store is not None:
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                try:
                    key = self._key(r)
                    if self.store.check([key]) and int(self.store.get(key)) >= step:
                        arrived.append(r)
                except Exception:  # noqa: BLE001 - diagnosis is best effort
                    break
        arrived.sort()
        absent = [r for r in range(self.world_size) if r not in arrived]
        return arrived, absent

    def close(self) -> None:
        self._stop.set()
