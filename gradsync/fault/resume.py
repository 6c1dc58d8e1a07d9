"""Save and resume a whole training state through ``CheckpointStore``: ``sync.save()``/``load()``.

A checkpoint holds, per rank: the model and optimizer state dicts, the Synchronizer's strategy
and compressor state (error-feedback residuals, PowerSGD factors, DiLoCo's outer optimizer,
the step), RNG states, and the caller's extras (the data position). Both calls are collective.

Resuming with a different number of ranks is supported for BSP only: every BSP replica holds
the same model and optimizer state, so rank 0's file seeds every rank, and the data position is
the step (each step's global batch is a function of the seed and the step). Per-rank
compressor state (error-feedback residuals) cannot be re-sharded and restarts from zero, with
a warning. Other strategies keep per-rank state that has no meaning at another world size,
so they refuse.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from gradsync.errors import UsageError
from gradsync.fault.checkpoint import CheckpointError, CheckpointStore, CheckpointWarning
from gradsync.fault.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from gradsync.synchronizer import Synchronizer


def _refuse_servers(sync: Synchronizer) -> None:
    if sync.strategy.barrier_free:
        raise UsageError(
            f"checkpoints are not supported with {sync.strategy.name} yet: the parameter "
            "servers' state is not saved; use bsp, local:H or diloco:H"
        )


def save(
    sync: Synchronizer, directory: str | Path, *, keep: int = 2, extra: dict[str, Any] | None = None
) -> float:
    """Collective: every rank writes its file, rank 0 commits the manifest once all have.
    Returns the seconds this rank spent, barriers included."""
    _refuse_servers(sync)
    started = time.perf_counter()
    store = CheckpointStore(directory, keep=keep)
    step = sync.step_count
    state = {
        "model": sync.model.state_dict(),
        "optimizer": sync.optimizer.state_dict(),
        "sync": sync.state_dict(),
        "rng": rng_state(),
        "strategy": sync.strategy.name,
        "extra": extra or {},
    }
    store.save(step, sync.rank, sync.world_size, state)
    _barrier(sync, step, "checkpoint barrier (every rank saved)")
    if sync.rank == 0:
        store.commit(step, sync.world_size)
    # After save() returns anywhere, the checkpoint is complete: a rank that dies right after
    # a checkpoint step must find it on restart.
    _barrier(sync, step, "checkpoint barrier (manifest committed)")
    return time.perf_counter() - started


def load(sync: Synchronizer, directory: str | Path) -> dict[str, Any] | None:
    """Collective: restore the newest valid checkpoint; return its extras (None if none)."""
    _refuse_servers(sync)
    store = CheckpointStore(directory)
    choice: list[Any] = [None]
    if sync.rank == 0 and Path(directory).exists():
        info = store.latest(allow_world_change=True)
        choice = [None if info is None else (info.step, info.world_size)]
    # Rank 0 decides, so every rank resumes from the same step even if a file is being judged
    # differently elsewhere (a warning it already printed says why it skipped a newer one).
    dist.broadcast_object_list(choice, src=_global_zero(sync), group=sync.group)
    if choice[0] is None:
        return None
    step, saved_world = choice[0]
    info = store.at(step)
    changed = saved_world != sync.world_size
    if changed and sync.strategy.name != "bsp":
        raise CheckpointError(
            f"checkpoint at step {step} was written by {saved_world} ranks; resuming "
            f"{sync.strategy.name} with {sync.world_size} is not supported (its per-rank state "
            "has no meaning at another size). Resume with the same number of ranks, or use bsp."
        )
    state = store.load(info, sync.rank, source_rank=0 if changed else None)
    if state.get("strategy") != sync.strategy.name:
        raise CheckpointError(
            f"checkpoint at step {step} was written by strategy {state.get('strategy')!r}, "
            f"this run uses {sync.strategy.name!r}"
        )
    sync.model.load_state_dict(state["model"])
    sync.optimizer.load_state_dict(state["optimizer"])
    lost = bool(state["sync"].get("strategy", {}).get("compressor"))
    if changed and lost and sync.rank == 0:
        warnings.warn(
            f"resuming BSP from {saved_world} ranks on {sync.world_size}: model and optimizer "
            "come from rank 0; per-rank compressor state (error feedback) restarts from zero",
            CheckpointWarning,
            stacklevel=2,
        )
    if changed:
        sync.load_state_dict({"step": state["sync"]["step"], "strategy": {}})
    else:
        sync.load_state_dict(state["sync"])
        set_rng_state(state["rng"])
    extra: dict[str, Any] = dict(state.get("extra") or {})
    extra["step"] = sync.step_count
    return extra


def _barrier(sync: Synchronizer, step: int, what: str) -> None:
    """A barrier whose failure names the ranks that never arrived, like every other wait."""
    sync.watch.run(step, what, lambda: dist.barrier(group=sync.group))


def _global_zero(sync: Synchronizer) -> int:
    return 0 if sync.group is None else dist.get_global_rank(sync.group, 0)
