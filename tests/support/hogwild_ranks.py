"""Rank functions for the hogwild tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

import gradsync as gs
from gradsync.strategies.hogwild import FILE_PREFIX, SHM_DIR, Hogwild
from gradsync.workloads import make_workload
from tests.support.ranks import flat_params

PER_RANK = 8


def leftovers() -> list[str]:
    """Shared files of hogwild still in /dev/shm (there must never be any after setup)."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(FILE_PREFIX))


def _setup(
    workload: str, params: int = 2000, **kw: Any
) -> tuple[Any, torch.nn.Module, gs.Synchronizer]:
    w = make_workload(workload, seed=7, params=params)
    model = w.build_model()
    opt = w.make_optimizer(model, w.default_lr)
    sync = gs.Synchronizer(model, opt, strategy="hogwild", timeout_s=30, **kw)
    return w, model, sync


def _step(
    w: Any, model: torch.nn.Module, sync: gs.Synchronizer, step: int, rank: int, n: int = PER_RANK
) -> float:
    world = sync.world_size
    with sync.step(samples=n) as s:
        x, y = w.batch(step, n * world, rank * n, (rank + 1) * n)
        loss = w.loss(model, x, y)
        loss.backward()
        s.loss = loss
    return float(loss.detach())


def _hogwild(sync: gs.Synchronizer) -> Hogwild:
    assert isinstance(sync.strategy, Hogwild)
    return sync.strategy


def _held_out_loss(w: Any, model: torch.nn.Module) -> float:
    """The loss on one fixed batch of 256 samples no step trains on: unlike a step's loss on
    its 8 samples, it does not swing with which samples a step drew."""
    with torch.no_grad():
        x, y = w.batch(1_000_000, 256, 0, 256)
        return float(w.loss(model, x, y))


def converge(rank: int, world: int, workload: str, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps on every rank; the losses, counters and what report() says."""
    w, model, sync = _setup(workload)
    before = _held_out_loss(w, model)
    losses = [_step(w, model, sync, step, rank) for step in range(steps)]
    report = sync.report()  # every rank's updates are in the shared parameters after it
    after = _held_out_loss(w, model)
    mapped = leftovers()  # still mapped, long unlinked (rank 0 did at setup)
    stats = _hogwild(sync).stats()
    sync.close()
    return {
        "losses": losses,
        "held_out": (before, after),
        "params": flat_params(model),
        "stats": stats,
        "records": [(r.rank, r.step, r.idle, r.barrier, r.bytes) for r in report.records],
        "leftovers_while_mapped": mapped,
    }


def straggler(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Rank 1 computes 3x as long as it would. Rank 0 runs ``steps`` steps; rank 1 runs until
    rank 0's last update is in the shared counters. Without a barrier rank 0 is not held back,
    so rank 1 gets through far fewer steps in that time."""
    # Compute well above the step's own overhead, so that 3x compute is about 3x the step.
    w, model, sync = _setup("mlp", params=100_000, slow="1:3")
    hog = _hogwild(sync)
    done = 0
    if rank == 0:
        for step in range(steps):
            _step(w, model, sync, step, rank, n=128)
        done = steps
    else:
        while hog.stats().updates[0] < steps:
            _step(w, model, sync, done, rank, n=128)
            done += 1
    report = sync.report()
    stats = hog.stats()
    sync.close()
    return {"steps": done, "stats": stats, "idle": [r.idle for r in report.records]}


def first_run(rank: int, world: int, root: str, save_at: int, after: int) -> dict[str, Any]:
    """Train and save after step ``save_at``; then rank 1 is killed in the middle of writing
    its next update (SIGKILL once half of its parameters are written), while rank 0 trains
    ``after`` more steps alone, waits to see rank 1 gone, trains a few more on what it left
    in the shared parameters, and checks them."""
    w, model, sync = _setup("mlp")
    pids: list[Any] = [None] * world
    torch.distributed.all_gather_object(pids, os.getpid())
    for step in range(save_at):
        _step(w, model, sync, step, rank)
    sync.save(root, data_position=save_at)
    if rank == 1:
        _kill_mid_update(sync)
    losses = [_step(w, model, sync, step, rank) for step in range(save_at, save_at + after)]
    gone = _wait_gone(pids[1], deadline_s=30.0)
    more = save_at + after
    losses += [_step(w, model, sync, step, rank) for step in range(more, more + 3)]
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    out = {"finite": finite, "gone": gone, "losses": losses, "stats": _hogwild(sync).stats()}
    # No report(): its final barrier would wait for the dead rank. close() needs no peer.
    sync.close()
    return out


def _wait_gone(pid: int, deadline_s: float) -> bool:
    """Whether process ``pid`` has exited (a zombie counts) within ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _kill_mid_update(sync: gs.Synchronizer) -> None:
    """Make this rank's next optimizer step write half of the parameters, then SIGKILL it."""
    params = [p for p in sync.model.parameters() if p.requires_grad]

    def hook(*_: Any) -> None:
        with torch.no_grad():
            for p in params[: len(params) // 2]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    sync.optimizer.register_step_pre_hook(hook)


def resumed_run(rank: int, world: int, root: str, steps: int) -> dict[str, Any]:
    """A fresh group resumes from the checkpoint and trains on to ``steps``."""
    w, model, sync = _setup("mlp")
    extra = sync.load(root)
    assert extra is not None
    start = int(extra["step"])
    counters_at_start = _hogwild(sync).stats()
    restored = flat_params(model)
    torch.distributed.barrier()  # both ranks read the restored parameters before any trains
    losses = [_step(w, model, sync, step, rank) for step in range(start, steps)]
    report = sync.report()
    stats = _hogwild(sync).stats()
    sync.close()
    return {
        "start": start,
        "restored": restored,
        "losses": losses,
        "params": flat_params(model),
        "counters_at_start": counters_at_start,
        "stats": stats,
        "steps": report.steps,
    }


def on_two_hosts(rank: int, world: int) -> str:
    """Each rank claims a host of its own (``GRADSYNC_HOST``, as the emulated cluster's do)."""
    os.environ["GRADSYNC_HOST"] = f"host-{rank}"
    try:
        _setup("mlp")
    except gs.UsageError as exc:
        return str(exc)
    return "accepted"
