"""Tracker sinks: the step records as scalars in TensorBoard, Weights & Biases, MLflow or JSONL.

Practitioners look at their runs in one of these, not in gradsync's own files, so gradsync
writes into them rather than growing a dashboard of its own. Each sink wraps the library's own
maintained writer (torch's ``SummaryWriter`` for TensorBoard event files, ``wandb.init`` in
offline mode, ``MlflowClient`` on a local ``file:`` store): their file formats are theirs to
keep readable, and their readers (``EventAccumulator``, ``wandb sync``, ``get_metric_history``)
work on what is written. The libraries are optional extras, imported only when a sink is
made, so ``import gradsync`` stays as light as it was and a missing one is named with the
extra that installs it.

One protocol, :class:`Tracker`: ``log`` a batch of gathered records, ``finish`` with the
run's report (barrier tax, final loss, straggler findings), ``close`` with how the run ended
(``FINISHED``, ``FAILED`` or ``KILLED``, MLflow's run statuses: an attempt that failed is not
left "running" in a dashboard, nor shown as a success). A tracker is also the
``on_records`` callable of a Synchronizer (``__call__``): there a tracker that fails is
reported on the ``gradsync.telemetry.trackers`` logger and turned off, because a dashboard
that cannot be written must not stop the training it watches.

The scalars, per step (``RANK`` is ``rank0``, ``rank1``...; seconds unless named otherwise):
``compute/RANK``, ``comm/RANK``, ``idle/RANK``, ``bytes/RANK`` (bytes sent), ``loss/RANK``
(when the step had one), ``loss/mean`` (the mean over ranks, the report's "final loss" quantity),
``barrier_tax`` (the step's idle over its wall time, summed over ranks, as ``RunReport``
computes it). At ``finish``: ``run/barrier_tax``, ``run/final_loss``, ``run/steps`` and
``stragglers/RANK`` (how many times slower the rank was; ``stragglers/job`` for a slowdown of
every rank), at the last step, with the findings' descriptions as text where the library has
text.

Records are gathered to every rank (docs/observability.md), so one tracker on rank 0 holds
every rank's scalars: :func:`make_tracker` returns one that writes nothing on other ranks.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from gradsync.errors import UsageError
from gradsync.telemetry.records import METRICS_FILE, StepRecord, write_records
from gradsync.telemetry.report import RunReport

if TYPE_CHECKING:
    from gradsync.telemetry.stragglers import Finding

logger = logging.getLogger("gradsync.telemetry.trackers")

#: the tracker names ``make_tracker`` and ``gradsync run --tracker`` accept
TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
#: each library-backed tracker's importable module and the gradsync extra that installs it
_NEEDS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
#: where each tracker writes under the directory it is given (several can share one)
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
WANDB_PROJECT = "gradsync"
#: MLflow takes at most this many metrics per ``log_batch`` call
_MLFLOW_BATCH = 1000
#: how a run ended, as ``close`` is told: MLflow's run statuses (``RunStatus``), which W&B maps
#: to an exit code (0 for FINISHED)
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


@runtime_checkable
class Tracker(Protocol):
    """Where gathered step records go. ``__call__`` makes it a Synchronizer's ``on_records``."""

    def log(self, records: list[StepRecord]) -> None: ...

    def finish(self, report: RunReport, findings: Sequence[Finding] | None = None) -> None: ...

    def close(self, status: str = FINISHED) -> None: ...

    def __call__(self, records: list[StepRecord]) -> None: ...


def status_of(error: BaseException | None) -> str:
    """How a run that ``error`` ended (None: none) ended, as ``close`` is told: an interrupt
    (Ctrl-C, or the exit status a signal gives, 128 + its number) is ``KILLED``, an exit with
    status 0 or none ``FINISHED``, anything else ``FAILED``."""
    if error is None:
        return FINISHED
    if isinstance(error, KeyboardInterrupt):
        return KILLED
    if isinstance(error, SystemExit):
        code = error.code
        if code is None or code == 0:
            return FINISHED
        return KILLED if isinstance(code, int) and code > 128 else FAILED
    return FAILED


def missing_extras(names: Iterable[str]) -> list[str]:
    """The trackers among ``names`` whose library is not installed (found without importing
    it: ``gradsync run`` checks before starting any process)."""
    return [n for n in names if n in _NEEDS and importlib.util.find_spec(_NEEDS[n]) is None]


def parse_trackers(spec: str) -> list[str]:
    """``"tensorboard,mlflow"`` -> the names, each once, in order; ``UsageError`` naming a
    bad one and the valid choices."""
    names = [part.strip() for part in spec.split(",")]
    for name in names:
        if name not in TRACKERS:
            raise UsageError(
                f"unknown tracker {name!r} in {spec!r}; valid: {', '.join(TRACKERS)} "
                "(comma-separated for several)"
            )
    return list(dict.fromkeys(names))


def make_tracker(spec: str, directory: str | Path, *, all_ranks: bool = False) -> Tracker:
    """The trackers named in ``spec`` (``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``,
    comma-separated for several), writing under ``directory``.

    On a rank other than 0 of a distributed job it returns a tracker that writes nothing
    (every rank receives the same gathered records: one writer holds them all), unless
    ``all_ranks``. A library that is not installed is an ``ImportError`` naming the extra."""
    names = parse_trackers(spec)
    if not all_ranks and _rank() != 0:
        return NullTracker()
    directory = Path(directory)
    made: list[Tracker] = []
    try:
        for name in names:
            made.append(_MAKERS[name](directory))
    except BaseException:
        for tracker in made:  # an earlier one may hold a run open (W&B, MLflow)
            tracker.close()
        raise
    return made[0] if len(made) == 1 else Trackers(made)


def _rank() -> int:
    """This process's rank: torch.distributed's once initialized (torch is not imported for
    it), else the launcher's ``RANK`` (torchrun sets it before ``init_process_group``)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))


def _require(name: str) -> Any:
    """Import a tracker's library (typed Any: none of them needs stubs here), or say which
    extra installs it."""
    module = _NEEDS[name]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"the {name} tracker needs the {module} package, which is not installed: "
            f"pip install 'gradsync[{name}]' (or 'gradsync[trackers]' for every tracker)"
        ) from exc


class _Base:
    """``__call__``, ``finish`` and context management over a sink's ``log`` and ``close``."""

    name = "tracker"
    failed = False

    def log(self, records: list[StepRecord]) -> None:
        raise NotImplementedError

    def finish(self, report: RunReport, findings: Sequence[Finding] | None = None) -> None:
        """Nothing to add at the end, unless a sink says otherwise."""

    def close(self, status: str = FINISHED) -> None:
        """Nothing to release, unless a sink says otherwise."""

    def __call__(self, records: list[StepRecord]) -> None:
        # As on_records: a tracker that fails is said once and turned off; training goes on.
        if self.failed:
            return
        try:
            self.log(records)
        except Exception:
            self.failed = True
            logger.exception("the %s tracker failed and is off for the rest of the run", self.name)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        self.close(status_of(error))


class NullTracker(_Base):
    """Writes nothing: the tracker of ranks other than 0."""

    name = "null"

    def log(self, records: list[StepRecord]) -> None:
        pass


class Trackers(_Base):
    """Several trackers as one; each fails alone when used as ``on_records``."""

    name = "trackers"

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)

    def log(self, records: list[StepRecord]) -> None:
        for tracker in self.trackers:
            tracker.log(records)

    def __call__(self, records: list[StepRecord]) -> None:
        for tracker in self.trackers:
            tracker(records)

    def finish(self, report: RunReport, findings: Sequence[Finding] | None = None) -> None:
        for tracker in self.trackers:
            tracker.finish(report, findings)

    def close(self, status: str = FINISHED) -> None:
        for tracker in self.trackers:
            tracker.close(status)


class JsonlTracker(_Base):
    """Appends the records to ``DIRECTORY/metrics.jsonl``, the file ``gradsync report DIR``
    and ``gradsync simulate --from DIR`` read (``gradsync run`` writes its own through one)."""

    name = "jsonl"

    def __init__(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / METRICS_FILE

    def log(self, records: list[StepRecord]) -> None:
        write_records(self.path, records)


# -- the scalars ------------------------------------------------------------------------------


def _by_step(records: Iterable[StepRecord]) -> Iterator[tuple[int, list[StepRecord]]]:
    groups: dict[int, list[StepRecord]] = {}
    for r in records:
        groups.setdefault(r.step, []).append(r)
    for step in sorted(groups):
        yield step, sorted(groups[step], key=lambda r: r.rank)


def step_scalars(step_records: list[StepRecord]) -> dict[str, float]:
    """One step's scalars (the module docstring names them) from its records on every rank."""
    out: dict[str, float] = {}
    for r in step_records:
        rank = f"rank{r.rank}"
        out[f"compute/{rank}"] = r.compute
        out[f"comm/{rank}"] = r.comm
        out[f"idle/{rank}"] = r.idle
        out[f"bytes/{rank}"] = float(r.bytes)
        if r.loss is not None and math.isfinite(r.loss):
            out[f"loss/{rank}"] = r.loss
    # The report's own definitions: a step's barrier tax and loss are those of a report of
    # that step alone, so a dashboard and report.json never disagree on what they mean.
    report = RunReport.from_records(step_records)
    out["barrier_tax"] = report.barrier_tax
    if report.final_loss is not None and math.isfinite(report.final_loss):
        # not "loss": MLflow's file store keeps "loss/rank0" in a folder of that name
        out["loss/mean"] = report.final_loss
    return out


def final_scalars(
    report: RunReport, findings: Sequence[Finding] | None
) -> tuple[dict[str, float], list[str]]:
    """The end-of-run scalars and the findings' descriptions; findings found from the
    report's records (default settings) when not given."""
    if findings is None:
        from gradsync.telemetry.stragglers import find_stragglers  # numpy: only when asked

        findings = find_stragglers(report.records) if report.records else []
    out = {"run/barrier_tax": report.barrier_tax, "run/steps": float(report.steps)}
    if report.final_loss is not None and math.isfinite(report.final_loss):
        out["run/final_loss"] = report.final_loss
    for f in findings:
        key = f"stragglers/rank{f.rank}" if f.rank is not None else "stragglers/job"
        out[key] = max(out.get(key, 0.0), f.slowdown)  # the worst episode of each
    return out, [f.describe() for f in findings]


def _last_step(report: RunReport) -> int:
    return max((r.step for r in report.records), default=max(report.steps - 1, 0))


class _ScalarTracker(_Base):
    """A library-backed sink: it writes ``{tag: value}`` per step; subclasses say how."""

    def log(self, records: list[StepRecord]) -> None:
        for step, group in _by_step(records):
            walltime = min(r.time for r in group)  # the step's start, not when it was logged
            self._write(step, step_scalars(group), walltime)
        self._flush()

    def finish(self, report: RunReport, findings: Sequence[Finding] | None = None) -> None:
        scalars, notes = final_scalars(report, findings)
        self._write_final(_last_step(report), scalars, notes)
        self._flush()

    def _write(self, step: int, scalars: dict[str, float], walltime: float) -> None:
        raise NotImplementedError

    def _write_final(self, step: int, scalars: dict[str, float], notes: list[str]) -> None:
        self._write(step, scalars, time.time())

    def _flush(self) -> None:
        pass


class TensorBoardTracker(_ScalarTracker):
    """Event files under ``DIRECTORY/tensorboard`` (``tensorboard --logdir DIRECTORY``)."""

    name = "tensorboard"

    def __init__(self, directory: str | Path) -> None:
        _require("tensorboard")
        # torch's writer: maintained with torch, and it needs only the tensorboard package
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(directory) / TENSORBOARD_DIR
        self.writer: Any = SummaryWriter(log_dir=str(self.log_dir))

    def _write(self, step: int, scalars: dict[str, float], walltime: float) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=walltime)

    def _write_final(self, step: int, scalars: dict[str, float], notes: list[str]) -> None:
        super()._write_final(step, scalars, notes)
        if notes:
            self.writer.add_text("stragglers", "\n\n".join(notes), global_step=step)

    def _flush(self) -> None:
        # on disk at every gather: a run that dies keeps what it logged
        self.writer.flush()

    def close(self, status: str = FINISHED) -> None:
        # event files have no run status: what was logged is flushed and the file closed
        self.writer.close()


class WandbTracker(_ScalarTracker):
    """A W&B run under ``DIRECTORY/wandb``, offline unless ``WANDB_MODE`` says otherwise
    (offline needs no account or network; ``wandb sync`` uploads it later)."""

    name = "wandb"

    def __init__(
        self, directory: str | Path, *, project: str = WANDB_PROJECT, mode: str | None = None
    ) -> None:
        wandb = _require("wandb")
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run: Any = wandb.init(
            project=project,
            dir=str(directory),
            mode=mode or os.environ.get("WANDB_MODE", "offline"),
            reinit="create_new",  # its own run object: a user's run, if any, is left alone
            settings=wandb.Settings(silent=True, console="off", disable_git=True),
        )
        self.closed = False

    def _write(self, step: int, scalars: dict[str, float], walltime: float) -> None:
        self.run.log(scalars, step=step)

    def _write_final(self, step: int, scalars: dict[str, float], notes: list[str]) -> None:
        # W&B drops a log at a step below its last one: end-of-run values are its summary
        self.run.summary.update({**scalars, "stragglers": notes})

    def close(self, status: str = FINISHED) -> None:
        if not self.closed:
            self.closed = True
            # a non-zero exit code is how W&B marks a run failed; finish() also writes out the
            # offline file (unfinished, it was a header alone)
            self.run.finish(exit_code=0 if status == FINISHED else 1)


class MlflowTracker(_ScalarTracker):
    """An MLflow run in the experiment ``gradsync`` of a local file store,
    ``DIRECTORY/mlruns`` (``mlflow ui --backend-store-uri DIRECTORY/mlruns``), or of any
    ``tracking_uri`` given."""

    name = "mlflow"

    def __init__(
        self,
        directory: str | Path,
        *,
        tracking_uri: str | None = None,
        experiment: str = WANDB_PROJECT,
        run_name: str | None = None,
    ) -> None:
        if tracking_uri is None:
            tracking_uri = (Path(directory) / MLFLOW_DIR).resolve().as_uri()
            # MLflow 3 refuses its file store unless asked (it wants a database): a local
            # directory of plain files is what this sink is for, so it asks.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        _require("mlflow")
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric: Any = Metric
        self.tracking_uri = tracking_uri
        self.client: Any = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id: str = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self._pending: list[Any] = []
        self.closed = False

    def _write(self, step: int, scalars: dict[str, float], walltime: float) -> None:
        ms = int(walltime * 1000)
        self._pending += [self._metric(k, float(v), ms, step) for k, v in scalars.items()]

    def _write_final(self, step: int, scalars: dict[str, float], notes: list[str]) -> None:
        super()._write_final(step, scalars, notes)
        if notes:
            self.client.set_tag(self.run_id, "stragglers", "\n".join(notes))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=pending[i : i + _MLFLOW_BATCH])

    def close(self, status: str = FINISHED) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._flush()
            finally:  # the run ends even when the last batch fails: not RUNNING for ever
                self.client.set_terminated(self.run_id, status=status)


_MAKERS: dict[str, Any] = {
    "jsonl": JsonlTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}
