"""Launches that mostly wait, started together so that their waits overlap.

Some tests spend their seconds waiting, not computing: a rank sleeping past the gate's
timeout, a timeout running out, a peer kept away (tests/ranks), a run waiting out its
--timeout after a worker was stopped (tests/e2e). Run one after the other, those waits add up;
each launch is independent of the others (a ``run_ranks`` has its own store, process group and
ranks; a ``gradsync run`` its own processes and ports), so a module-scoped fixture can start a
file's such launches at once, each on a thread of its own, and each test then takes its own
launch's result, or has its error raised. What each test asserts is unchanged; the fixture
waits for every launch before the module ends, so nothing is left running. A ``gradsync run``
or ``torchrun`` launch of a few ranks also leaves a core of the 2 idle much of its time (its
imports, its agent's waits, its exit: about one core's worth of CPU time over its wall time,
measured), so independent launches that nothing times are overlapped too. Launches that time
their own steps (a straggler judged, a stall bounded), or whose resume step depends on how far
a background writer got before a kill (KILLED_BSP's, tests/support/shared_runs.py), are left to
run alone, as are the tests after a fixture's launches where needed (``Overlapped.wait``)."""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gradsync.testing import run_ranks


def ranks(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """``run_ranks(fn, world_size, *args, **kwargs)``, to be started by ``overlapped``."""
    return functools.partial(run_ranks, fn, world_size, *args, **kwargs)


class Overlapped:
    """The launches started by ``overlapped``, by name."""

    def __init__(self, futures: dict[str, Future[Any]]) -> None:
        self._futures = futures

    def result(self, name: str) -> Any:
        """Launch ``name``'s result, once it has ended (its exception raised here)."""
        return self._futures[name].result()

    def wait(self) -> None:
        """Until every launch has ended, raising nothing (each test takes its own launch's
        error from ``result``): for a fixture whose tests, or the tests after them, must not
        run beside its launches (a launch timed, or one whose writer's progress is asserted)."""
        wait_all(self._futures.values())


@contextmanager
def overlapped(launches: dict[str, Callable[[], Any]]) -> Iterator[Overlapped]:
    """Every launch started at once, each on a thread of its own (each a ``run_ranks`` call,
    bounded by its own ``timeout_s``); on exit, every launch waited for."""
    pool = ThreadPoolExecutor(max_workers=len(launches), thread_name_prefix="overlapped-launch")
    try:
        yield Overlapped({name: pool.submit(launch) for name, launch in launches.items()})
    finally:
        pool.shutdown(wait=True)


def run_dir(proc: subprocess.CompletedProcess[str]) -> Path:
    """The run directory a ``gradsync run`` launch was given (its first ``--out``)."""
    return Path(proc.args[proc.args.index("--out") + 1])
