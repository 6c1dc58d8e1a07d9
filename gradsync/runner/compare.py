"""``gradsync compare``: the same workload and seed under several strategies, side by side.

Each strategy runs in turn through the same launcher as ``gradsync run``, into its own
sub-directory. The table compares final loss, steps and wall time to a common target loss,
samples/s, bytes sent and barrier tax; two plots show loss against wall-clock and against
bytes sent.

Bytes sent are every rank's payload: what workers hand to collectives (before the algorithm's
2(n-1)/n factor), and under ``ssp:S``/``async`` the workers' pushes plus the servers' replies
(the parameter pulls). Telemetry records only the pushes (servers keep no step records), so
the pulls are added here: one reply per worker step, the shard's parameters after a
one-element header, from each server; counted from the built-in workload's model, or for a
script from the size its rank 0 wrote into the run's config.json (``pull_bytes_per_step``).
"""

from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from gradsync.errors import UsageError
from gradsync.progress import HEARTBEAT_FILE, Progress, read_heartbeat
from gradsync.runner.config import RunConfig
from gradsync.runner.rundir import COMPARE_FILE, claim
from gradsync.strategies.factory import parse_strategy, uses_servers
from gradsync.telemetry.records import METRICS_FILE, StepRecord, read_records
from gradsync.telemetry.report import RunReport

SMOOTH = 10  # steps in the moving average that decides when a target loss is reached


@dataclass(slots=True)
class Curve:
    strategy: str
    steps: np.ndarray
    loss: np.ndarray  # mean over workers, smoothed
    raw: np.ndarray  # mean over workers, as reported step by step (the progress line's loss)
    seconds: np.ndarray  # wall-clock at the end of each step, from the run's first step
    bytes: np.ndarray  # cumulative, all ranks
    report: RunReport
    #: False for a parameter-server run whose pulls are not in ``bytes`` (its size unknown)
    pulls_counted: bool = True

    def first_below(self, target: float) -> int | None:
        hits = np.nonzero(self.loss <= target)[0]
        return int(hits[0]) if hits.size else None


def curve_from_records(strategy: str, records: list[StepRecord], pull_bytes: int = 0) -> Curve:
    """``pull_bytes``: bytes the servers send each worker per step (parameter-server runs),
    counted with the workers' own bytes."""
    steps = sorted({r.step for r in records})
    by_step: dict[int, list[StepRecord]] = {}
    for r in records:
        by_step.setdefault(r.step, []).append(r)
    start = min(r.time for r in records)
    loss = np.array(
        [np.mean([r.loss for r in by_step[s] if r.loss is not None] or [np.nan]) for s in steps]
    )
    kernel = np.ones(SMOOTH)
    valid = ~np.isnan(loss)
    # Trailing moving average that tolerates the first steps (fewer than SMOOTH values).
    sums = np.convolve(np.where(valid, loss, 0.0), kernel)[: len(loss)]
    counts = np.convolve(valid.astype(float), kernel)[: len(loss)]
    smooth = np.divide(sums, counts, out=np.full_like(sums, np.nan), where=counts > 0)
    seconds = np.array(
        [max(r.time + r.compute + r.sync for r in by_step[s]) - start for s in steps]
    )
    nbytes = np.cumsum([sum(r.bytes + pull_bytes for r in by_step[s]) for s in steps])
    return Curve(
        strategy,
        np.array(steps),
        smooth,
        loss,
        np.maximum.accumulate(seconds),
        nbytes,
        RunReport.from_records(records),
    )


def parse_strategies(text: str) -> list[str]:
    specs = [s.strip() for s in text.split(",")]
    if not any(specs):
        raise UsageError("--strategies needs at least one strategy, e.g. bsp,local:8,ssp:2")
    if not all(specs):
        # "bsp,,local:2" is likelier a strategy lost in editing than two meant ones
        raise UsageError(
            f"--strategies has an empty item in {text!r}: give comma-separated strategy specs, "
            "e.g. bsp,local:8,ssp:2"
        )
    for s in specs:
        parse_strategy(s)
    if len(set(specs)) != len(specs):
        raise UsageError(f"--strategies lists a strategy twice: {text!r}")
    return specs


def check_target_loss(target: float | None, script: list[str] | None) -> None:
    """``UsageError`` for a ``--target-loss`` no run can reach: nan or inf (every row showed
    "never"), or a negative one on a built-in workload (charlm's cross-entropy and mlp's
    squared error are >= 0). A script's own loss may be negative (a negated reward, a
    log-likelihood), so there any finite target goes."""
    if target is None:
        return
    if not math.isfinite(target):
        raise UsageError(f"--target-loss must be a finite number, got {target}")
    if target < 0 and not script:
        raise UsageError(
            f"--target-loss {target:g} is below 0, which the built-in workloads' losses never "
            "are: give a target >= 0 (or leave it out for the worst final loss of the set)"
        )


def refuse_strategy_flag(strategy: str | None) -> None:
    """compare takes its strategies from ``--strategies``; a ``--strategy`` (a `gradsync run`
    flag) would otherwise be silently ignored."""
    if strategy is not None:
        example = strategy if strategy.strip() == "bsp" else f"bsp,{strategy}"
        raise UsageError(
            f"gradsync compare takes --strategies (comma-separated), not --strategy "
            f"{strategy!r}; e.g. --strategies {example}"
        )


#: ``gradsync run``'s flags (RunConfig fields) that compare refuses, for its --help to leave out
#: as it leaves out --strategy: compare runs every strategy on local processes.
RUN_ONLY_FIELDS = frozenset(
    {
        "strategy",
        "hosts",
        "link",
        "replica_groups",
        "lighthouse",
        "min_replicas",
        "heartbeat_timeout",
    }
)


def refuse_run_only_flags(cfg: RunConfig) -> None:
    """compare launches each strategy on this machine's processes: an emulated cluster
    (``--hosts``, and ``--link``, which RunConfig accepts only with it) would be silently
    ignored, and the comparison would time local runs while claiming cluster ones."""
    if cfg.hosts:
        raise UsageError(
            f"gradsync compare runs each strategy on local processes: --hosts {cfg.hosts} and "
            f"--link {cfg.link} (the emulated cluster) are gradsync run's; run each strategy "
            f"there instead, e.g. gradsync run --hosts {cfg.hosts} --link {cfg.link} "
            "--strategy bsp, or compare without --hosts and --link"
        )
    if cfg.replica_groups:
        raise UsageError(
            f"gradsync compare runs each strategy on one group of local processes: "
            f"--replica-groups {cfg.replica_groups} (live membership) is gradsync "
            "run's; run it there, e.g. gradsync run --replica-groups "
            f"{cfg.replica_groups} --nproc 1 --strategy bsp"
        )


def pull_bytes_per_step(cfg: RunConfig) -> int:
    """Bytes the parameter servers send one worker per step: every trainable parameter, plus
    a one-element header from each server (``ParameterServer``'s reply)."""
    from gradsync.workloads import make_workload

    model = make_workload(cfg.workload, seed=cfg.seed, data=cfg.data, params=cfg.params)
    params = [p for p in model.build_model().parameters() if p.requires_grad]
    header = params[0].element_size() if params else 0
    return sum(p.numel() * p.element_size() for p in params) + cfg.servers * header


def scripts_pull_bytes(run_dir: Path) -> int | None:
    """What a script's parameter servers replied to one worker step, as its rank 0 counted
    it into config.json (``attached_run.pulled_bytes``); None where it is not there."""
    try:
        value = json.loads((run_dir / "config.json").read_text()).get("pull_bytes_per_step")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def run_comparison(
    base: RunConfig, strategies: list[str], target: float | None, show_progress: bool = True
) -> dict[str, Any]:
    """Each strategy's run in turn into ``OUT/<strategy>``, then ``OUT/compare.json``. ``OUT``
    and each run's directory are locked as ``gradsync run`` locks its own (``rundir.claim``),
    and refused as it refuses them: in use by another run, or holding one unless ``--resume``
    or ``--overwrite`` is given."""
    refuse_run_only_flags(base)
    check_target_loss(target, base.script)
    # Each strategy's own config is checked before the first run starts: one refused (bsp
    # under --bucket-mb auto with --compress) would otherwise stop the comparison midway.
    for spec in strategies:
        try:
            _config(base, spec)
        except UsageError as exc:
            raise UsageError(f"--strategies {spec}: {exc}") from None
    out = Path(base.out)
    # Held until the comparison ends: no run or comparison writes into OUT meanwhile.
    claimed = claim(out, resume=base.resume, overwrite=base.overwrite)
    try:
        # A script's steps are its own: the line then shows each run's step alone.
        per_run = 0 if base.script else base.steps
        progress = Progress(per_run * len(strategies), enabled=show_progress)
        curves: list[Curve] = []
        pulls: int | None = None
        for i, spec in enumerate(strategies):
            progress.label = f"{spec} ({i + 1}/{len(strategies)})"
            cfg, records = _run_one(base, spec, progress, i * per_run)
            pull: int | None = 0
            if uses_servers(spec) and base.script:
                # a script's model is not known here: its rank 0 counted the reply
                pull = scripts_pull_bytes(Path(cfg.out))
            elif uses_servers(spec):
                if pulls is None:  # the same model and servers for every strategy: count once
                    pulls = pull_bytes_per_step(cfg)
                pull = pulls
            curve = curve_from_records(spec, records, pull or 0)
            curve.pulls_counted = pull is not None
            curves.append(curve)
            # The same loss the runs' own progress lines show: this step's, not the average.
            last = float(curve.raw[-1])
            # A script's run: the steps it took (its line shows each run's step alone), where
            # per_run's 0 made the line end at "step 0"
            done = (i + 1) * per_run if per_run else int(curve.steps[-1]) + 1
            progress.update(done, None if np.isnan(last) else last, 0.0, 0.0, last=True)
        progress.close()
        return summarize(curves, target, out, plots=base.plots)
    finally:
        claimed.release()


def _config(base: RunConfig, spec: str) -> RunConfig:
    """Strategy ``spec``'s run of the comparison (RunConfig checks it as it is made)."""
    # --servers is for the parameter-server strategies; the others run without servers.
    servers = base.servers if uses_servers(spec) else 1
    run_dir = Path(base.out) / _dirname(spec)
    return replace(base, strategy=spec, servers=servers, out=str(run_dir), progress=False)


def _run_one(
    base: RunConfig, spec: str, progress: Progress, offset: int
) -> tuple[RunConfig, list[StepRecord]]:
    """One strategy's run into its own locked directory; its config and step records."""
    from gradsync.processes.launch import launch
    from gradsync.runner.worker import run_rank

    cfg = _config(base, spec)
    run_dir = Path(cfg.out)
    # OUT passed claim() (empty, --resume or --overwrite): its runs are this comparison's
    # to continue or start over, and any other run's directory in it is refused.
    claimed = claim(run_dir, resume=base.resume, overwrite=not base.resume)
    try:
        (run_dir / METRICS_FILE).unlink(missing_ok=True)
        (run_dir / HEARTBEAT_FILE).unlink(missing_ok=True)
        # Each run's strategy is the comparison's, also for a script's Synchronizer (which
        # takes it as if given on the command line: one naming its own is refused)
        # compare_run: rank 0's straggler notices name the run they are of (attached_run)
        given = ["strategy", "servers"] if uses_servers(spec) else ["strategy"]
        cfg.save(run_dir, given=given, compare_run=progress.label or spec)
        stop = threading.Event()
        watcher = threading.Thread(
            target=_watch, args=(run_dir, offset, progress, stop), daemon=True
        )
        watcher.start()
        try:
            # --max-restarts as under gradsync run: the workers resume from their checkpoints
            launch(
                run_rank,
                (cfg.to_dict(),),
                nproc=cfg.processes,
                threads=cfg.threads,
                max_restarts=cfg.max_restarts,
            )
        finally:
            stop.set()
            watcher.join()
        return cfg, read_records(run_dir)
    finally:
        claimed.release()


def _watch(
    run_dir: Path,
    offset: int,
    progress: Progress,
    stop: threading.Event,
    interval: float = 1.0,
) -> None:
    """Advance the comparison's progress line from the heartbeat rank 0 of the run rewrites
    at every progress update (every strategy, parameter server included)."""
    seen = None
    while not stop.wait(interval):
        beat = read_heartbeat(run_dir)
        if beat is None or beat == seen:
            continue
        seen = beat
        loss = beat.get("loss")
        progress.update(offset + int(beat.get("step", 0)), loss, 0.0, 0.0)


def _dirname(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", spec).strip("-")


def summarize(
    curves: list[Curve], target: float | None, out: Path, plots: bool = True
) -> dict[str, Any]:
    finals = [float(c.loss[-1]) for c in curves]  # smoothed: the moving average's last
    # Default target: the worst smoothed final loss, so every strategy reaches it and the
    # table compares how fast each gets there.
    goal = target if target is not None else max(finals)
    rows = []
    for c, final in zip(curves, finals, strict=True):
        # "final loss" is the last step's loss averaged over the ranks, the quantity of
        # gradsync run's "final loss:" line and report.json; the moving average beside it.
        last = float(c.raw[-1])
        hit = c.first_below(goal)
        wall = float(c.seconds[-1])
        samples = sum(t.samples for t in c.report.ranks)
        rows.append(
            {
                "strategy": c.strategy,
                "final_loss": None if np.isnan(last) else last,
                "final_loss_moving_average": final,
                "steps_to_target": None if hit is None else int(c.steps[hit]) + 1,
                "seconds_to_target": None if hit is None else float(c.seconds[hit]),
                # None when no step counted samples (a script whose sync.step() is given
                # no samples=): unknown, not zero
                "samples_per_s": samples / wall if wall > 0 and samples > 0 else None,
                "mb_sent": float(c.bytes[-1]) / 1e6,
                # False: a parameter-server run's pulls are not in mb_sent (size unknown)
                "pulls_counted": c.pulls_counted,
                "barrier_tax": c.report.barrier_tax,
                "wall_s": wall,
            }
        )
    result = {"target_loss": goal, "rows": rows}
    (out / COMPARE_FILE).write_text(json.dumps(result, indent=2) + "\n")
    result["plots"] = [str(p) for p in _plots(curves, goal, out)] if plots else []
    return result


def format_table(result: dict[str, Any]) -> str:
    head = (
        f"{'strategy':<12} {'final loss':>10} {'avg ' + str(SMOOTH):>8} {'steps→target':>12} "
        f"{'s→target':>9} "
        f"{'samples/s':>10} {'MB sent':>9} {'barrier tax':>11}"
    )
    lines = [f"target loss: {result['target_loss']:.4f} ({SMOOTH}-step moving average)", head]
    lines.append("-" * len(head))
    for r in result["rows"]:
        steps = "never" if r["steps_to_target"] is None else str(r["steps_to_target"])
        secs = "never" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.2f}"
        final = "n/a" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        rate = "n/a" if r["samples_per_s"] is None else f"{r['samples_per_s']:,.0f}"
        lines.append(
            f"{r['strategy']:<12} {final:>10} {r['final_loss_moving_average']:>8.4f} "
            f"{steps:>12} {secs:>9} "
            f"{rate:>10} {r['mb_sent']:>9.1f} {r['barrier_tax']:>11.1%}"
        )
    lines.append(
        f"final loss: the last step's, as gradsync run reports it; avg {SMOOTH}: its "
        f"{SMOOTH}-step moving average, which the target is met by"
    )
    lines.append(
        "MB sent: every rank's payload; for ssp/async, pushes to and pulls from the servers"
    )
    pushes_only = [r["strategy"] for r in result["rows"] if not r.get("pulls_counted", True)]
    if pushes_only:
        lines.append(
            f"  ({', '.join(pushes_only)}: pushes only, the run recorded no size of the "
            "servers' reply)"
        )
    lines.append(
        "barrier tax: every rank's idle over every rank's wall time, all steps (a straggler "
        "notice's idle is the other ranks' over the notice's steps alone)"
    )
    lines += [f"plot: {p}" for p in result.get("plots", [])]
    return "\n".join(lines)


def _plots(curves: list[Curve], target: float, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, xlabel, get in (
        ("loss_vs_time.png", "wall-clock time (s)", lambda c: c.seconds),
        ("loss_vs_bytes.png", "bytes sent, all ranks (MB)", lambda c: c.bytes / 1e6),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for c in curves:
            ax.plot(get(c), c.loss, label=c.strategy)
        ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.3f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"training loss ({SMOOTH}-step moving average)")
        ax.set_title("Loss against " + ("wall-clock" if "time" in name else "bytes sent"))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
