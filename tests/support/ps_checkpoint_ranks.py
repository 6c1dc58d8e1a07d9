"""Rank functions for the parameter-server checkpoint tests (importable by spawned ranks)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

import gradsync as gs
from gradsync.checkpoint.store import CheckpointError
from gradsync.workloads import make_workload
from tests.support.ranks import flat_params

PER_RANK = 4
STEPS = 6
SAVE_AT = 3
SPECS = ("ssp:0", "ssp:1")


def _sync(spec: str, servers: int = 1) -> tuple[Any, torch.nn.Module, gs.Synchronizer]:
    # Momentum: the servers' optimizer state must come back for the trajectory to continue.
    w = make_workload("mlp", seed=5, params=3000, dtype="float64")
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sync = gs.Synchronizer(model, opt, strategy=spec, servers=servers, timeout_s=20)
    return w, model, sync


def _train(spec: str, directory: Path, *, resume: bool) -> dict[str, Any]:
    """Train to STEPS, saving after step SAVE_AT (fresh) or starting from that save (resume)."""
    w, model, sync = _sync(spec)
    start = 0
    if resume:
        extra = sync.load(directory)
        assert extra is not None
        start = int(extra["step"])
    if sync.is_server:
        out: dict[str, Any] = {"server": sync.serve(), "start": start}
        sync.close()
        return out
    # ssp:0 with every worker on the same batch: both pushes of a round carry the same
    # gradient, so the order in which the server applies them (which changes the result under
    # momentum) cannot matter and the trajectory is deterministic.
    shard = 0 if spec == "ssp:0" else sync.rank
    for step in range(start, STEPS):
        with sync.step(samples=PER_RANK):
            x, y = w.batch(
                step, PER_RANK * sync.num_workers, shard * PER_RANK, (shard + 1) * PER_RANK
            )
            w.loss(model, x, y).backward()
        if not resume and step + 1 == SAVE_AT:
            sync.save(directory, data_position=step + 1)
    report = sync.report()
    sync.close()
    return {
        "params": flat_params(model),
        "start": start,
        "steps": sorted((r.rank, r.step) for r in report.records),
    }


def first_run(rank: int, world: int, root: str) -> dict[str, Any]:
    return {spec: _train(spec, Path(root) / spec, resume=False) for spec in SPECS}


def _refusal(spec: str, directory: Path, servers: int) -> str:
    _, _, sync = _sync(spec, servers=servers)
    try:
        sync.load(directory)
    except CheckpointError as exc:
        return str(exc)
    finally:
        sync.close()
    return "loaded"


def second_run(rank: int, world: int, root: str) -> dict[str, Any]:
    """Resume both runs in a fresh group, then try the ssp:1 checkpoint on another layout of
    the same number of ranks (1 worker + 2 servers): refused on every rank."""
    out: dict[str, Any] = {spec: _train(spec, Path(root) / spec, resume=True) for spec in SPECS}
    out["two servers"] = _refusal("ssp:1", Path(root) / "ssp:1", servers=2)
    return out


def more_ranks(rank: int, world: int, root: str) -> str:
    return _refusal("ssp:1", Path(root) / "ssp:1", servers=1)


def _files(directory: Path) -> dict[int, list[str]]:
    """The rank files of every step in ``directory``, by step."""
    return {
        int(d.name.split("-")[1]): sorted(f.name for f in d.glob("rank-*.pt"))
        for d in sorted(directory.glob("step-*"))
    }


def held_and_flushed(rank: int, world: int, root: str) -> dict[str, Any] | None:
    """``async``, 2 workers and a server saving after every step: the writers hold the
    snapshots (the server's too), a worker's ``wait_for_checkpoints`` makes the server write
    its newest, a save that waits makes it write that one, and a save into another
    directory first has the old one's newest written (rank 0 waits for it there)."""
    w, model, sync = _sync("async")
    a, b = Path(root) / "a", Path(root) / "b"
    if sync.is_server:
        sync.serve()
        sync.close()
        return None
    from gradsync.checkpoint.store import CheckpointStore

    def train(step: int) -> None:
        with sync.step(samples=PER_RANK):
            x, y = w.batch(step, PER_RANK * 2, rank * PER_RANK, (rank + 1) * PER_RANK)
            w.loss(model, x, y).backward()

    latest: dict[str, Any] = {}
    for step in range(4):
        train(step)
        sync.save(a, keep=10, wait=False)
    sync.wait_for_checkpoints(timeout_s=15)
    latest["a after flush"] = CheckpointStore(a).latest().step if rank == 0 else None
    latest["a files"] = _files(a)
    # The server's snapshot of each step came before it applied any later push (a request
    # rides on the next push, or on a message of its own when a flush comes first).
    pushes: dict[int, Any] = {}
    latest["a server pushes"] = pushes
    if rank == 0:  # the one that waited for the commits
        store = CheckpointStore(a)
        pushes |= {step: store.load(store.at(step), 2)["server"]["pushed"] for step in (1, 4)}
    for step in (4, 5):  # b's first snapshot is a file, its second held
        train(step)
        sync.save(b, keep=10, wait=False)
    train(6)
    sync.save(a, keep=10, wait=False)  # back to a: b's newest is written first
    latest["b after switch"] = CheckpointStore(b).latest().step if rank == 0 else None
    train(7)
    sync.save(a, keep=10, wait=True)  # held otherwise: the writer's second snapshot
    latest["a after durable save"] = CheckpointStore(a).latest().step if rank == 0 else None
    for step in (8, 9):  # saves 9 and 10, each request riding on the next push
        train(step)
        sync.save(a, keep=10, wait=False)
    train(10)
    sync.wait_for_checkpoints(timeout_s=15)
    if rank == 0:
        store = CheckpointStore(a)
        pushes[10] = store.load(store.at(10), 2)["server"]["pushed"]
    # Two saves at each step into two directories: a request still in flight for one must
    # not be written into the other, which rank 0 has named meanwhile.
    c, d = Path(root) / "c", Path(root) / "d"
    for step in (11, 12):
        train(step)
        sync.save(c, keep=10, wait=False)
        sync.save(d, keep=10, wait=False)
    sync.wait_for_checkpoints(timeout_s=15)
    if rank == 0:
        latest["c and d"] = [CheckpointStore(x).latest().step for x in (c, d)]
    sync.report()
    sync.close()
    return latest


def _save_every_step(steps: int, root: str, *, lost: int | None = None) -> gs.Synchronizer:
    """``async`` with 2 workers and a server, each worker saving after each of ``steps``
    steps without waiting (worker ``lost`` dies right after its last save; the others then
    take one step more); the server serves (and raises when a worker is lost)."""
    w, model, sync = _sync("async")
    if sync.is_server:
        sync.serve()
        sync.close()
        return sync
    for step in range(steps + (lost is not None)):
        with sync.step(samples=PER_RANK):
            x, y = w.batch(step, PER_RANK * 2, sync.rank * PER_RANK, (sync.rank + 1) * PER_RANK)
            w.loss(model, x, y).backward()
        sync.save(Path(root) / "ckpt", wait=False)
        if step + 1 == steps and sync.rank == lost:
            os._exit(3)  # as a kill would: no clean-up, no result
    return sync


def closed_without_report(rank: int, world: int, root: str) -> int | None:
    """The workers close after 3 saves, as after an exception, without ``report()``: the
    newest step is committed all the same (the close tells the servers to write theirs)."""
    sync = _save_every_step(3, root)
    closed = Path(root) / "rank-0-closed"
    if rank == 0:
        sync.close()
        from gradsync.checkpoint.store import CheckpointStore

        closed.touch()
        info = CheckpointStore(Path(root) / "ckpt").latest()
        return info.step if info is not None else None
    sync.close()
    # Stay until rank 0 has closed: a worker that leaves ends the server, which then takes
    # the newest checkpoint itself (``checkpoint_on_loss``) and would hide a missing flush.
    deadline = time.monotonic() + 40
    while not closed.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return None


def lost_after_a_save(rank: int, world: int, root: str) -> None:
    """Worker 1 dies right after its save of step 3, before the push that would have asked
    for it; worker 0 pushes step 4 (asking for 3) and then fails with the server."""
    _save_every_step(3, root, lost=1)
