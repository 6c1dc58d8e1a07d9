"""A Synchronizer attached to a run directory: the files ``gradsync run`` makes, for any script.

``gs.Synchronizer(..., run_dir=DIR)``, or ``GRADSYNC_RUN_DIR=DIR`` in the environment (which
``gradsync run`` sets for the ranks it starts), attaches the Synchronizer to ``DIR``. Whatever
trains, a built-in workload or the user's own script, the run directory then gets the same
files, written by the same code:

- ``metrics.jsonl``: every gathered step record, by rank 0, as they arrive (and the
  ``--tracker`` sinks: TensorBoard, W&B, MLflow), with the live progress line and a notice per
  straggler episode; and those no gather took, from a Synchronizer closed (or a process that
  ended) without ``sync.report()``, by each rank itself (``write_own_records``), which rank
  0's trackers then get too before they end, with how the attempt ended (``FINISHED``,
  ``FAILED``, ``KILLED``);
- ``spans.jsonl``, by each rank itself at each telemetry gather and at its end
  (``write_own_spans``); ``report.json``, by rank 0 at ``sync.report()``;
- ``membership.jsonl`` under live membership (``membership="torchft"``): each step's quorum
  as this replica group saw it, written at the step (``gradsync.telemetry.membership``), and
  ``faults/healed.jsonl``, each healing from a live peer; report.json sums them up;
- the faults the run was asked for (``--kill R:S`` fires at the start of step S on rank R,
  once; ``--slow`` slows the ranks named), and after a restart the records of the steps that
  run again dropped from ``metrics.jsonl`` at ``sync.load()``.

``gradsync report DIR`` (the summary, ``trace.json``, the plots) and ``gradsync simulate
--from DIR`` read them as they read a built-in run's. The settings come from ``DIR/config.json``
when ``gradsync run`` wrote one (the straggler window and threshold, the trackers, the kills,
the slowdowns); under plain ``torchrun`` or ``python`` they are the defaults.

Why in the Synchronizer and not in a wrapper around the script: the step records, the spans
and the step index live there, and a script under ``torchrun`` has no other place gradsync's
code runs in.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradsync.errors import UsageError
from gradsync.inject import maybe_kill, parse_kill
from gradsync.logs import get_logger
from gradsync.membership import REPLICA_ID_ENV, StepQuorum
from gradsync.processes.elastic_env import restart_count
from gradsync.progress import HEARTBEAT_FILE, Progress
from gradsync.telemetry.cli import REPORT_FILE, analyze_records
from gradsync.telemetry.membership import MEMBERSHIP_FILE, MembershipLog, read_group
from gradsync.telemetry.membership import summarize as summarize_membership
from gradsync.telemetry.records import (
    METRICS_FILE,
    SPANS_FILE,
    Span,
    StepRecord,
    drop_steps_from,
    read_jsonl,
    read_records,
    settle_ungathered,
    write_records,
)
from gradsync.telemetry.report import RunReport
from gradsync.telemetry.stragglers import Finding, StragglerConfig, StragglerDetector
from gradsync.telemetry.trackers import (
    FINISHED,
    JsonlTracker,
    Tracker,
    Trackers,
    make_tracker,
    parse_trackers,
    status_of,
)

if TYPE_CHECKING:  # torch is imported by the Synchronizer that calls pulled_bytes
    import torch

__all__ = [
    "ATTEMPTS_FILE",
    "CONFIG_FILE",
    "FAULTS_DIR",
    "GROUP_DIR",
    "HEALED_FILE",
    "RUN_DIR_ENV",
    "AttachedRun",
    "RunSink",
]

#: the environment variable naming the run directory a Synchronizer attaches to
RUN_DIR_ENV = "GRADSYNC_RUN_DIR"
CONFIG_FILE = "config.json"
FAULTS_DIR = "faults"
#: under FAULTS_DIR: each healing of this replica group from a live peer (live membership)
HEALED_FILE = "healed.jsonl"
#: under FAULTS_DIR: each start of a replica group's process (``gradsync run --replica-groups``)
ATTEMPTS_FILE = "attempts.jsonl"
#: under FAULTS_DIR: each time a replica group's torchft Manager came up (``wait_for_groups``)
MANAGER_UP_FILE = "manager_up.jsonl"
#: a replica group's directory in ``gradsync run --replica-groups``' RUN/
GROUP_DIR = "group-{}"
#: how long a group's first process waits for every group's Manager before it trains anyway
GROUPS_START_S = 120.0
#: how long rank 0, ending cleanly without a report, waits for the other ranks' last records
#: before its trackers get them (each rank writes its own as it ends, at about the same time)
OTHERS_RECORDS_S = 5.0

logger = get_logger("run")

#: what a run directory's settings are when no ``config.json`` names them (``gradsync run``'s
#: own defaults, ``gradsync.runner.config.RunConfig``)
_DEFAULTS: dict[str, Any] = {
    "straggler_window": 20,
    "straggler_threshold": 0.75,
    "straggler_warmup": 10,
    "tracker": None,
    "kill": None,
    "slow": None,
    "progress": False,  # a script under torchrun keeps its own output: no line unless asked
    "steps": 0,
    "script": [],
    "resume": False,
    "checkpoint_every": 0,
    # what the script's Synchronizer takes from the command line when it names none itself
    "strategy": None,
    "compression": None,
    "servers": None,
    "timeout": None,
    # ``gradsync run --replica-groups G``: each group's Synchronizer takes membership="torchft"
    "replica_groups": 0,
    "min_replicas": 1,
    #: which of them this directory's is (None: not a replica group of gradsync run's)
    "replica_group": None,
    #: the flags the command line gave (``gradsync run`` writes them into config.json)
    "given": [],
    #: under ``gradsync compare``: which of its runs this is, as its progress line names it
    #: ("ssp:2 (2/2)"), for rank 0's notices to say whose they are
    "compare_run": None,
}

#: Synchronizer argument -> the ``gradsync run`` flag's config.json key it comes from
_CHOSEN_BY_FLAG = {
    "strategy": "strategy",
    "compression": "compression",
    "servers": "servers",
    "timeout_s": "timeout",
}
#: a config.json key whose flag is spelt otherwise on the command line
_FLAG_SPELLING = {"compression": "--compress"}

#: the script's call that built the Synchronizer, as a refusal names it: the front door
#: (``gs.DistributedDataParallel``) builds one for a script that never wrote gs.Synchronizer
_CALLER = contextvars.ContextVar("gradsync_caller", default="gs.Synchronizer")


@contextlib.contextmanager
def called_as(caller: str) -> Iterator[None]:
    """Within: the refusals below name ``caller`` as the script's call."""
    token = _CALLER.set(caller)
    try:
        yield
    finally:
        _CALLER.reset(token)


def run_settings(directory: Path) -> dict[str, Any]:
    """The run's settings: ``config.json``'s where ``gradsync run`` wrote one, else defaults."""
    settings = dict(_DEFAULTS)
    path = directory / CONFIG_FILE
    if path.exists():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the run's settings in {path}: {exc}") from exc
        settings.update({k: v for k, v in saved.items() if k in _DEFAULTS})
    return settings


class RunSink:
    """Receives every gathered batch of records on rank 0: writes metrics.jsonl, hands them to
    the --tracker sinks, updates the progress line and warns once per straggler episode.

    Only rank 0 has one: every rank receives the same gathered records, so rank 0's trackers
    hold every rank's scalars, and one writer per run keeps one run per dashboard."""

    def __init__(self, directory: Path, settings: dict[str, Any], world: int) -> None:
        # metrics.jsonl is the JSONL tracker's file, always written: --tracker jsonl adds none
        self.metrics = JsonlTracker(directory)
        self.path = self.metrics.path
        self.trackers = _trackers(settings.get("tracker"), directory)
        # a script's number of steps is its own: the line then shows the step alone
        total = 0 if settings.get("script") else int(settings.get("steps") or 0)
        self.progress = Progress(
            total, enabled=bool(settings.get("progress")), heartbeat=directory / HEARTBEAT_FILE
        )
        self.stragglers = StragglerConfig(
            window=int(settings["straggler_window"]),
            threshold=float(settings["straggler_threshold"]),
            warmup=int(settings["straggler_warmup"]),
        )
        self.detector = StragglerDetector(self.stragglers, world_size=world)
        self.world = world
        # under gradsync compare, a notice names the strategy's run: the runs follow one
        # another in the command's output, and a notice alone did not say whose it was
        run = settings.get("compare_run")
        self.notice = f"gradsync: {run}: straggler" if run else "gradsync: straggler"
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
            self.progress.interrupt(f"{self.notice}: {finding.describe()}")

    def close_trackers(
        self,
        report: RunReport | None = None,
        findings: list[Finding] | None = None,
        status: str = FINISHED,
        last: list[StepRecord] | None = None,
    ) -> None:
        """End the trackers with how the attempt ended (``status``): each in turn gets the
        ``last`` step records, the run's report (when there is one), and is closed, before the
        next one starts. Why one by one: a tracker can hang at the end (after a Ctrl-C, W&B's
        service process, in the rank's process group, was gone and its ``log`` blocked until
        the stopped rank's grace ran out), and the trackers after it then never ended (a
        tester's MLflow run stayed RUNNING 2 times in 3). Failures are logged, not raised:
        the files are written by then."""
        if self.trackers is None:
            return
        trackers, self.trackers = self.trackers, None
        for tracker in trackers.trackers if isinstance(trackers, Trackers) else [trackers]:
            try:
                if last:
                    tracker(last)
                if report is not None:
                    tracker.finish(report, findings)
            except Exception:
                logger.exception("%s failed to record the run's end", type(tracker).__name__)
            try:
                tracker.close(status)
            except Exception:
                logger.exception("%s failed to close", type(tracker).__name__)

    def ungathered(self, own: list[StepRecord], wait_s: float) -> list[StepRecord]:
        """At the end without a report: the steps no gather took, for the trackers, as
        metrics.jsonl has them. Each rank wrote its own there (``write_own_records``; this
        rank's, ``own``, are written by now), so they are read back from the file, this
        attempt's alone. Up to ``wait_s`` for every worker's to be there: the other ranks
        write theirs as they end, at about the same time; one that has not by then is left
        out of the trackers' last steps (metrics.jsonl gets them still)."""
        if self.trackers is None:
            return []
        attempt = own[0].attempt if own else restart_count()
        deadline = time.monotonic() + (wait_s if own else 0.0)
        found: list[StepRecord] = []
        read_to = 0  # each look reads what was appended since the last: the file once in all
        while True:
            more, read_to = _ungathered(self.path, attempt, read_to)
            found += more
            ended = {r.rank for r in found}  # a rank writes all of its own at once
            if len(ended) >= self.world or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        # the idle and comm of records no gather took come from every rank's, as
        # ``read_records`` derives them: the scalars then equal metrics.jsonl's as read
        return settle_ungathered(found) if found else []


def _ungathered(path: Path, attempt: int, start: int) -> tuple[list[StepRecord], int]:
    """The records of ``attempt`` in metrics.jsonl from byte ``start`` on that a rank wrote
    alone (``gathered`` false: those gathered reached the trackers as they came), and where
    the whole lines read end. A line another rank is still appending has no newline yet: it is
    left for the next look."""
    if not path.exists():
        return [], start
    with open(path, "rb") as fh:
        fh.seek(start)
        data = fh.read()
    whole = data[: data.rfind(b"\n") + 1]
    found = []
    for line in whole.splitlines():
        if b'"gathered":false' not in line:  # as ``StepRecord.to_json`` writes it; no parse
            continue
        try:
            record = StepRecord.from_dict(json.loads(line))
        except (ValueError, TypeError):
            continue
        if record.attempt == attempt:
            found.append(record)
    return found, start + len(whole)


def ending_status(at_exit: bool = False) -> str:
    """How this process's attempt is ending, for its trackers (``trackers.status_of``): the
    exception being handled (a ``close()`` in an ``except``, ``finally`` or ``with`` block an
    error left; a multiprocessing child's exit, whose finalizers run in a ``finally`` around
    the script's function), and ``at_exit`` (the interpreter's exit, from the finalizer the
    Synchronizer registers) the uncaught exception Python printed (``sys.last_value``, as
    ``exit_safety`` reads it): not before, where an interactive session keeps an earlier
    cell's error there. A rank stopped by SIGTERM under ``gradsync run`` is told ``KILLED`` by
    its caller (``synchronizer.write_unreported_records``). A process killed outright
    (SIGKILL, or SIGTERM outside ``gradsync run``) runs none of this: its trackers stay as its
    last gather left them (docs/trackers.md)."""
    error = sys.exc_info()[1]
    if error is None and at_exit:
        error = getattr(sys, "last_value", None)
    return status_of(error)


def _trackers(spec: str | None, directory: Path) -> Tracker | None:
    """The --tracker sinks besides metrics.jsonl, writing under the run directory, or None."""
    names = [n for n in parse_trackers(spec or "jsonl") if n != "jsonl"]
    # all_ranks: this is rank 0's sink already
    return make_tracker(",".join(names), directory, all_ranks=True) if names else None


def write_report(
    directory: Path,
    stragglers: StragglerConfig,
    report: RunReport,
    measured: dict[str, Any] | None = None,
    sink: RunSink | None = None,
    group: str = "0",
) -> dict[str, Any]:
    """Write report.json: the report of every step of the run and the straggler findings
    ``gradsync report`` gives, plus what the strategy measured itself (``measured``, under
    "strategy_summary", when it has anything). Built from metrics.jsonl, not this attempt's
    ``report``, which after a restart holds only the steps since the resume point. Returns the
    report's dict."""
    metrics = directory / METRICS_FILE
    records = read_records(directory) if metrics.exists() else report.records
    analysis = analyze_records(directory, records, stragglers)
    written = analysis.run_report()
    if measured:
        written["strategy_summary"] = measured
    if (directory / MEMBERSHIP_FILE).exists():
        # live membership: this replica group's own view (the run's, over every group, is
        # ``gradsync run --replica-groups``' RUN/report.json)
        written["membership"] = summarize_membership([read_group(directory, group)])
    (directory / REPORT_FILE).write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")
    if sink is not None:  # the trackers end with the same report and findings
        sink.close_trackers(analysis.report, analysis.findings)
    return analysis.report.to_dict()


def drop_records_from(path: Path, step: int) -> None:
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


def pulled_bytes(params: Sequence[torch.Tensor], servers: int) -> int:
    """Bytes the parameter servers send one worker per step (0 without servers): every
    trainable parameter in its dtype, plus a one-element header from each server
    (``ParameterServer``'s reply; ``gradsync.runner.compare.pull_bytes_per_step`` counts a
    built-in workload's the same way)."""
    if not servers or not params:
        return 0
    return sum(p.numel() * p.element_size() for p in params) + servers * params[0].element_size()


def add_facts(directory: Path, **facts: Any) -> None:
    """Add derived facts to the run's written config.json, replaced whole (never half-written):
    the bucket plan ``gradsync run`` chose, a script's gradient size (``AttachedRun.start``)."""
    path = directory / CONFIG_FILE
    data = {**json.loads(path.read_text()), **facts}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(partial, path)


def append_fault(directory: Path, name: str, entry: dict[str, Any]) -> None:
    """One JSON line appended to ``directory/faults/name`` (a line is written whole: a
    replacement's lines follow its predecessor's)."""
    faults = directory / FAULTS_DIR
    faults.mkdir(parents=True, exist_ok=True)
    with open(faults / name, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")


class AttachedRun:
    """What a Synchronizer does for the run directory it is attached to (module docstring).
    Found from its settings first (``find``), then started with the Synchronizer's rank and
    number of workers (``start``); rank 0 alone writes files."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.settings = run_settings(self.directory)
        self.kills = parse_kill(self.settings.get("kill"))
        self.rank = 0
        self.sink: RunSink | None = None
        self.reported: dict[str, Any] | None = None
        self._membership: MembershipLog | None = None
        # live membership: the step a load went back to, until the first quorum says whether
        # this replica group runs on from there or heals forward (``loaded``, ``began``)
        self._rerun_from: int | None = None

    @classmethod
    def find(cls, run_dir: str | Path | None) -> AttachedRun | None:
        """The run ``run_dir`` names, else the one ``GRADSYNC_RUN_DIR`` names, else None."""
        chosen = run_dir if run_dir is not None else os.environ.get(RUN_DIR_ENV) or None
        return None if chosen is None else cls(chosen)

    def start(self, rank: int, workers: int, gradient_numel: int, pulled: int = 0) -> None:
        """The Synchronizer's rank, its number of workers (the straggler detector's) and how
        many elements its model's gradient has: a script's config.json gets the fp32 bytes
        per step from it (``gradsync run`` cannot count a script's model before it runs), so
        the report compares the bytes sent with them as it does a built-in workload's.
        ``pulled``: the bytes the parameter servers reply to one worker's step
        (``pulled_bytes``; 0 without servers), which ``gradsync compare`` adds to a script's
        MB sent as it does to a built-in workload's (telemetry records the pushes only)."""
        self.rank = rank
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.sink = RunSink(self.directory, self.settings, workers)
            self._count_scripts_gradient(gradient_numel, pulled)

    def _count_scripts_gradient(self, numel: int, pulled: int = 0) -> None:
        """The first Synchronizer of a script run (config.json names a script and no gradient
        size yet) records its model's, and under parameter servers the bytes of their reply
        to a step (``pull_bytes_per_step``): a workload's run recorded it before any rank
        started, and compare counts a workload's pulls from the workload's model."""
        path = self.directory / CONFIG_FILE
        try:
            written = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # no config.json (plain torchrun) or unreadable (run_settings said so)
        scripts = isinstance(written, dict) and "script" in written
        if scripts and "fp32_bytes_per_step" not in written:
            facts = {"fp32_bytes_per_step": 4 * numel}
            if pulled:
                facts["pull_bytes_per_step"] = pulled
            add_facts(self.directory, **facts)

    def choose(self, argument: str, script_value: Any, default: Any) -> Any:
        """The Synchronizer's ``argument``: the script's value (None: it named none), else the
        command line's (``gradsync run --strategy ...``), else ``default``. A script that names
        one value while the command line asked for another is refused: the run would quietly
        not be the one asked for."""
        flag = _CHOSEN_BY_FLAG[argument]
        from_flag = self.settings.get(flag)
        if script_value is None:
            return default if from_flag is None else from_flag
        given = flag in (self.settings.get("given") or ())
        if given and isinstance(script_value, str | int | float) and script_value != from_flag:
            option = _FLAG_SPELLING.get(flag, "--" + flag.replace("_", "-"))
            raise UsageError(
                f"gradsync run {option} {from_flag}, but the script's {_CALLER.get()} passes "
                f"{argument}={script_value!r}: leave {argument} out of the script to let the "
                f"command line choose, or drop {option}"
            )
        return script_value

    def live(self, membership: str | None, min_replicas: int | None) -> tuple[str | None, int]:
        """The Synchronizer's ``membership`` and ``min_replicas``: under ``gradsync run
        --replica-groups`` this process is one replica group, so membership is "torchft" and
        ``min_replicas`` the run's --min-replicas unless the script names its own; a script
        that asks for another membership, or another number than the command line gave, is
        refused. Elsewhere the script's values (``min_replicas`` None: 1)."""
        groups = int(self.settings.get("replica_groups") or 0)
        if not groups:
            return membership, 1 if min_replicas is None else min_replicas
        if membership not in (None, "torchft"):
            raise UsageError(
                f"gradsync run --replica-groups {groups} runs each replica group as a torchft "
                f"participant, but the script's {_CALLER.get()} passes membership="
                f"{membership!r}: leave membership out of the script, or drop --replica-groups"
            )
        from_flag = int(self.settings.get("min_replicas") or 1)
        given = "min_replicas" in (self.settings.get("given") or ())
        if min_replicas is not None and given and min_replicas != from_flag:
            raise UsageError(
                f"gradsync run --min-replicas {from_flag}, but the script's {_CALLER.get()} "
                f"passes min_replicas={min_replicas}: leave min_replicas out of the script to "
                "let the command line choose, or drop --min-replicas"
            )
        return "torchft", from_flag if min_replicas is None else min_replicas

    def wait_for_groups(self, timeout_s: float = GROUPS_START_S) -> None:
        """Under ``gradsync run --replica-groups``, once this group's torchft Manager is up:
        the group's first process waits until every group's Manager is (at most
        ``timeout_s``), so that their first quorum holds them all. The lighthouse waits only
        for the replicas it hears from: without this, the first group up trained alone until
        the others joined by healing from it (RELIABILITY.md's 20-failure benchmark: up to 71
        steps). A replacement does not wait: the others are past their start."""
        groups = int(self.settings.get("replica_groups") or 0)
        if not groups or self.settings.get("replica_group") is None or self.rank != 0:
            return
        entry = {"restart": restart_count(), "pid": os.getpid(), "time": time.time()}
        append_fault(self.directory, MANAGER_UP_FILE, entry)
        if restart_count() != 0:
            return
        run_dir = self.directory.parent
        up = [run_dir / GROUP_DIR.format(k) / FAULTS_DIR / MANAGER_UP_FILE for k in range(groups)]
        deadline = time.monotonic() + timeout_s
        while not all(path.exists() for path in up):
            if time.monotonic() > deadline:
                late = [k for k, path in enumerate(up) if not path.exists()]
                logger.warning(
                    "replica group(s) %s not up after %.0f s: training without waiting for them",
                    late,
                    timeout_s,
                )
                return
            time.sleep(0.05)

    def healed(self, step: int, nbytes: int, seconds: float) -> None:
        """This replica group took a live peer's state at ``step`` (``nbytes`` of tensors,
        ``seconds`` from asking for the quorum to having loaded it): a line in
        ``faults/healed.jsonl``, which ``gradsync run --replica-groups`` sums up."""
        if self.rank != 0:
            return
        entry = {
            "step": step,
            "bytes": nbytes,
            "seconds": seconds,
            "restart": restart_count(),
            # a replacement started by hand, not by an agent, is restart 0 too
            "pid": os.getpid(),
            "time": time.time(),
        }
        append_fault(self.directory, HEALED_FILE, entry)

    def quorum(self, seen: StepQuorum) -> None:
        """A step's quorum as this replica group saw it (live membership): a line in
        ``membership.jsonl`` (``gradsync.telemetry.membership``), written at the step."""
        if self.rank != 0:
            return
        if self._membership is None:
            path = self.directory / MEMBERSHIP_FILE
            self._membership = MembershipLog(path, restart=restart_count())
        self._membership.write(**{f.name: getattr(seen, f.name) for f in fields(seen)})

    @property
    def slow(self) -> str | None:
        """The run's ``--slow`` spec, for a Synchronizer not given slowdowns of its own."""
        return self.settings.get("slow")

    def before_step(self, step: int) -> None:
        """At the start of ``step``: a ``--kill`` due here fires (once per run: a marker file
        stops it firing again when a restart runs the step again)."""
        if self.kills:
            maybe_kill(self.kills, self.rank, step, self.directory / FAULTS_DIR)

    def loading(self) -> None:
        """Before ``sync.load()`` restores the records of the steps before its checkpoint."""
        if self.sink is not None:
            self.sink.showing = False

    def loaded(self, step: int, *, until_quorum: bool = False) -> None:
        """After ``sync.load()`` resumed at ``step`` (0: no checkpoint): the records of the
        steps that run again are dropped, and rank 0 says where a restart (or ``--resume``)
        went back to. ``until_quorum`` (live membership): which steps run again is known only
        at the first quorum, where a replica group behind a live peer heals forward and runs
        none of the steps between ``step`` and its peer's again (their records stay, the only
        ones of those steps): the drop waits for ``began``."""
        if self.sink is None:
            return
        self.sink.showing = True
        if until_quorum:
            self._rerun_from = step
        else:
            self._drop_from(step)
        restarted = restart_count()
        flag = bool(self.settings.get("resume"))
        if not (restarted or step or flag):
            return
        if step:
            how = "resuming"
        elif self.settings.get("checkpoint_every"):
            how = "starting over (no checkpoint was complete yet)"
        else:
            how = "starting over (no checkpoint)"
        why = "restart" if restarted else "--resume" if flag else "resume"
        count = ""
        if restarted:  # this round's restart and the most the agent allows (set by its agent)
            most = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
            count = f" (restart {restarted}{f' of {most}' if most else ''})"
        if until_quorum:  # the first quorum may take it further
            count += ", or at a live peer's step if one is further (healed at the first quorum)"
        # e.g. "gradsync: restart: resuming at step 12 (restart 1 of 1)"
        logger.info("%s: %s at step %d%s", why, how, step, count)

    def began(self, step: int) -> None:
        """A step began at ``step``, after its quorum (where a replacement heals forward):
        the drop ``loaded`` held for it is made from there."""
        if self._rerun_from is not None:
            self._rerun_from = None
            self._drop_from(step)

    def _drop_from(self, step: int) -> None:
        """Rank 0's files less what steps ``step`` on wrote: they run again."""
        if self.sink is None:
            return
        drop_records_from(self.sink.path, step)
        drop_steps_from(self.directory / SPANS_FILE, step)
        # under replica groups their quorums run again too
        drop_steps_from(self.directory / MEMBERSHIP_FILE, step)

    def finish(self, report: RunReport, measured: dict[str, Any] | None) -> None:
        """At the end of ``sync.report()``, given what the strategy ``measured`` itself: rank 0
        writes report.json and ends the progress line and the trackers (every rank appends its
        own spans to spans.jsonl as it goes: ``write_own_spans``)."""
        if self.sink is None:
            return
        self.sink.progress.close()
        # the replica group's name in its membership summary: gradsync run's, or torchft's
        group = self.settings.get("replica_group")
        name = str(group) if group is not None else os.environ.get(REPLICA_ID_ENV) or "0"
        self.reported = write_report(
            self.directory, self.sink.stragglers, report, measured, self.sink, group=name
        )

    def write_own_spans(self, spans: list[Span]) -> None:
        """This rank's timeline spans not written yet, appended to ``spans.jsonl`` by this rank
        itself, at each telemetry gather and at the end: a killed attempt keeps those of the
        steps up to its last gather (rank 0 wrote them all at ``report()`` before, so a
        restart lost every earlier attempt's). ``loaded`` drops those of the steps run again."""
        if spans:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_records(self.directory / SPANS_FILE, spans)

    def write_own_records(self, records: list[StepRecord], status: str = FINISHED) -> None:
        """This rank's records that no gather took (a Synchronizer closed, or a process that
        ended, without ``sync.report()``: a script ported through the front door may never
        call it), appended to ``metrics.jsonl`` by this rank itself: no collective, and no
        rank waits for another. Their ``idle`` is left as measured (see
        ``TelemetryCollector.take_own_pending``)."""
        if records:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_records(self.directory / METRICS_FILE, records)
        if self.sink is None:
            return
        # Rank 0: this is its end (a close, the process's exit or a stop), so its trackers get
        # what metrics.jsonl got since the last gather and end with the attempt's ``status``.
        # Only a clean end waits for the other ranks' records: after a failure they may be
        # blocked on this rank, or dead.
        last: list[StepRecord] = []
        try:
            last = self.sink.ungathered(records, OTHERS_RECORDS_S if status == FINISHED else 0.0)
        except Exception:  # the files are written; a dashboard must not fail the exit
            logger.exception("the --tracker sinks failed to take the last step records")
        self.sink.close_trackers(status=status, last=last)

    def close(self, status: str = FINISHED) -> None:
        """When the Synchronizer closes: the trackers end even without a report, with how the
        attempt ended (``status``)."""
        if self.sink is not None:
            self.sink.close_trackers(status=status)
        if self._membership is not None:
            self._membership.close()
