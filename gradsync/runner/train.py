"""The built-in workloads' training loop (``gradsync run --workload charlm | mlp``), an
ordinary script like the user's own: ``gradsync run`` starts it on every rank through the same
path as a user's script (``gradsync.runner.worker.run_script``), and torchrun can too::

    torchrun --nproc_per_node 2 -m gradsync.runner.train --config RUN_DIR/config.json

Its settings are the run's ``config.json`` (``gradsync.runner.config.RunConfig``); its
gs.Synchronizer
attaches to the run directory (``gradsync.attached_run``) as a user script's does, which writes
metrics.jsonl, report.json and the rest. What it adds: resuming from its checkpoints after
``--resume`` or a restart, a checkpoint every ``--checkpoint-every`` steps, rank 0's time per
save, and the final parameters (``final_model.pt``) so that runs compare bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync import compat, runtime
from gradsync.attached_run import append_fault, restart_count
from gradsync.flags import sourced
from gradsync.logs import get_logger
from gradsync.options import Checks, Exchange, Limits, Telemetry
from gradsync.runner.config import RunConfig
from gradsync.runner.rundir import CHECKPOINT_DIR, FINAL_MODEL
from gradsync.synchronizer import Synchronizer
from gradsync.workloads import make_workload

logger = get_logger("run")


def _resume(sync: Synchronizer, cfg: RunConfig, run_dir: Path, rank: int) -> int:
    """The step to start at: 0, or the newest checkpoint's after --resume or a restart by
    the elastic agent (it sets TORCHELASTIC_RESTART_COUNT). The run directory's records of the
    steps that run again are dropped, and rank 0 says where the run went back to: by
    ``sync.load`` (``AttachedRun.loaded``), or here when there are no checkpoints to load."""
    restarted = agreed_restart(sync)
    if not (cfg.resume or restarted):
        return 0
    if cfg.resume or cfg.checkpoint_every:
        # A restarted replica group loads its own newest checkpoint too: its Manager counts
        # from there, so the first quorum heals it forward where a live peer is further, and
        # where none is (the others have finished) it goes on from its checkpoint, not step 0.
        extra = sync.load(run_dir / CHECKPOINT_DIR)
        return int(extra["step"]) if extra else 0
    if rank == 0:
        # Every step runs again, a restart without checkpoints: their earlier records would
        # count the rolled-back work twice in the report (a replica group's wait for its first
        # quorum, which heals it forward where a live peer is further).
        run = sync.attached_run
        if run is not None:  # drops the records of every step (they all run again), says so
            run.loaded(0, until_quorum=bool(cfg.replica_groups))
    return 0


def agreed_restart(sync: Synchronizer) -> int:
    """This attempt's restart count as every rank takes it: the most any rank's agent counted.
    Across hosts each host's agent counts only its own workers' failures: when one host's
    worker dies, the other agents restart theirs for the new rendezvous round without counting
    it, so their workers would start afresh while the failed host's load the newest checkpoint
    (on the emulated cluster, both then waited for the other at the step gate). Written back
    to the environment, so that this process's later reads (the run's messages and records)
    say the same."""
    count = torch.tensor([restart_count()], dtype=torch.int64, device=runtime.device())
    if sync.world_size > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=sync.group)
    agreed = int(count.item())
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(agreed)
    return agreed


def _log_recovery(run_dir: Path, resumed_at: int) -> None:
    """When the first step after a resume completed: the end of the outage."""
    entry = {
        "restart": restart_count(),
        "resumed_at_step": resumed_at,
        "first_step_done": time.time(),
    }
    append_fault(run_dir, "recoveries.jsonl", entry)


class _CheckpointLog:
    """``CHECKPOINTS/log.jsonl``: rank 0's time per save. Opened once, and flushed once a
    second and at the end rather than per line: with a checkpoint every step, making the
    directory and opening the file at each save cost about a tenth of a millisecond of the
    step, and a write to the file at each save one more system call on the rank every other
    waits for. Rank 0 killed, or stopped by a restart of the group, loses up to the last
    second's lines (the times, not the checkpoints)."""

    FLUSH_EVERY_S = 1.0

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fh: Any = None
        self._flushed = 0.0

    def write(self, step: int, seconds: float) -> None:
        if self._fh is None:
            self.directory.mkdir(parents=True, exist_ok=True)  # the writer may not have yet
            self._fh = open(self.directory / "log.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        now = time.time()
        self._fh.write(f'{{"step": {step}, "seconds": {seconds!r}, "time": {now!r}}}\n')
        if now - self._flushed >= self.FLUSH_EVERY_S:
            self._fh.flush()
            self._flushed = now

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def train(cfg: RunConfig) -> dict[str, Any] | None:
    """Train ``cfg.steps`` steps; rank 0's Synchronizer writes metrics.jsonl and report.json,
    and rank 0 returns the report as a dict (other ranks return None). Parameter-server ranks
    serve instead."""
    torch.set_num_threads(int(os.environ.get("GRADSYNC_THREADS", cfg.threads)))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = cfg.process_backend(local)
    runtime.init(backend=backend, timeout_s=cfg.timeout)
    rank, world = runtime.rank(), runtime.world_size()
    if rank == 0 and backend == "gloo" and cfg.backend == "auto" and torch.cuda.is_available():
        # Not silently on the CPU where a GPU is visible: say why, and what would use it.
        logger.info(
            "--backend auto: training on the CPU over gloo (%d process(es) on this machine, "
            "%d GPU(s) visible, strategy %s); --backend nccl with at most one process per GPU "
            "trains on them",
            local,
            torch.cuda.device_count(),
            cfg.strategy,
        )
    run_dir = Path(cfg.out)
    workload = make_workload(cfg.workload, seed=cfg.seed, data=cfg.data, params=cfg.params)
    model = workload.build_model().to(runtime.device())
    optimizer = workload.make_optimizer(model, cfg.lr or workload.default_lr)
    # Attached to the run directory: metrics.jsonl, the trackers, the progress line, --kill,
    # spans.jsonl and report.json, as for any script ``gradsync run`` starts
    sync = _synchronizer(cfg, model, optimizer, run_dir)
    run = sync.attached_run
    assert run is not None
    if sync.is_server:
        # Servers resume too (their parameters, optimizer state and clocks): load is collective.
        _resume(sync, cfg, run_dir, rank)
        sync.serve()
        sync.close()
        return None
    barrier_free = sync.strategy.barrier_free
    start = _resume(sync, cfg, run_dir, rank)
    recovering = start > 0 and rank == 0
    checkpoints = run_dir / CHECKPOINT_DIR
    log = _CheckpointLog(checkpoints)
    # Counted by the Synchronizer, not from ``start``: a replica group's replacement heals at
    # its first step and goes on from its peer's step (live membership), and ends at --steps.
    while sync.step_count < cfg.steps:
        loss, step = _train_step(sync, workload, cfg, rank)
        if barrier_free and run.sink is not None and (step + 1) % cfg.telemetry_every == 0:
            # No gathering mid-run without a barrier: show rank 0's own view meanwhile.
            run.sink.progress.update(step + 1, loss, 0.0, 0.0)
        if recovering:
            recovering = False
            # the step it ran first: a replica group's replacement healed forward from a live
            # peer resumed at its peer's step, not at the checkpoint it loaded
            _log_recovery(run_dir, step)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            # Written in the background: the step pays for a copy of the state. The records of
            # the steps not gathered yet go with it, so a restart that rolls back to it keeps
            # them. close() below waits for the last writes.
            seconds = sync.save(
                checkpoints, keep=cfg.keep_checkpoints, wait=False, data_position=step + 1
            )
            if rank == 0:
                log.write(step + 1, seconds)
    log.close()
    sync.report()  # rank 0 writes report.json (``AttachedRun.finish``)
    # The final parameters, so runs (interrupted or not) can be compared bit for bit: whole
    # tensors (gathering zero:3's shards is a collective, so every rank takes part).
    final = {
        k: v.full_tensor() if compat.is_dtensor(v) else v for k, v in model.state_dict().items()
    }
    if rank == 0:
        torch.save(final, run_dir / FINAL_MODEL)
    sync.close()
    if rank != 0 or run.reported is None:
        return None
    return {**run.reported, "world_size": world}


def _synchronizer(
    cfg: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run_dir: Path
) -> Synchronizer:
    # The options the flags set, each flag declared on its option's field (gradsync.options)
    return Synchronizer(
        model,
        optimizer,
        strategy=cfg.strategy,
        compression=cfg.compression,
        slow=cfg.slow,
        servers=cfg.servers,
        run_dir=run_dir,
        exchange=Exchange(**sourced(cfg, Exchange)),
        limits=Limits(**sourced(cfg, Limits)),
        telemetry=Telemetry(telemetry_every=cfg.telemetry_every),
        checks=Checks(**sourced(cfg, Checks)),
    )


def _train_step(sync: Synchronizer, workload: Any, cfg: RunConfig, rank: int) -> tuple[float, int]:
    """One step on this rank's shard of the step's global batch; returns its loss and its
    index. With replica groups, group K's ranks take the K-th part of the global batch of
    every group's ranks, so the groups together train what one group of all their ranks
    would."""
    # Balanced runs get this step's shard sizes from measured speed; others split evenly.
    sizes = sync.shard_sizes(cfg.global_batch)
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    groups = max(1, cfg.replica_groups)
    offset = (cfg.replica_group or 0) * cfg.global_batch
    micro = cfg.micro_batches
    with sync.step(micro_batches=micro, samples=hi - lo) as s:
        total_loss = torch.zeros((), dtype=torch.float64)
        # Micro-batches split this rank's shard; the Synchronizer averages over them.
        bounds = [offset + lo + (hi - lo) * i // micro for i in range(micro + 1)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            # s.step, not a count of the loop: a replacement healed at the step's start
            x, y = workload.batch(s.step, cfg.global_batch * groups, a, b)
            loss = workload.loss(sync.model, x.to(runtime.device()), y.to(runtime.device()))
            loss.backward()
            total_loss += loss.detach().double().cpu()
        s.loss = total_loss / micro
    return float(s.loss), s.step


def main(argv: list[str] | None = None) -> None:
    """``python -m gradsync.runner.train --config RUN_DIR/config.json`` on every rank."""
    parser = argparse.ArgumentParser(prog="python -m gradsync.runner.train")
    parser.add_argument("--config", required=True, help="a run's config.json")
    args = parser.parse_args(argv)
    config = json.loads(Path(args.config).read_text(encoding="utf-8"))
    train(RunConfig.from_dict(config))


if __name__ == "__main__":
    main()
