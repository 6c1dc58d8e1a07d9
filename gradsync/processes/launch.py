"""Local multi-process launch through torch's elastic agent (the machinery behind torchrun).

``gradsync run --nproc N`` and ``torchrun --nproc_per_node=N`` start workers the same way:
c10d rendezvous on a loopback store with a free port, the same environment variables, the
same restart semantics; so a worker that runs under one runs under the other.

Two things differ, both for the process gradsync runs in, not for the workers' view: the
rendezvous is torch's c10d rendezvous under gradsync's name (``gradsync.processes.stores``), because
torch's own binds its stores to every interface whatever host it is given, and a reaper kills a
stopped worker the agent has asked to exit (``gradsync.processes.reaper``), because the agent would
wait
30 seconds for it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from gradsync import compat
from gradsync.errors import UsageError
from gradsync.processes import forkserver, stores, task_limit
from gradsync.processes.reaper import StoppedWorkerReaper

LOOPBACK = "127.0.0.1"
#: ``gradsync.checks.secret.SECRET_ENV`` (processes/ imports no other package of gradsync)
RUN_SECRET_ENV = "GRADSYNC_RUN_SECRET"


def launch(
    entrypoint: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    nproc: int,
    threads: int = 1,
    max_restarts: int = 0,
    host: str = LOOPBACK,
    run_id: str | None = None,
    log_dir: str | None = None,
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc`` worker processes; return each rank's return value.

    Every store of the run listens on ``host`` only (loopback by default: torch.distributed has
    no authentication, so nothing listens beyond this machine unless asked), and gloo too on
    loopback. Port 0 lets the store pick a free port. Raises torch's ``ChildFailedError`` when a
    worker fails and the restarts are spent.
    """
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    if threads < 1:
        raise UsageError(f"--threads must be at least 1, got {threads}")
    if max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {max_restarts}")
    task_limit.check_room(nproc, threads)  # a rank short of a thread fails far from the cause
    # Children inherit the environment at spawn: cap intra-op threads before torch starts there.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["GRADSYNC_THREADS"] = str(threads)
    if max_restarts > 0:
        # With the rendezvous store shared into the workers, a restarted round can read the
        # previous round's gloo addresses and fail to connect (pytorch/pytorch#135712): give
        # each round a fresh store hosted by its rank 0 instead.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if host == LOOPBACK and "lo" in (name for _, name in socket.if_nameindex()):
        # gloo listens on the address this machine's host name resolves to, which need not be
        # loopback: keep its sockets where the stores are.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    stores.register_rendezvous()
    # The secret first: the start method compares this environment with the forkserver's.
    with _run_secret():
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=run_id or uuid.uuid4().hex[:12],
            rdzv_backend=stores.RENDEZVOUS_BACKEND,
            rdzv_endpoint=f"{host}:0",
            rdzv_configs={"timeout": 120, "is_host": True},
            max_restarts=max_restarts,
            monitor_interval=0.1,
            start_method=forkserver.start_method(),
            local_addr=host,
        )
        if log_dir is not None:
            from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

            config.logs_specs = DefaultLogsSpecs(log_dir=log_dir)
        stopped_by_signal = False
        try:
            with StoppedWorkerReaper():
                return elastic_launch(config, _recorded)(entrypoint, *args)
        except BaseException as exc:
            stopped_by_signal = compat.elastic_signal(exc) is not None
            raise
        finally:
            stores.close_rendezvous(stopped_by_signal=stopped_by_signal)


@functools.cache
def _process_secret() -> str:
    """The secret this process hands its runs' workers (drawn on first use)."""
    return secrets.token_hex(16)


@contextlib.contextmanager
def _run_secret() -> Iterator[None]:
    """The run's secret, which names gradsync's keys in the run's store (gradsync.checks.secret),
    in the environment the workers start with, which other users cannot read (a command line
    they can). One per launching process, not per launch: forked workers inherit the
    environment the forkserver started with, and a variable that changed since makes every
    later launch spawn instead (gradsync compare launches once per strategy); each run has its
    own store anyway. Taken out again afterwards, so this process's own later code (a test
    suite, a script that launches) does not see a secret its stores were not named with. A
    secret the user set stays."""
    if RUN_SECRET_ENV in os.environ:
        yield
        return
    os.environ[RUN_SECRET_ENV] = _process_secret()
    try:
        yield
    finally:
        os.environ.pop(RUN_SECRET_ENV, None)


@record
def _recorded(entrypoint: Callable[..., Any], *args: Any) -> Any:
    """Runs in each worker: ``@record`` writes an uncaught exception to torch's error file, so
    the launcher can say which rank failed and why instead of pointing at a URL."""
    _leave_quietly_on_interrupt()
    _RUNNING.add(os.getpid())
    try:
        return entrypoint(*args)
    except KeyboardInterrupt:
        _leaving_on_interrupt()
        raise SystemExit(128 + signal.SIGINT) from None
    finally:
        _RUNNING.discard(os.getpid())


#: the worker processes inside their entrypoint (by pid: a process forked there is not)
_RUNNING: set[int] = set()
_INSTALLED_BY: list[int] = []


def _leave_quietly_on_interrupt() -> None:
    """A Ctrl-C in a terminal reaches every process of the run, and the launcher's agent stops
    the workers and says so. A worker that left by ``KeyboardInterrupt`` would also print
    multiprocessing's ``Process ForkServerProcess-1:`` and a traceback (about one run in seven
    here). Inside the entrypoint the interrupt stays a ``KeyboardInterrupt``, for the user's
    code to catch, and one that escapes it becomes ``SystemExit(130)``, which unwinds through
    the same ``finally`` blocks without a word; outside it (the launcher's own code around it)
    the signal leaves that way at once. A handler the user's module set at import is kept,
    and processes forked from a worker (a DataLoader's) get the interrupt as before."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    _INSTALLED_BY[:] = [os.getpid()]
    signal.signal(signal.SIGINT, _on_interrupt)


def _on_interrupt(signum: int, frame: Any) -> None:
    pid = os.getpid()
    if pid not in _INSTALLED_BY or pid in _RUNNING:
        raise KeyboardInterrupt
    _leaving_on_interrupt()
    raise SystemExit(128 + signum)


def _leaving_on_interrupt() -> None:
    """The worker is leaving on a Ctrl-C: a second SIGINT must not interrupt the exit itself.
    One that came during the exit (from the agent, we suppose; not confirmed) raised from an
    ``atexit`` callback, which printed "Exception ignored in atexit callback" and a traceback
    (once in six CI runs of tests/e2e/test_stopped_worker.py, 2026-12-01)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
