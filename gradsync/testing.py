"""Run a function as several ranks of a real gloo process group, for tests and examples.

Each rank is a process joined through a TCPStore that the caller's process serves on
127.0.0.1 with a port the system picks (nothing to collide on, nothing beyond loopback). The
caller gets every rank's return value, or an error naming the rank that failed; a hard
deadline kills every child, so a deadlocked collective fails the test instead of hanging it.

The ranks are forked from multiprocessing's forkserver, which imports torch once
(``gradsync.processes.forkserver``) and lives as long as the caller's process, where workers may be
forked
(``forkserver.available``: Linux without a visible GPU); elsewhere they are spawned. Why: a spawned
rank imported torch and, at its first optimizer, torch._dynamo, about 1.7 s of a core each here,
before it did anything; the test suite took 704 s with spawned ranks and 429 s with forked ones.
Each rank takes the caller's environment as it is at the call (a forked rank would otherwise have
the forkserver's, from when it started), but what torch read from the environment while the server
imported it stays as it read it then (``TORCH_DISTRIBUTED_DEBUG``, OpenMP's ``OMP_NUM_THREADS``): a
test that needs those changed cannot have them here. The ranks share one string hash seed, which
spawned ranks would each draw (``gradsync.processes.forkserver``).
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradsync.processes import forkserver
from gradsync.processes.stores import server_store


class RankFailure(RuntimeError):
    pass


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    store_port: int,
    args: tuple[Any, ...],
    results: Any,
    collective_timeout_s: float,
    environ: dict[str, str],
) -> None:
    # A forkserver's child starts with the server's environment, from when the server started,
    # not the caller's now: take the caller's, as a spawned child would have. (multiprocessing
    # sets its working directory and sys.path to the caller's itself.)
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    try:
        # A TCPStore rather than a FileStore: gradsync's gates wait on store keys every step,
        # and a FileStore's wait polls every 10 ms.
        store = dist.TCPStore(
            "127.0.0.1",
            store_port,
            world,
            is_master=False,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        out = fn(rank, world, *args)
        results.put((rank, True, _to_bytes(out)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _to_bytes(value: Any) -> bytes:
    # Plain serialisation: tensors sent through a torch queue travel as shared-memory handles
    # that vanish when the child exits before the parent reads them.
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _context() -> Any:
    if not forkserver.available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Only the first call, before the server starts, counts. Unlike a launch, the ranks here
    # take the caller's environment themselves (``_child``), so any server will do.
    ctx.set_forkserver_preload(forkserver.PRELOAD)
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 90.0,
    collective_timeout_s: float = 60.0,
    allow_failures: bool = False,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable (module level). With ``allow_failures`` a failed rank's slot holds
    a ``RankFailure`` instead of raising, for tests of failure paths.
    """
    ctx = _context()
    results = ctx.Queue()
    server = server_store("127.0.0.1", 0, timeout=datetime.timedelta(seconds=collective_timeout_s))
    try:
        procs = [
            ctx.Process(
                target=_child,
                args=(
                    fn,
                    r,
                    world_size,
                    server.port,
                    args,
                    results,
                    collective_timeout_s,
                    dict(os.environ),
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        try:
            while len(out) < world_size:
                left = (deadline - datetime.datetime.now()).total_seconds()
                if left <= 0:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f}s")
                try:
                    rank, ok, value = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if r not in out and p.exitcode not in (None, 0)
                    ]
                    for r in dead:
                        out[r] = RankFailure(f"rank {r} died with exit code {procs[r].exitcode}")
                    continue
                out[rank] = (
                    _from_bytes(value) if ok else RankFailure(f"rank {rank} failed:\n{value}")
                )
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    finally:
        del server  # its listening socket closes with it: nothing is left listening
    ordered = [out[r] for r in range(world_size)]
    failures = [v for v in ordered if isinstance(v, RankFailure)]
    if failures and not allow_failures:
        raise failures[0]
    return ordered
