"""The worker that ``gradsync run`` starts on every rank (also runnable under torchrun)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from gradsync import runtime
from gradsync.config import RunConfig
from gradsync.progress import Progress
from gradsync.synchronizer import Synchronizer
from gradsync.telemetry.records import METRICS_FILE, StepRecord, write_records
from gradsync.workloads import make_workload


def run_worker(config_dict: dict[str, Any]) -> dict[str, Any] | None:
    """Train ``config.steps`` steps; rank 0 writes metrics.jsonl and report.json and returns the
    report as a dict (other ranks return None)."""
    cfg = RunConfig.from_dict(config_dict)
    torch.set_num_threads(int(os.environ.get("GRADSYNC_THREADS", cfg.threads)))
    runtime.init(timeout_s=cfg.timeout)
    rank, world = runtime.rank(), runtime.world_size()
    run_dir = Path(cfg.out)
    workload = make_workload(cfg.workload, seed=cfg.seed, data=cfg.data, params=cfg.params)
    model = workload.build_model().to(runtime.device())
    optimizer = workload.make_optimizer(model, cfg.lr or workload.default_lr)
    metrics_path = run_dir / METRICS_FILE
    progress = Progress(cfg.steps, enabled=cfg.progress and rank == 0)
    seen: list[StepRecord] = []

    def on_records(new: list[StepRecord]) -> None:
        if rank != 0:
            return
        write_records(metrics_path, new)
        seen.extend(new)
        last = max(r.step for r in new)
        latest = [r for r in new if r.step == last]
        losses = [r.loss for r in latest if r.loss is not None]
        wall = max(r.time + r.compute + r.sync for r in new) - min(r.time for r in seen)
        samples = sum(r.samples for r in seen)
        idle = sum(r.idle for r in seen)
        total = sum(r.compute + r.sync for r in seen)
        progress.update(
            last + 1,
            sum(losses) / len(losses) if losses else None,
            samples / wall if wall > 0 else 0.0,
            idle / total if total > 0 else 0.0,
        )

    sync = Synchronizer(
        model,
        optimizer,
        strategy=cfg.strategy,
        compression=cfg.compression,
        bucket_mb=cfg.bucket_mb,
        telemetry_every=cfg.telemetry_every,
        slow=cfg.slow,
        on_records=on_records,
    )
    per_rank = cfg.batch_size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    micro = cfg.micro_batches
    for step in range(cfg.steps):
        with sync.step(micro_batches=micro, samples=per_rank) as s:
            total_loss = torch.zeros((), dtype=torch.float64)
            # Micro-batches split this rank's shard; the Synchronizer averages over them.
            bounds = [lo + (hi - lo) * i // micro for i in range(micro + 1)]
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                x, y = workload.batch(step, cfg.global_batch, a, b)
                loss = workload.loss(model, x.to(runtime.device()), y.to(runtime.device()))
                loss.backward()
                total_loss += loss.detach().double().cpu()
            s.loss = total_loss / micro
    report = sync.report()
    progress.close()
    sync.close()
    if rank != 0:
        return None
    report.save(run_dir / "report.json")
    result = report.to_dict()
    result["world_size"] = world
    return result
