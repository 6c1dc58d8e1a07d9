"""Export a gradsync checkpoint to files torch opens alone: a ``torch.save`` state dict or DCP.

gradsync writes its checkpoints in its own packed format, one file per rank, and under ``bsp``
each rank writes only a share of the replicated model and optimizer state (``replicas``): no
single file is a model, which suits a job resuming itself, not a plain script. Here the
checkpoint is put back together with the code ``sync.load`` uses (``CheckpointStore``,
``checkpointer.join_replicated``) into what a single-process script would hold::

    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": N, "extra": {...}}

(plus ``"registered"``, rank 0's registered states, where the run registered any), written with
``torch.save`` or with ``torch.distributed.checkpoint.save`` in this process alone. Which
strategies export, and why the others are refused: ``EXPORTABLE``, ``_check_exportable`` and
docs/checkpoints.md, "Opening a checkpoint with torch alone".
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradsync.checkpoint.checkpointer import join_replicated, latest_skipping
from gradsync.checkpoint.registry import REGISTERED
from gradsync.checkpoint.settings import STRATEGY_SPEC
from gradsync.checkpoint.store import (
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
)
from gradsync.errors import UsageError
from gradsync.row_shards import ROWS, join_saved, layout_of

__all__ = ["EXPORTABLE", "TARGETS", "Exported", "export_checkpoint", "single_process_state"]

#: the formats ``export_checkpoint`` writes: ``torch.save`` or ``torch.distributed.checkpoint``
TARGETS = ("torch", "dcp")

#: the strategies (by the name their checkpoints record) whose checkpoints export, and whose
#: model and optimizer state the export holds
EXPORTABLE = {
    "bsp": "the replicas' model and optimizer state, every rank's share joined",
    "zero:1": "the model (whole on every rank) and every rank's shard of the optimizer state",
    "zero:2": "the model (whole on every rank) and every rank's shard of the optimizer state",
    "local": "rank 0's model and optimizer state",
    "diloco": "rank 0's model and (inner) optimizer state",
    "gossip": "rank 0's model and optimizer state",
    "noloco": "rank 0's model and (inner) optimizer state",
    "hogwild": "the shared parameters and rank 0's buffers and optimizer state",
}

#: the strategies of ``EXPORTABLE`` a user spells with a period, ``local:H`` and the others
_PERIODIC = ("local", "diloco", "gossip", "noloco")


@dataclass(frozen=True, slots=True)
class Exported:
    """What ``export_checkpoint`` wrote: where, from which checkpoint, of which run."""

    path: Path
    to: str
    step: int
    strategy: str
    world_size: int
    checkpoint: Path


def export_checkpoint(
    directory: str | Path, out: str | Path, *, to: str = "torch", step: int | None = None
) -> Exported:
    """Write the newest complete checkpoint in ``directory`` (or the one of ``step``) as a
    single-process state dict (``single_process_state``) to ``out``: with ``torch.save``
    (``to="torch"``, a file) or ``torch.distributed.checkpoint.save`` without a process group
    (``to="dcp"``, a directory).

    Everything is read and put together before anything is written, and ``out`` appears
    whole or not at all (written beside it, then renamed). ``UsageError`` for a bad ``to``, a
    ``directory`` that is not one, an ``out`` that exists (nothing is overwritten) or whose
    folder does not (a mistyped path would have made folders nobody asked for);
    ``CheckpointError`` when there is no usable checkpoint, or its strategy cannot be exported
    (``EXPORTABLE`` lists those that can), or a file of it is damaged."""
    if to not in TARGETS:
        raise UsageError(f"cannot export to {to!r}: choose one of {', '.join(TARGETS)}")
    target = Path(out)
    if target.exists() or target.is_symlink():
        raise UsageError(f"{target} already exists: export to a new path (nothing was overwritten)")
    folder = target.parent
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise UsageError(f"{folder}, the folder of {target}, {what}: create it first")
    state, info, strategy = _read(directory, step)
    (_write_torch if to == "torch" else _write_dcp)(state, target)
    return Exported(target, to, info.step, strategy, info.world_size, info.path)


def single_process_state(directory: str | Path, *, step: int | None = None) -> dict[str, Any]:
    """The newest complete checkpoint in ``directory`` (or the one of ``step``) as a
    single-process script would hold it (the module docstring's dict), without writing it.
    Raises as ``export_checkpoint`` does."""
    return _read(directory, step)[0]


#: how many times the newest checkpoint is looked for again when it was pruned while read
PRUNED_RETRIES = 5


def _read(directory: str | Path, step: int | None) -> tuple[dict[str, Any], CheckpointInfo, str]:
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"step must be an integer >= 0 (a checkpoint's step), got {step!r}")
    where = Path(directory)
    if not where.is_dir():
        what = "is not a directory" if where.exists() else "does not exist"
        raise UsageError(f"checkpoint directory {where} {what}")
    store = CheckpointStore(where)
    for tries_left in reversed(range(PRUNED_RETRIES)):
        info = _find(store, step)
        try:
            return _read_checkpoint(store, info)
        except (OSError, CheckpointError):
            # A run still saving there pruned the newest checkpoint while it was read (its
            # files gone: "rank-0.pt is missing" read as damage): take the newest again. One
            # still there failed for its own reason, and so did one the caller named.
            if step is not None or store.step_dir(info.step).is_dir() or not tries_left:
                raise
    raise AssertionError("unreachable")


def _read_checkpoint(
    store: CheckpointStore, info: CheckpointInfo
) -> tuple[dict[str, Any], CheckpointInfo, str]:
    first = store.load(info, 0)
    strategy = first.get("strategy")
    name = strategy if isinstance(strategy, str) else repr(strategy)
    _check_exportable(name, info)
    model, optimizer = _model_and_optimizer(store, info, first, name)
    state = {
        "model": model,
        "optimizer": optimizer,
        "step": info.step,
        "extra": dict(first.get("extra") or {}),
    }
    if REGISTERED in first:  # rank 0's registered states (``sync.register_state``)
        state["registered"] = first[REGISTERED]
    # the whole spec where the checkpoint holds it (local:2, not local), for the user's line
    spec = first.get(STRATEGY_SPEC)
    return state, info, spec if isinstance(spec, str) and spec else name


def _find(store: CheckpointStore, step: int | None) -> CheckpointInfo:
    """The checkpoint to export: ``step``'s, or the newest complete and intact one (the
    newer ones skipped are warned about, each with its reason, as a resume would)."""
    if step is not None:
        if not store.step_dir(step).is_dir():
            steps = sorted(p.name for p in store.directory.glob("step-*") if p.is_dir())
            there = f"it holds {', '.join(steps)}" if steps else "it holds no checkpoint"
            raise CheckpointError(f"no checkpoint of step {step} in {store.directory}; {there}")
        return store.at(step)  # sizes checked here, each file's checksum as it is read
    info, caught, skipped = latest_skipping(store)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if info is not None:
        return info
    if skipped:
        reasons = "; ".join(skipped)
        raise CheckpointError(
            f"none of the {len(skipped)} checkpoint(s) in {store.directory} is complete and "
            f"intact, nothing to export: {reasons}"
        )
    raise CheckpointError(
        f"no checkpoint in {store.directory}: nothing to export (a run writes them with "
        "--checkpoint-every N, a script with sync.save(dir))"
    )


def _check_exportable(strategy: str, info: CheckpointInfo) -> None:
    if strategy in EXPORTABLE:
        return
    if strategy == "zero:3":
        why = (
            "each rank's file holds only its shards of the parameters (and of their optimizer "
            "state), not a whole model"
        )
    elif strategy == "async" or strategy.startswith("ssp:"):
        why = (
            "the parameters and the optimizer state live on the server ranks, each holding a "
            "shard, and the workers' files hold no model of the run's own"
        )
    else:
        why = "gradsync does not know how its checkpoints hold the model and optimizer"
    raise CheckpointError(
        f"cannot export the checkpoint of step {info.step} ({info.path}): it was written by "
        f"strategy {strategy}, and {why}. Checkpoints of "
        f"{', '.join(f'{s}:H' if s in _PERIODIC else s for s in EXPORTABLE)} export; "
        "nothing was written"
    )


def _model_and_optimizer(
    store: CheckpointStore, info: CheckpointInfo, first: dict[str, Any], strategy: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model and optimizer state dicts, from rank 0's file ``first`` (and the
    other ranks' where they hold part of them)."""
    if strategy == "bsp":
        join_replicated(store, info, first)  # every rank's share, as sync.load joins them
    for key in ("model", "optimizer"):
        if not isinstance(first.get(key), dict):
            raise CheckpointError(
                f"{info.file(0)} (strategy {strategy}) holds no {key} state to export"
            )
    model, optimizer = first["model"], first["optimizer"]
    if strategy in ("zero:1", "zero:2"):
        optimizer = _joined_optimizer(store, info, first, strategy)
    return model, optimizer


def _joined_optimizer(
    store: CheckpointStore, info: CheckpointInfo, first: dict[str, Any], strategy: str
) -> dict[str, Any]:
    """``zero:1`` / ``zero:2``: each rank's optimizer holds the state of its part of the
    parameters, whole tensors it owns or its rows of every tensor, as its file's strategy state
    records (``gradsync.row_shards``); here every rank's is joined, under rank 0's
    ``param_groups`` (the same groups on every rank)."""
    files = [first if rank == 0 else store.load(info, rank) for rank in range(info.world_size)]
    parts = []
    for rank, held in enumerate(files):
        part = held.get("optimizer")
        if not isinstance(part, dict) or not isinstance(part.get("state"), dict):
            raise CheckpointError(f"{info.file(rank)} holds no optimizer state to export")
        parts.append(part)
    records = [held.get("sync", {}).get("strategy") for held in files]
    if layout_of(records[0]) == ROWS:
        try:
            return join_saved(parts, records)
        except ValueError as exc:
            raise CheckpointError(
                f"cannot join the {strategy} optimizer state of step {info.step} "
                f"({info.path}): {exc}"
            ) from exc
    return _joined_owned(info, parts)


def _joined_owned(info: CheckpointInfo, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Whole tensors: each taken from the rank that holds its state (two that differ: refused)."""
    state: dict[Any, Any] = {}
    holder: dict[Any, int] = {}
    for rank, part in enumerate(parts):
        for key, entry in part["state"].items():
            if key in state and not _same(state[key], entry):
                raise CheckpointError(
                    f"ranks {holder[key]} and {rank} of the checkpoint of step {info.step} "
                    f"({info.path}) both hold optimizer state of parameter {key}, and they "
                    "differ: cannot tell which is the run's"
                )
            state.setdefault(key, entry)
            holder.setdefault(key, rank)
    ordered = dict(sorted(state.items(), key=lambda kv: (str(type(kv[0])), kv[0])))
    return {**parts[0], "state": ordered}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _staging(target: Path) -> Path:
    """Where ``target`` is written before it is renamed into place (beside it: one
    filesystem)."""
    return target.with_name(f".{target.name}.export-{os.getpid()}.tmp")


def _write_torch(state: dict[str, Any], target: Path) -> None:
    staging = _staging(target)
    try:
        torch.save(state, staging)
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)


def _write_dcp(state: dict[str, Any], target: Path) -> None:
    import torch.distributed.checkpoint as dcp

    staging = _staging(target)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with warnings.catch_warnings():
            # no_dist is the point here: its warning that it assumes one process says nothing
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=staging, no_dist=True)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
