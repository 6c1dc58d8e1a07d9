"""The worker that ``gradsync run`` starts on every rank (also runnable under torchrun)."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

import torch

from gradsync import compat, runtime
from gradsync.config import RunConfig
from gradsync.inject import maybe_kill, parse_kill
from gradsync.progress import HEARTBEAT_FILE, Progress
from gradsync.synchronizer import Synchronizer
from gradsync.telemetry.cli import REPORT_FILE, analyze_records
from gradsync.telemetry.records import (
    METRICS_FILE,
    SPANS_FILE,
    StepRecord,
    read_jsonl,
    read_records,
)
from gradsync.telemetry.report import RunReport
from gradsync.telemetry.stragglers import Finding, StragglerConfig, StragglerDetector
from gradsync.telemetry.trackers import JsonlTracker, Tracker, logger, make_tracker, parse_trackers
from gradsync.workloads import make_workload


class _Rank0Sink:
    """Receives every gathered batch of records on rank 0: writes metrics.jsonl, hands them to
    the --tracker sinks, updates the progress line and warns once per straggler episode.

    Only rank 0 has one: every rank receives the same gathered records, so rank 0's trackers
    hold every rank's scalars, and one writer per run keeps one run per dashboard."""

    def __init__(self, cfg: RunConfig, progress: Progress, world: int) -> None:
        # metrics.jsonl is the JSONL tracker's file, always written: --tracker jsonl adds none
        self.metrics = JsonlTracker(cfg.out)
        self.path = self.metrics.path
        self.trackers = _trackers(cfg)
        self.progress = progress
        self.detector = StragglerDetector(
            StragglerConfig(
                window=cfg.straggler_window,
                threshold=cfg.straggler_threshold,
                warmup=cfg.straggler_warmup,
            ),
            world_size=world,
        )
        self.idle = 0.0
        self.wall = 0.0
        #: False while a restart loads its checkpoint: the records it restores are written,
        #: but neither shown (the progress line waits for the resume line that says where the
        #: run went back) nor given to the straggler detector (they were, before the restart).
        self.showing = True
        self.shown_until: float | None = None  # the end of the newest step shown

    def __call__(self, new: list[StepRecord]) -> None:
        self.metrics.log(new)
        if self.trackers is not None:
            # restored records too, like metrics.jsonl; a failing tracker turns itself off
            self.trackers(new)
        self.idle += sum(r.idle for r in new)
        self.wall += sum(r.compute + r.sync for r in new)
        if not self.showing:
            return
        last = max(r.step for r in new)
        losses = [r.loss for r in new if r.step == last and r.loss is not None]
        # The rate since the last update: a rate since the first record would take in the
        # time a restart spent between two attempts (this process starts after it) and the
        # steps it ran twice; the time between updates (a gather, a save) counts.
        end = max(r.time + r.compute + r.sync for r in new)
        start = min(r.time for r in new) if self.shown_until is None else self.shown_until
        elapsed, self.shown_until = end - start, end
        self.progress.update(
            last + 1,
            sum(losses) / len(losses) if losses else None,
            sum(r.samples for r in new) / elapsed if elapsed > 0 else 0.0,
            self.idle / self.wall if self.wall > 0 else 0.0,
        )
        for finding in self.detector.update(new):
            self.progress.interrupt(f"gradsync: straggler: {finding.describe()}")

    def close_trackers(
        self, report: RunReport | None = None, findings: list[Finding] | None = None
    ) -> None:
        """Give the trackers the run's report (when there is one) and close them. Failures are
        logged, not raised: report.json is written by then, and the run succeeded."""
        if self.trackers is None:
            return
        trackers, self.trackers = self.trackers, None
        try:
            if report is not None:
                trackers.finish(report, findings)
        except Exception:
            logger.exception("the --tracker sinks failed to record the run's report")
        try:
            trackers.close()
        except Exception:
            logger.exception("the --tracker sinks failed to close")


def _trackers(cfg: RunConfig) -> Tracker | None:
    """The --tracker sinks, writing under the run directory, or None."""
    names = [n for n in parse_trackers(cfg.tracker or "jsonl") if n != "jsonl"]
    # all_ranks: this is rank 0's sink already
    return make_tracker(",".join(names), cfg.out, all_ranks=True) if names else None


def _write_spans(sync: Synchronizer, run_dir: Path) -> None:
    """Collective: gather every rank's spans (bucket communication, optimizer) to rank 0."""
    spans = sync.gather_spans()
    if spans is not None:
        with open(run_dir / SPANS_FILE, "w", encoding="utf-8") as fh:
            for span in spans:
                fh.write(span.to_json() + "\n")


CHECKPOINT_DIR = "checkpoints"
FAULTS_DIR = "faults"
FINAL_MODEL = "final_model.pt"


def _resume(sync: Synchronizer, cfg: RunConfig, run_dir: Path, rank: int) -> int:
    """The step to start at: 0, or the newest checkpoint's after --resume or a restart by
    the elastic agent (it sets TORCHELASTIC_RESTART_COUNT)."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not (cfg.resume or restarted):
        return 0
    extra = sync.load(run_dir / CHECKPOINT_DIR) if cfg.resume or cfg.checkpoint_every else None
    start = int(extra["step"]) if extra else 0
    if rank == 0:
        # Every step from here on runs again, a restart without checkpoints included: their
        # earlier records would count the rolled-back work twice in the report.
        _drop_records_from(run_dir / METRICS_FILE, start)
        why = "restart" if restarted else "--resume"
        if extra is not None:
            how = "resuming"
        elif cfg.checkpoint_every:
            how = "starting over (no checkpoint was complete yet)"
        else:
            how = "starting over (no --checkpoint-every)"
        count = f" (restart {_restart_count()})" if restarted else ""
        print(f"gradsync: {why}: {how} at step {start}{count}", file=sys.stderr, flush=True)
    return start


def _restart_count() -> str:
    """``N of M``: this round's restart and the most the agent allows (set by torch's agent)."""
    count = os.environ["TORCHELASTIC_RESTART_COUNT"]  # set: this is a restart
    most = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    return f"{count} of {most}" if most else count


def _drop_records_from(path: Path, step: int) -> None:
    """Steps at or after the resume point will run again: forget their old records. And each
    earlier (rank, step) once, its last line: a resume from a checkpoint older than the last
    gather before the failure writes again, in ``load()``, the records it restored, which that
    gather had written already (the same measurements)."""
    if not path.exists():
        return
    latest: dict[tuple[int, int], dict[str, Any]] = {}
    for record in read_jsonl(path):  # a torn last line (a crash, a full disk) is dropped
        if record["step"] < step:
            key = (record["rank"], record["step"])
            latest.pop(key, None)  # a repeat takes its own, later, place
            latest[key] = record
    # Written back as ``StepRecord.to_json`` wrote them: the same text for the same record.
    lines = (json.dumps(record, separators=(",", ":")) + "\n" for record in latest.values())
    path.write_text("".join(lines), encoding="utf-8")


def _log_recovery(directory: Path, resumed_at: int) -> None:
    """When the first step after a resume completed: the end of the outage."""
    directory.mkdir(parents=True, exist_ok=True)
    entry = {
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "resumed_at_step": resumed_at,
        "first_step_done": time.time(),
    }
    with open(directory / "recoveries.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")


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


_PACKAGE = str(Path(__file__).resolve().parent) + os.sep


def _one_line_warnings() -> None:
    """Show gradsync's own warnings in this worker (of its categories, or raised from its
    files) as one ``gradsync: ...`` line each, like the command's other messages. Python's
    format adds the file, line and source text of the ``warnings.warn`` call, which tell a user
    of the command nothing; other warnings keep it."""
    shown = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if category.__module__.split(".")[0] == "gradsync" or filename.startswith(_PACKAGE):
            text = str(message).removeprefix("gradsync: ")
            print(f"gradsync: {text}", file=file or sys.stderr, flush=True)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def run_worker(config_dict: dict[str, Any]) -> dict[str, Any] | None:
    """Train ``config.steps`` steps; rank 0 writes metrics.jsonl and report.json and returns the
    report as a dict (other ranks return None). Parameter-server ranks serve instead."""
    cfg = RunConfig.from_dict(config_dict)
    _one_line_warnings()
    torch.set_num_threads(int(os.environ.get("GRADSYNC_THREADS", cfg.threads)))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = cfg.process_backend(local)
    runtime.init(backend=backend, timeout_s=cfg.timeout)
    rank, world = runtime.rank(), runtime.world_size()
    if rank == 0 and backend == "gloo" and cfg.backend == "auto" and torch.cuda.is_available():
        # Not silently on the CPU where a GPU is visible: say why, and what would use it.
        print(
            f"gradsync: --backend auto: training on the CPU over gloo ({local} process(es) on "
            f"this machine, {torch.cuda.device_count()} GPU(s) visible, strategy "
            f"{cfg.strategy}); --backend nccl with at most one process per GPU trains on them",
            file=sys.stderr,
            flush=True,
        )
    run_dir = Path(cfg.out)
    workload = make_workload(cfg.workload, seed=cfg.seed, data=cfg.data, params=cfg.params)
    model = workload.build_model().to(runtime.device())
    optimizer = workload.make_optimizer(model, cfg.lr or workload.default_lr)
    progress = Progress(
        cfg.steps,
        enabled=cfg.progress and rank == 0,
        heartbeat=run_dir / HEARTBEAT_FILE if rank == 0 else None,  # followed by compare
    )
    workers = cfg.nproc
    sink = _Rank0Sink(cfg, progress, workers) if rank == 0 else None
    sync = _synchronizer(cfg, model, optimizer, sink)
    if sync.is_server:
        # Servers resume too (their parameters, optimizer state and clocks): load is collective.
        _resume(sync, cfg, run_dir, rank)
        sync.serve()
        _write_spans(sync, run_dir)
        sync.close()
        if sink is not None:
            sink.close_trackers()
        return None
    barrier_free = sync.strategy.barrier_free
    if sink is not None:
        sink.showing = False
    start = _resume(sync, cfg, run_dir, rank)
    if sink is not None:
        sink.showing = True
    recovering = start > 0 and rank == 0
    kills = parse_kill(cfg.kill)
    checkpoints = run_dir / CHECKPOINT_DIR
    log = _CheckpointLog(checkpoints)
    for step in range(start, cfg.steps):
        if kills:
            maybe_kill(kills, rank, step, run_dir / FAULTS_DIR)
        loss = _train_step(sync, workload, cfg, step, rank)
        if barrier_free and rank == 0 and (step + 1) % cfg.telemetry_every == 0:
            # No gathering mid-run without a barrier: show rank 0's own view meanwhile.
            progress.update(step + 1, loss, 0.0, 0.0)
        if recovering:
            recovering = False
            _log_recovery(run_dir / FAULTS_DIR, start)
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
    report = sync.report()
    measured = sync.strategy.summary()
    # The final parameters, so runs (interrupted or not) can be compared bit for bit: whole
    # tensors (gathering zero:3's shards is a collective, so every rank takes part).
    final = {
        k: v.full_tensor() if compat.is_dtensor(v) else v for k, v in model.state_dict().items()
    }
    if rank == 0:
        torch.save(final, run_dir / FINAL_MODEL)
    progress.close()
    _write_spans(sync, run_dir)
    sync.close()
    if rank != 0:
        return None
    result = _write_report(run_dir, cfg, report, measured, sink)
    result["world_size"] = world
    return result


def _write_report(
    run_dir: Path,
    cfg: RunConfig,
    report: RunReport,
    measured: dict[str, Any] | None = None,
    sink: _Rank0Sink | None = None,
) -> dict[str, Any]:
    """Write report.json: the report of every step of the run and the straggler findings
    ``gradsync report`` gives, plus what the strategy measured itself (``measured``, under
    "strategy_summary", when it has anything). Built from metrics.jsonl, not this attempt's
    ``report``, which after a restart holds only the steps since the resume point. Returns the
    report's dict."""
    records = read_records(run_dir) if (run_dir / METRICS_FILE).exists() else report.records
    stragglers = StragglerConfig(
        window=cfg.straggler_window,
        threshold=cfg.straggler_threshold,
        warmup=cfg.straggler_warmup,
    )
    analysis = analyze_records(run_dir, records, stragglers)
    written = analysis.run_report()
    if measured:
        written["strategy_summary"] = measured
    (run_dir / REPORT_FILE).write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")
    if sink is not None:  # the trackers end with the same report and findings
        sink.close_trackers(analysis.report, analysis.findings)
    return analysis.report.to_dict()


def _synchronizer(
    cfg: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sink: Any
) -> Synchronizer:
    return Synchronizer(
        model,
        optimizer,
        strategy=cfg.strategy,
        compression=cfg.compression,
        bucket_mb=cfg.bucket_mb,
        allreduce=cfg.allreduce,
        telemetry_every=cfg.telemetry_every,
        slow=cfg.slow,
        on_records=sink,
        servers=cfg.servers,
        timeout_s=cfg.timeout,
        balance=cfg.balance,
        check_every=cfg.check_every,
        record_spans=True,
    )


def _train_step(sync: Synchronizer, workload: Any, cfg: RunConfig, step: int, rank: int) -> float:
    """One step on this rank's shard of the step's global batch; returns its loss."""
    # Balanced runs get this step's shard sizes from measured speed; others split evenly.
    sizes = sync.shard_sizes(cfg.global_batch)
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    micro = cfg.micro_batches
    with sync.step(micro_batches=micro, samples=hi - lo) as s:
        total_loss = torch.zeros((), dtype=torch.float64)
        # Micro-batches split this rank's shard; the Synchronizer averages over them.
        bounds = [lo + (hi - lo) * i // micro for i in range(micro + 1)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            x, y = workload.batch(step, cfg.global_batch, a, b)
            loss = workload.loss(sync.model, x.to(runtime.device()), y.to(runtime.device()))
            loss.backward()
            total_loss += loss.detach().double().cpu()
        s.loss = total_loss / micro
    return float(s.loss)


def main() -> None:
    """``python -m gradsync.worker --config RUN_DIR/config.json``: one worker under torchrun."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", required=True, help="a run's config.json")
    args = parser.parse_args()
    run_worker(json.loads(Path(args.config).read_text(encoding="utf-8")))


if __name__ == "__main__":
    main()
