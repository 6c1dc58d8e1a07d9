"""Calibrated prediction: a real run's per-rank compute plus a fitted link, fed to the simulator.

The run directory gives each rank's empirical compute distribution (``metrics.jsonl``) and
the bytes each rank put on the wire per step; the calibration file (from ``gradsync bench
allreduce``) gives alpha and beta. The simulator resamples each rank's compute, charges the
alpha-beta cost of all-reducing that payload in ``bucket_mb`` buckets, and predicts the median
step time and barrier tax, for the run as it was or with one thing changed.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradsync.errors import UsageError
from gradsync.sim.config import CommModel, SimStrategy, parse_sim_strategy
from gradsync.sim.model import AlphaBeta, Fit
from gradsync.sim.simulate import SimResult, simulate
from gradsync.sim.table import CollectiveTable
from gradsync.spec import bucket_sizes_mb, default_bucket_mb
from gradsync.telemetry.records import StepRecord, read_records, read_spans
from gradsync.telemetry.report import RunReport

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
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise UsageError(f"cannot read calibration file {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kind") != CALIBRATION_KIND:
        held = "" if isinstance(doc, dict) else f" (it holds a JSON {type(doc).__name__})"
        raise UsageError(
            f"{path} is not a gradsync bench allreduce calibration file{held}: pass the JSON "
            "object that gradsync bench allreduce writes"
        )
    alpha = _finite_seconds(path, "alpha_s", doc.get("alpha_s"))
    beta = _finite_seconds(path, "beta_s_per_byte", doc.get("beta_s_per_byte"))
    return AlphaBeta(
        alpha=max(0.0, alpha),
        beta=max(0.0, beta),
        algorithm=doc.get("algorithm", "ring"),
    )


def _finite_seconds(path: str | Path, name: str, value: Any) -> float:
    # max(0.0, NaN) is 0.0: a NaN would pass as a free link, so finiteness is checked first
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UsageError(f"{path}: {name} is {value!r}: valid is a finite number of seconds")
    return float(value)


def load_calibration_table(path: str | Path) -> CollectiveTable | None:
    """The measured repeats in a calibration file, or None if it holds only the fit."""
    link = load_calibration(path)
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    rows = sorted(
        (float(m["bytes"]), tuple(m.get("samples_s") or [m["time_s"]]))
        for m in doc.get("measurements", [])
        if m.get("time_s", 0) > 0
    )
    if not rows:
        return None
    return CollectiveTable(
        nproc=int(doc.get("nproc", 2)),
        sizes=tuple(r[0] for r in rows),
        samples_s=tuple(r[1] for r in rows),
        link=link,
    )


@dataclass(kw_only=True, slots=True)
class RunProfile:
    """What the simulator needs from one real run, in ms and bytes.

    Rows of the ``*_steps`` arrays are the run's steps (after warm-up) that every rank
    recorded, so a prediction can resample whole steps and keep what ranks shared.
    """

    nproc: int
    strategy: str
    bucket_mb: float | None  # None: the default plan (spec.default_bucket_mb)
    compute_ms: dict[int, np.ndarray]
    # bytes one rank puts on the wire per step, on average over the run's steps: for
    # ``local:H`` and ``diloco:H``, which send only every H-th step, a whole exchange / H
    bytes_per_step: float
    # median over sync periods of the time per step, as ``predict`` reports it: for the
    # free-running strategies (``FREE_RUNNING``) from when every rank had finished a step to
    # when every rank has finished the next (the records' times); for the others, the median
    # over steps of the slowest rank's compute + sync, which is that under a barrier
    measured_step_ms: float
    # ``RunReport``'s barrier tax (gradsync report's), over the steps modelled: after the
    # warm-up, without skipped steps (``measured_steps``: first, last, how many)
    measured_barrier_tax: float
    measured_comm_ms: float  # median comm (sync minus barrier wait) over rank-steps
    compute_steps: np.ndarray  # (steps, nproc): each rank's compute at each step
    comm_steps: np.ndarray  # (steps,): max over ranks of comm, what the step pays
    # (steps,): the last rank to finish compute, from its compute end to its last bucket's
    # all-reduce end (spans.jsonl); the rest of comm_steps is the host's own overhead
    # (write-back, optimizer, start skew, scheduling). None without spans.
    collective_steps: np.ndarray | None = None
    # (steps,): max over ranks of comm minus its mean over ranks. A rank that entered the step
    # late (start skew) records less sync than the one that waited for it; that difference is
    # elapsed time outside the late rank's compute + sync, so the telemetry's worker-time (the
    # barrier tax's denominator) does not count it. None for a profile built by hand.
    comm_spread_steps: np.ndarray | None = None
    config: dict[str, Any] = field(default_factory=dict)
    # (steps, nproc): each rank's own comm at each step. Under the parameter-server strategies
    # (``OWN_EXCHANGE``) a worker waits for its own push and pull only, never for another
    # worker's: the prediction charges each worker its own. None for a profile built by hand.
    comm_rank_steps: np.ndarray | None = None
    # bytes of one exchange, what each all-reduce carries (median over the steps that sent);
    # None: every step is an exchange (bytes_per_step)
    bytes_per_exchange: float | None = None
    # steps per exchange: H for local:H and diloco:H (``PERIODIC``), else 1
    period: int = 1
    # rows of the ``*_steps`` arrays whose step exchanged, where only some do (``PERIODIC``);
    # the exchange a prediction charges is drawn from these. None: every row
    exchange_rows: np.ndarray | None = None
    # median over the rank-steps that did not exchange of their comm (the optimizer step and
    # the host's work around it), which a ``PERIODIC`` run pays at every local step; 0 else
    local_overhead_ms: float = 0.0
    # (steps, nproc): each rank's time from the end of its step (compute + sync) to the start
    # of its next one, outside every step timer (the script's own code, waiting to be
    # scheduled). Under a barrier the others' sync holds it; without one (``FREE_RUNNING``)
    # nothing else does, and the prediction charges it to the worker. None: built by hand.
    outside_rank_steps: np.ndarray | None = None
    # gradsync report's barrier tax, over every recorded step (warm-up and skipped steps too),
    # and how many steps that is; None: built by hand
    report_barrier_tax: float | None = None
    report_steps: int | None = None
    measured_steps: tuple[int, int, int] | None = None

    @property
    def exchange_bytes(self) -> float:
        """Bytes of one exchange (one all-reduce of the payload)."""
        return self.bytes_per_step if self.bytes_per_exchange is None else self.bytes_per_exchange

    def slowest_rank(self) -> int:
        return max(self.compute_ms, key=lambda r: float(np.median(self.compute_ms[r])))


#: strategies the simulator runs without a barrier (``simulate._free_running``): a period is
#: one clock, from when every worker had finished the previous clock to when every worker has
#: finished this one, and ranks are not at the same step at the same moment
FREE_RUNNING = ("ssp", "async", "hogwild")
#: free-running strategies with no bound at all: no worker ever waits for another, and their
#: telemetry's idle is 0 by definition
UNBOUNDED = ("async", "hogwild")
#: strategies whose workers each pay their own exchange (a push and a pull to the servers),
#: with no collective that makes one worker wait for another's
OWN_EXCHANGE = ("ssp", "async")
#: strategies that exchange every H-th step only (H local steps, then one all-reduce): the
#: other steps send nothing, so neither the median of the bytes per step nor a step drawn at
#: random says what an exchange costs
PERIODIC = ("local", "diloco")


def _kind(strategy: str) -> str | None:
    try:
        return parse_sim_strategy(strategy).kind
    except UsageError:
        return None


def _period(strategy: str) -> int:
    """H for plain ``local:H`` and ``diloco:H``, else 1 (streaming DiLoCo is refused by
    ``_calibrated``: its exchanges are fragments)."""
    try:
        parsed = parse_sim_strategy(strategy)
    except UsageError:
        return 1
    if parsed.kind in PERIODIC and not parsed.streaming:
        return int(parsed.param)
    return 1


def _round_ms(records: list[StepRecord], ends: list[int]) -> float | None:
    """The median over rounds of the time per step of a round, a round being the steps after
    exchange step ``ends[i-1]`` up to ``ends[i]``: the slowest rank's compute + sync summed
    over the round (its last step's sync holds the barrier wait), over the round's steps
    (ms), as a barrier run's step is the slowest rank's compute + sync; None without a whole
    round."""
    spent: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        i = bisect.bisect_left(ends, r.step)  # the round whose exchange step ends it
        if 0 < i < len(ends):
            spent[i][r.rank] += r.compute + r.sync
    rounds = [
        1000.0 * max(by_rank.values()) / (ends[i] - ends[i - 1]) for i, by_rank in spent.items()
    ]
    return float(np.median(rounds)) if rounds else None


def _period_ms(records: list[StepRecord], steps: list[int]) -> float | None:
    """The median over ``steps`` of the time from when every rank had finished the step before
    to when every rank has finished this one (the records' wall-clock times; ms), or None
    where no step of ``steps`` has a step recorded before it."""
    done: dict[int, float] = {}
    for r in records:
        done[r.step] = max(done.get(r.step, -math.inf), r.time + r.compute + r.sync)
    order = sorted(done)
    ends = np.maximum.accumulate([done[t] for t in order])  # a step is done once all before are
    end_of = dict(zip(order, ends, strict=True))
    before = dict(zip(order[1:], ends[:-1], strict=True))
    periods = [1000.0 * (end_of[t] - before[t]) for t in steps if t in before]
    return float(np.median(periods)) if periods else None


def _planned_bucket_mb(run_dir: str | Path, asked: Any) -> float | None:
    """The bucket size the run trained with: the one asked for, or under ``auto`` the plan it
    kept (report.json's ``strategy_summary``; the default plan where that is missing)."""
    if asked is None:
        return None
    if asked != "auto":
        return float(asked)
    report = Path(run_dir) / "report.json"
    try:
        kept = json.loads(report.read_text())["strategy_summary"]["bucket_mb"]
        return float(kept)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _collective_steps(run_dir: str | Path, steps: list[int]) -> np.ndarray | None:
    try:
        spans = read_spans(run_dir)
    except (OSError, ValueError):
        return None
    compute_end: dict[int, dict[int, float]] = defaultdict(dict)
    bucket_end: dict[tuple[int, int], float] = {}
    for sp in spans:
        if sp.name == "compute":
            compute_end[sp.step][sp.rank] = sp.start + sp.dur
        elif sp.cat == "comm" and sp.name.startswith("allreduce"):
            key = (sp.step, sp.rank)
            bucket_end[key] = max(bucket_end.get(key, 0.0), sp.start + sp.dur)
    out = []
    for t in steps:
        ends = compute_end.get(t)
        if not ends:
            return None
        last = max(ends, key=lambda r: ends[r])
        if (t, last) not in bucket_end:
            return None
        out.append(1000.0 * max(0.0, bucket_end[(t, last)] - ends[last]))
    return np.asarray(out)


RUN_FILES = "metrics.jsonl (per-rank step records) and config.json (nproc, strategy, bucket_mb)"


def _read_run_records(run_dir: str | Path) -> list[StepRecord]:
    """The run's step records, or a UsageError that says what a run directory holds."""
    path = Path(run_dir)
    if not path.exists():
        raise UsageError(f"--from {run_dir}: no such directory; a run directory holds {RUN_FILES}")
    if not path.is_dir():
        raise UsageError(
            f"--from {run_dir}: is a file, not a directory; a run directory holds {RUN_FILES}"
        )
    if not (path / "metrics.jsonl").is_file():
        from gradsync.telemetry.cli import runs_below

        below = runs_below(path)  # a replica-groups or compare directory: its runs are below
        raise UsageError(
            f"--from {run_dir}: not a gradsync run directory (no metrics.jsonl); "
            + (below or f"it needs {RUN_FILES}, as written by gradsync run --out DIR")
        )
    try:
        return read_records(path)
    except (OSError, ValueError, TypeError) as exc:
        raise UsageError(f"--from {run_dir}: cannot read its metrics.jsonl: {exc}") from None


def load_profile(run_dir: str | Path, warmup: int = 2) -> RunProfile:
    """Read ``metrics.jsonl`` (and ``config.json``, ``spans.jsonl`` if present), skipping
    ``warmup`` steps."""
    recorded = _read_run_records(run_dir)
    every = [r for r in recorded if not r.skipped]
    records = every
    steps = sorted({r.step for r in records})
    if len(steps) <= warmup:
        raise UsageError(f"{run_dir} has {len(steps)} steps; need more than --warmup {warmup}")
    keep = set(steps[warmup:])
    records = [r for r in records if r.step in keep]
    config = _read_run_config(run_dir)
    compute: dict[int, list[float]] = defaultdict(list)
    step_wall: dict[int, float] = defaultdict(float)
    grid: dict[int, dict[int, tuple[float, float]]] = defaultdict(dict)
    for r in records:
        compute[r.rank].append(1000.0 * r.compute)
        step_wall[r.step] = max(step_wall[r.step], 1000.0 * (r.compute + r.sync))
        grid[r.step][r.rank] = (1000.0 * r.compute, 1000.0 * r.comm)
    ranks = sorted(compute)
    full = [t for t in sorted(grid) if len(grid[t]) == len(ranks)]
    if not full:
        raise UsageError(f"{run_dir}: no step after warm-up was recorded by every rank")
    collective = _collective_steps(run_dir, full) if Path(run_dir).is_dir() else None
    strategy = str(config.get("strategy", "bsp"))
    measured = float(np.median(list(step_wall.values())))
    if _kind(strategy) in FREE_RUNNING:
        # Ranks are not at the same step at the same moment: the slowest rank's compute + sync
        # at a step is the longest of the ranks' steps, above the pace at which the run went
        # (the median of a 4-worker ssp:1 run's was 24% above it)
        measured = _period_ms(every, full) or measured
    period = _period(strategy)
    outside = _outside_ms(records, full, ranks)
    bytes_per_step = float(np.median([r.bytes for r in records]))
    bytes_per_exchange: float | None = None
    exchange_rows: np.ndarray | None = None
    local_overhead = 0.0
    if period > 1:
        sent = _exchanges_sent(records, full)
        bytes_per_exchange = sent.bytes_per_exchange
        bytes_per_step = bytes_per_exchange / period
        exchange_rows = sent.rows
        local_overhead = sent.local_overhead_ms
        # The statistic predict reports for H-step periods: a round's time over its steps
        # (the per-step median is a local step's, the exchange lost to it)
        measured = _round_ms(records, sorted(sent.steps & set(full))) or measured
    return RunProfile(
        nproc=int(config.get("nproc", len(compute))),
        strategy=strategy,
        bucket_mb=_planned_bucket_mb(run_dir, config.get("bucket_mb")),
        compute_ms={k: np.asarray(v) for k, v in sorted(compute.items())},
        bytes_per_step=bytes_per_step,
        measured_step_ms=measured,
        # The report's own function (gradsync report), over the steps the prediction models
        measured_barrier_tax=RunReport.from_records(records).barrier_tax,
        report_barrier_tax=RunReport.from_records(recorded).barrier_tax,
        measured_steps=(min(keep), max(keep), len(keep)),
        report_steps=len({r.step for r in recorded}),
        measured_comm_ms=float(np.median([1000.0 * r.comm for r in records])),
        compute_steps=np.asarray([[grid[t][k][0] for k in ranks] for t in full]),
        comm_steps=np.asarray([max(grid[t][k][1] for k in ranks) for t in full]),
        collective_steps=collective,
        comm_spread_steps=np.asarray(
            [
                max(grid[t][k][1] for k in ranks) - float(np.mean([grid[t][k][1] for k in ranks]))
                for t in full
            ]
        ),
        config=config,
        comm_rank_steps=np.asarray([[grid[t][k][1] for k in ranks] for t in full]),
        bytes_per_exchange=bytes_per_exchange,
        period=period,
        exchange_rows=exchange_rows,
        local_overhead_ms=local_overhead,
        outside_rank_steps=outside,
    )


def _read_run_config(run_dir: str | Path) -> dict[str, Any]:
    """The run's ``config.json``, or an empty dict where it has none."""
    cfg_path = Path(run_dir) / "config.json"
    config: dict[str, Any] = {}
    if Path(run_dir).is_dir() and cfg_path.exists():
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"--from {run_dir}: cannot read its config.json: {exc}") from None
    return config


@dataclass(frozen=True, kw_only=True, slots=True)
class _ExchangesSent:
    """What the steps of a ``PERIODIC`` run that sent (its exchanges) carried and cost."""

    bytes_per_exchange: float  # median over the steps that sent of their bytes; 0 without one
    steps: set[int]  # the steps that sent
    rows: np.ndarray | None  # their rows in ``full``; None where no row sent
    local_overhead_ms: float  # median comm of the rank-steps that did not send; 0 without one


def _exchanges_sent(records: list[StepRecord], full: list[int]) -> _ExchangesSent:
    """The exchanges of a run that sends only every H-th step, from its ``records`` (rows of
    ``full``, the steps every rank recorded)."""
    # Only every H-th step sends: the median over steps is 0 bytes (a local:4 run was priced
    # as no exchange at all, its prediction 14-35% off). An exchange is what a step that sent
    # carried; a step draws its comm from those steps.
    sent = [r for r in records if r.bytes > 0]
    exchanged = {r.step for r in sent}
    rows = [i for i, t in enumerate(full) if t in exchanged]
    local = [1000.0 * r.comm for r in records if r.step not in exchanged]
    return _ExchangesSent(
        bytes_per_exchange=float(np.median([r.bytes for r in sent])) if sent else 0.0,
        steps=exchanged,
        rows=np.asarray(rows) if rows else None,
        local_overhead_ms=float(np.median(local)) if local else 0.0,
    )


def _outside_ms(records: list[StepRecord], full: list[int], ranks: list[int]) -> np.ndarray:
    """Per row of ``full`` and rank, the time from the end of the rank's step to the start of
    its next step (ms, at least 0); where the next step was not kept (the last one, a skipped
    step), the rank's median."""
    by_rank: dict[int, dict[int, StepRecord]] = defaultdict(dict)
    for r in records:
        by_rank[r.rank][r.step] = r
    out = np.full((len(full), len(ranks)), np.nan)
    for j, k in enumerate(ranks):
        mine = by_rank[k]
        for i, t in enumerate(full):
            rec, nxt = mine.get(t), mine.get(t + 1)
            if rec is not None and nxt is not None:
                out[i, j] = 1000.0 * max(0.0, nxt.time - (rec.time + rec.compute + rec.sync))
        known = out[:, j][~np.isnan(out[:, j])]
        out[np.isnan(out[:, j]), j] = float(np.median(known)) if known.size else 0.0
    return out


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
            _calibrated(parse_sim_strategy(self.strategy))
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


RESAMPLE_MODES = ("steps", "ranks")


def _calibrated(strategy: SimStrategy) -> SimStrategy:
    """``strategy``, or a UsageError when the calibrated prediction does not model it.

    ``zero:N`` is left out: its measured comm holds an all-gather that neither the run's
    all-reduce spans nor the all-reduce calibration describe. Streaming DiLoCo too: a run's
    step holds one whole model's exchange, not one fragment's overlapped with later steps.
    """
    if strategy.streaming:
        raise UsageError(
            f"simulate --from does not predict {strategy.spec} (the run's per-step comm is a "
            "whole model's exchange, not a fragment's); simulate it without --from, e.g. "
            f"gradsync simulate --strategy {strategy.spec} --message-mb M [--layers LIST]"
        )
    if strategy.kind == "zero":
        raise UsageError(
            f"simulate --from does not predict {strategy.spec} (its all-gather is not in the "
            "all-reduce calibration); simulate it without --from, e.g. "
            f"gradsync simulate --strategy {strategy.spec} --message-mb M"
        )
    return strategy


@dataclass(kw_only=True, slots=True)
class Prediction:
    what_if: str
    # Median over sync periods of the time per step, the same statistic for every strategy
    # (``SimResult.period_step_ms``): the superstep for bsp and ssp:0.
    step_ms: float
    mean_step_ms: float  # wall-clock / steps
    barrier_tax: float  # idle / worker-time, worker-time counted as the telemetry counts it
    comm_ms: float  # median unhidden comm per step
    comm_source: str
    result: SimResult


def _collective_ms(
    profile: RunProfile,
    run_collective: np.ndarray,
    link: AlphaBeta | None,
    table: CollectiveTable | None,
    workers: int,
    ratio: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, str]:
    """Per simulated step, the all-reduce time the slowest rank waits for, and its source."""
    steps = run_collective.shape[0]
    nbytes = profile.exchange_bytes / ratio
    # as the run plans them: a small first bucket, then bucket_mb ones (spec.bucket_sizes_mb)
    total_mb = nbytes / 2**20
    bucket_mb = profile.bucket_mb or default_bucket_mb(total_mb)
    sizes = [mb * 2**20 for mb in bucket_sizes_mb(total_mb, bucket_mb)] or [nbytes]
    buckets = len(sizes)
    if workers < 2:
        return np.zeros(steps), "none (1 worker)"
    if table is not None:
        # Every bucket is charged in full, as if launched when backward ends: the overlap the
        # small first bucket buys is not credited (an upper bound on the exchange).
        draws = [table.sample_s(size, steps, rng, workers) for size in sizes]
        return 1000.0 * np.sum(draws, axis=0), "calibration (measured repeats)"
    if link is not None:
        # Folding the per-bucket latencies into alpha keeps it a single message.
        folded = AlphaBeta(alpha=link.alpha * buckets, beta=link.beta, algorithm=link.algorithm)
        t = CommModel(link=folded, nbytes=nbytes).exchange_ms(workers)
        return np.full(steps, t), "calibration (alpha-beta line)"
    # The run's own all-reduces; compression is assumed to shrink them in proportion.
    return run_collective / ratio, "run telemetry"


def _draw_rows(
    profile: RunProfile, resample: str, workers: int, steps: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The run's rows each simulated (step, worker) takes its compute from, ``(steps,
    workers)``, and the rows each simulated step takes its comm from, ``(steps,)``."""
    n_run = profile.compute_steps.shape[0]
    if resample == "steps":
        rows = np.broadcast_to(rng.integers(n_run, size=steps)[:, None], (steps, workers))
        comm_rows = rows[:, 0]
    else:
        rows = rng.integers(n_run, size=(steps, workers))
        comm_rows = rng.integers(n_run, size=steps)
    if profile.exchange_rows is not None:
        # Every simulated exchange is one of the run's exchanges (local:H, diloco:H), whatever
        # the strategy simulated: a step drawn at random is a local step, with none.
        comm_rows = profile.exchange_rows[rng.integers(len(profile.exchange_rows), size=steps)]
    return rows, comm_rows


def _source_ranks(
    profile: RunProfile,
    cols: np.ndarray,
    steps: int,
    remove_straggler: bool,
    rng: np.random.Generator,
) -> np.ndarray:
    """The measured rank each simulated (step, worker) takes its compute from: its column of
    ``cols``, or with the straggler removed another rank in the straggler's place."""
    n_ranks = profile.compute_steps.shape[1]
    src = np.broadcast_to(cols, (steps, len(cols))).copy()
    if remove_straggler and n_ranks > 1:
        slow = profile.slowest_rank()
        others = np.array([k for k in range(n_ranks) if k != slow])
        hit = src == slow
        # The straggler gets another rank's compute at the same step: pooled, still correlated.
        src[hit] = rng.choice(others, size=int(hit.sum()))
    return src


def _run_collective_and_overhead(
    profile: RunProfile, comm_rows: np.ndarray, steps: int, host_overhead: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Per simulated step, the run's all-reduce at the step drawn and the host's overhead
    around it (the rest of the step's comm; zeros without spans or ``host_overhead``)."""
    run_comm = profile.comm_steps[comm_rows]
    if profile.collective_steps is None:
        run_collective, overhead = run_comm, np.zeros(steps)
    else:
        run_collective = profile.collective_steps[comm_rows]
        overhead = np.maximum(run_comm - run_collective, 0.0)
    if not host_overhead:
        overhead = np.zeros(steps)
    return run_collective, overhead


def _pays_own_exchange(
    strategy: SimStrategy,
    profile: RunProfile,
    link: AlphaBeta | None,
    table: CollectiveTable | None,
    workers: int,
) -> bool:
    """Whether each simulated worker is charged its own measured exchange, not a shared one."""
    # A parameter-server run predicted as one: each worker pays its own push and pull, as the
    # run measured it at the step drawn (the slowest rank's, charged to every worker, put a
    # 4-worker ssp:1 run's mean step 13% high). With a calibration the exchange is modelled
    # as one all-reduce for every worker, as before.
    return (
        strategy.kind in OWN_EXCHANGE
        and _kind(profile.strategy) in OWN_EXCHANGE
        and profile.comm_rank_steps is not None
        and link is None
        and table is None
        and workers > 1
    )


def _between_steps_ms(
    profile: RunProfile, rows: np.ndarray, cols: np.ndarray, steps: int, workers: int
) -> np.ndarray:
    """Per simulated (step, worker), the run's time between the worker's steps at the step
    drawn where the run had no barrier; zeros where it had one."""
    # A run without a barrier: each worker's time between its steps delays only itself, and
    # no other rank's sync holds it, so it is charged to the worker (with the step drawn).
    outside = profile.outside_rank_steps
    free = _kind(profile.strategy) in FREE_RUNNING and outside is not None
    return outside[rows, cols] if free and outside is not None else np.zeros((steps, workers))


def _hogwild_compute(
    profile: RunProfile,
    compute: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    between: np.ndarray,
) -> tuple[np.ndarray, str]:
    """A simulated hogwild worker's step (``compute`` plus what else the run's worker spent
    on its own step), and where that came from."""
    # Nothing is exchanged: the simulator charges no comm. A hogwild run's comm is each
    # worker's own update into the shared copy (its optimizer step), part of its step and
    # waiting for no other worker; without it (and the time between steps) the prediction
    # was the compute alone (a 2-worker run: -85%). Another strategy's comm holds its
    # exchange: none is charged.
    if _kind(profile.strategy) == "hogwild" and profile.comm_rank_steps is not None:
        own_update = profile.comm_rank_steps[rows, cols]
        return (
            compute + own_update + between,
            "run telemetry (each worker's own update; no exchange)",
        )
    return compute + between, "none (hogwild exchanges nothing)"


def _with_local_overhead(
    strategy: SimStrategy, profile: RunProfile, compute: np.ndarray
) -> np.ndarray:
    """``compute`` with the run's local-step overhead added to each simulated local step of a
    ``PERIODIC`` strategy (every step but a round's last and the run's last)."""
    if strategy.kind in PERIODIC and profile.local_overhead_ms > 0:
        # A local step of the run paid its own comm (the optimizer step, the host's work) on
        # top of compute; the simulated round's exchange step pays the exchange's instead.
        steps = compute.shape[0]
        h = int(strategy.param)
        local_step = (np.arange(steps) + 1) % h != 0
        local_step[-1] = False
        compute = compute + np.where(local_step, profile.local_overhead_ms, 0.0)[:, None]
    return compute


def _barrier_tax(
    profile: RunProfile,
    res: SimResult,
    strategy: SimStrategy,
    comm_rows: np.ndarray,
    leave_out_spread: bool,
    unrecorded_ms: float,
) -> float:
    """The simulated idle over the worker-time, counted as the run's telemetry counts them.

    ``leave_out_spread``: leave the spread of comm across ranks at the steps drawn
    (``comm_rows``) out of the worker-time; ``unrecorded_ms``: the time between steps that
    was charged to the workers, which the telemetry does not count either.
    """
    spread = np.zeros(res.steps)
    if profile.comm_spread_steps is not None and leave_out_spread:
        spread = profile.comm_spread_steps[comm_rows]
    # The run's telemetry counts each rank's own compute + sync; the spread of comm across
    # ranks (late starters) is outside it. Without this the tax is divided by more
    # worker-time than the measured one, and comes out low. Only steps that pay comm have it.
    unrecorded = np.minimum(spread, res.comm_ms)
    busy = res.workers * (res.wall_ms - float(unrecorded.sum()))
    idle = float(res.idle_ms.sum())
    if strategy.kind in UNBOUNDED and res.final_wait_ms is not None:
        # Nothing makes an async or hogwild worker wait for another until the run ends, when
        # one that finished its last step waits for the slowest in report(), outside every
        # step record: the telemetry counts neither that wait nor its time (its idle is 0 by
        # definition). Counted, two workers of different speeds had 10-25% of "barrier tax"
        # predicted where the run measured 0. (Under ssp:S, whose bound the telemetry counts,
        # the simulated idle is kept whole: ssp:0 is bsp, whose last step waits too.)
        waited = float(res.final_wait_ms.sum())
        idle, busy = idle - waited, busy - waited
    busy -= unrecorded_ms  # nor the time between steps
    return max(0.0, idle / busy) if busy > 0 else 0.0


def predict(
    profile: RunProfile,
    link: AlphaBeta | None,
    what_if: WhatIf | None = None,
    *,
    table: CollectiveTable | None = None,
    resample: str = "steps",
    host_overhead: bool = True,
    steps: int = 1000,
    seed: int = 0,
) -> Prediction:
    """Simulate the (changed) run on ``steps`` steps resampled from its telemetry.

    A step costs the slowest rank's compute plus the comm it cannot hide. That comm is the
    all-reduce (from ``table``, else ``link``, else the run's own) plus the host's overhead
    around it measured in the run (write-back, optimizer, start skew between ranks).
    ``resample="steps"`` draws whole steps, keeping what ranks (and comm) shared at a step;
    ``"ranks"`` draws each rank's compute and the comm independently. ``host_overhead=False``
    drops the run's overhead, leaving compute plus the all-reduce alone.
    """
    if resample not in RESAMPLE_MODES:
        raise UsageError(f"resample must be one of {', '.join(RESAMPLE_MODES)}, got {resample!r}")
    wi = what_if or WhatIf()
    rng = np.random.default_rng(seed)
    workers = wi.workers or profile.nproc
    # A bigger world cycles the measured ranks, keeping the share of slow ones.
    cols = np.arange(workers) % profile.compute_steps.shape[1]
    # the random draws in this order, so that a seed predicts what it always has
    rows, comm_rows = _draw_rows(profile, resample, workers, steps, rng)
    src = _source_ranks(profile, cols, steps, wi.remove_straggler, rng)
    compute = profile.compute_steps[rows, src]
    run_collective, overhead = _run_collective_and_overhead(
        profile, comm_rows, steps, host_overhead
    )
    collective, source = _collective_ms(
        profile, run_collective, link, table, workers, wi.compression_ratio, rng
    )
    if profile.collective_steps is not None and host_overhead:
        source += " + run overhead"
    comm_steps = collective + overhead if workers > 1 else np.zeros(steps)
    strategy: SimStrategy = _calibrated(parse_sim_strategy(wi.strategy or profile.strategy))
    own = _pays_own_exchange(strategy, profile, link, table, workers)
    between = _between_steps_ms(profile, rows, cols, steps, workers)
    unrecorded_ms = float(between.sum())
    if own:
        assert profile.comm_rank_steps is not None
        comm_steps = profile.comm_rank_steps[rows, cols] / wi.compression_ratio + between
        source = "run telemetry (each worker's own)"
    elif strategy.kind != "hogwild":
        compute = compute + between  # a barrier waits for it as for the worker's compute
    if strategy.kind == "hogwild":
        compute, source = _hogwild_compute(profile, compute, rows, cols, between)
        comm_steps = np.zeros(steps)
    compute = _with_local_overhead(strategy, profile, compute)
    res = simulate(strategy, compute, CommModel(comm_ms=0.0), comm_steps=comm_steps)
    # (each worker's own comm is what its telemetry counts: nothing outside it to leave out)
    leave_out_spread = host_overhead and workers > 1 and not own
    return Prediction(
        what_if=wi.describe(),
        step_ms=float(np.median(res.period_step_ms())),
        mean_step_ms=res.wall_ms / steps,
        barrier_tax=_barrier_tax(
            profile, res, strategy, comm_rows, leave_out_spread, unrecorded_ms
        ),
        comm_ms=float(np.median(comm_steps)),
        comm_source=source,
        result=res,
    )
