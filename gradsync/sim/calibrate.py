"""Calibrated prediction: a real run's per-rank compute plus a fitted link, fed to the simulator.

The run directory gives each rank's empirical compute distribution (``metrics.jsonl``) and
the bytes each rank put on the wire per step; the calibration file (from ``gradsync bench
allreduce``) gives alpha and beta. The simulator resamples each rank's compute, charges the
alpha-beta cost of all-reducing that payload in ``bucket_mb`` buckets, and predicts the median
step time and barrier tax, for the run as it was or with one thing changed.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradsync.errors import UsageError
from gradsync.sim.config import CommModel, Strategy, parse_strategy
from gradsync.sim.model import AlphaBeta, Fit
from gradsync.sim.simulate import SimResult, simulate
from gradsync.telemetry.records import read_records

CALIBRATION_KIND = "gradsync.allreduce_calibration"


def save_calibration(path: str | Path, fit: Fit, extra: dict[str, Any]) -> None:
    doc = {
        "kind": CALIBRATION_KIND,
        "op": fit.op,
        "algorithm": fit.algorithm,
        "nproc": fit.n,
        "alpha_s": fit.alpha,
        "beta_s_per_byte": fit.beta,
        "max_rel_error": fit.max_rel_error,
        **extra,
    }
    Path(path).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def load_calibration(path: str | Path) -> AlphaBeta:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read calibration file {path}: {exc}") from None
    if doc.get("kind") != CALIBRATION_KIND:
        raise UsageError(f"{path} is not a gradsync bench allreduce calibration file")
    return AlphaBeta(
        alpha=max(0.0, doc["alpha_s"]),
        beta=max(0.0, doc["beta_s_per_byte"]),
        algorithm=doc.get("algorithm", "ring"),
    )


@dataclass(kw_only=True, slots=True)
class RunProfile:
    """What the simulator needs from one real run, in ms and bytes."""

    nproc: int
    strategy: str
    bucket_mb: float
    compute_ms: dict[int, np.ndarray]
    bytes_per_step: float
    measured_step_ms: float  # median over steps of the slowest rank's compute + sync
    measured_barrier_tax: float
    measured_comm_ms: float  # median comm (sync minus barrier wait) over rank-steps
    config: dict[str, Any] = field(default_factory=dict)

    def slowest_rank(self) -> int:
        return max(self.compute_ms, key=lambda r: float(np.median(self.compute_ms[r])))


def load_profile(run_dir: str | Path, warmup: int = 2) -> RunProfile:
    """Read ``metrics.jsonl`` (and ``config.json`` if present), skipping ``warmup`` steps."""
    records = [r for r in read_records(run_dir) if not r.skipped]
    steps = sorted({r.step for r in records})
    if len(steps) <= warmup:
        raise UsageError(f"{run_dir} has {len(steps)} steps; need more than --warmup {warmup}")
    keep = set(steps[warmup:])
    records = [r for r in records if r.step in keep]
    cfg_path = Path(run_dir) / "config.json"
    config: dict[str, Any] = {}
    if Path(run_dir).is_dir() and cfg_path.exists():
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    compute: dict[int, list[float]] = defaultdict(list)
    step_wall: dict[int, float] = defaultdict(float)
    for r in records:
        compute[r.rank].append(1000.0 * r.compute)
        step_wall[r.step] = max(step_wall[r.step], 1000.0 * (r.compute + r.sync))
    idle = sum(r.idle for r in records)
    wall = sum(r.compute + r.sync for r in records)
    return RunProfile(
        nproc=int(config.get("nproc", len(compute))),
        strategy=str(config.get("strategy", "bsp")),
        bucket_mb=float(config.get("bucket_mb", 25.0)),
        compute_ms={k: np.asarray(v) for k, v in sorted(compute.items())},
        bytes_per_step=float(np.median([r.bytes for r in records])),
        measured_step_ms=float(np.median(list(step_wall.values()))),
        measured_barrier_tax=idle / wall if wall > 0 else 0.0,
        measured_comm_ms=float(np.median([1000.0 * r.comm for r in records])),
        config=config,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class WhatIf:
    """One change to the run; all defaults mean 'as it was'."""

    workers: int | None = None
    strategy: str | None = None
    remove_straggler: bool = False
    compression_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise UsageError(f"--workers must be at least 1, got {self.workers}")
        if self.strategy is not None:
            parse_strategy(self.strategy)
        if not (self.compression_ratio >= 1 and math.isfinite(self.compression_ratio)):
            raise UsageError(f"--compression-ratio must be >= 1, got {self.compression_ratio}")

    def describe(self) -> str:
        parts = []
        if self.workers is not None:
            parts.append(f"workers={self.workers}")
        if self.strategy is not None:
            parts.append(f"strategy={self.strategy}")
        if self.remove_straggler:
            parts.append("straggler removed")
        if self.compression_ratio != 1:
            parts.append(f"compression x{self.compression_ratio:g}")
        return ", ".join(parts) or "as run"


@dataclass(kw_only=True, slots=True)
class Prediction:
    what_if: str
    step_ms: float  # median step (bsp: superstep; others: wall / steps)
    barrier_tax: float
    comm_ms: float
    result: SimResult


def comm_for(profile: RunProfile, link: AlphaBeta | None, ratio: float) -> CommModel:
    """All-reduce of the per-step payload in ``bucket_mb`` buckets, each paying its latency."""
    nbytes = profile.bytes_per_step / ratio
    if link is None:
        # No fitted link: reuse the run's own unhidden comm, so only compute is predicted.
        return CommModel(comm_ms=profile.measured_comm_ms / ratio)
    bucket = profile.bucket_mb * 2**20
    buckets = max(1, math.ceil(nbytes / bucket)) if bucket > 0 else 1
    # Folding the per-bucket latencies into alpha keeps CommModel a single message.
    folded = AlphaBeta(alpha=link.alpha * buckets, beta=link.beta, algorithm=link.algorithm)
    return CommModel(link=folded, nbytes=nbytes)


def predict(
    profile: RunProfile,
    link: AlphaBeta | None,
    what_if: WhatIf | None = None,
    *,
    steps: int = 1000,
    seed: int = 0,
) -> Prediction:
    """Resample each rank's compute ``steps`` times and simulate the (changed) run."""
    wi = what_if or WhatIf()
    samples = dict(profile.compute_ms)
    if wi.remove_straggler and len(samples) > 1:
        slow = profile.slowest_rank()
        samples[slow] = np.concatenate([v for r, v in samples.items() if r != slow])
    ranks = sorted(samples)
    workers = wi.workers or profile.nproc
    rng = np.random.default_rng(seed)
    # A bigger world cycles the measured ranks, keeping the share of slow ones.
    compute = np.column_stack(
        [rng.choice(samples[ranks[w % len(ranks)]], size=steps) for w in range(workers)]
    )
    strategy: Strategy = parse_strategy(wi.strategy or profile.strategy)
    comm = comm_for(profile, link, wi.compression_ratio)
    res = simulate(strategy, compute, comm)
    if strategy.kind == "bsp" and res.step_ms is not None:
        step = float(np.median(res.step_ms))
    else:
        step = res.wall_ms / steps
    busy = res.workers * res.wall_ms
    return Prediction(
        what_if=wi.describe(),
        step_ms=step,
        barrier_tax=float(res.idle_ms.sum() / busy) if busy > 0 else 0.0,
        comm_ms=comm.exchange_ms(workers),
        result=res,
    )
