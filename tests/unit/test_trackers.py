"""Tracker sinks, in one process: records written through each sink and read back with the
library's own reader (TensorBoard's EventAccumulator, MLflow's client), the JSONL sink through
gradsync's reader, and the specs, rank and failure rules of ``make_tracker``.

W&B is not here: ``wandb.init`` starts its service process, which a unit test may not; its
round trip is in tests/e2e/test_trackers_run.py."""

from __future__ import annotations

import builtins
import contextlib
import logging
from pathlib import Path
from typing import Any

import pytest

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.runner.config import RunConfig
from gradsync.telemetry import trackers
from gradsync.telemetry.records import StepRecord, read_records
from gradsync.telemetry.report import RunReport
from gradsync.telemetry.trackers import (
    JsonlTracker,
    NullTracker,
    Trackers,
    make_tracker,
    step_scalars,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# Importing mlflow runs `uname -p` once (platform.processor(), cached for the process): done
# here, at collection, so the tests below start no process themselves (tests/conftest.py).
with contextlib.suppress(ImportError):
    import mlflow.tracking  # noqa: F401

STEPS = 4


def _records() -> list[StepRecord]:
    """Two ranks, rank 1 slower: distinct values per rank and step, so a swap shows."""
    out = []
    for step in range(STEPS):
        for rank in (0, 1):
            compute = 0.01 * (step + 1) * (rank + 1)
            idle = 0.01 * (step + 1) if rank == 0 else 0.0
            sync = idle + 0.002 * (rank + 1)
            out.append(
                StepRecord(
                    rank,
                    step,
                    1.7e9 + step,
                    compute,
                    sync,
                    idle,
                    sync - idle,
                    16,
                    1000 * (rank + 1) + step,
                    loss=2.0 - 0.1 * step + rank,
                )  # fmt: skip
            )
    return out


def _expected() -> dict[int, dict[str, float]]:
    """What each step's scalars must be, from the records themselves (not step_scalars)."""
    out: dict[int, dict[str, float]] = {}
    for step in range(STEPS):
        group = [r for r in _records() if r.step == step]
        scalars = out[step] = {
            "barrier_tax": sum(r.idle for r in group) / sum(r.compute + r.sync for r in group),
            "loss/mean": sum(r.loss or 0.0 for r in group) / len(group),
        }
        for r in group:
            for tag in ("compute", "comm", "idle", "bytes", "loss"):
                scalars[f"{tag}/rank{r.rank}"] = float(getattr(r, tag))
    return out


def _assert_per_rank(got: dict[int, dict[str, float]], rel: float) -> None:
    """Every step's per-rank and step scalars, as logged."""
    want = _expected()
    assert sorted(got) == list(range(STEPS))
    for step, scalars in want.items():
        for tag in ("compute", "comm", "idle", "bytes", "loss"):
            for rank in (0, 1):
                key = f"{tag}/rank{rank}"
                assert got[step][key] == pytest.approx(scalars[key], rel=rel), (step, key)
        assert got[step]["barrier_tax"] == pytest.approx(scalars["barrier_tax"], rel=rel)
        assert got[step]["loss/mean"] == pytest.approx(scalars["loss/mean"], rel=rel)


def test_step_scalars_are_the_reports_definitions() -> None:
    step = [r for r in _records() if r.step == 1]
    scalars = step_scalars(step)
    assert scalars["compute/rank1"] == pytest.approx(0.04)
    assert scalars["idle/rank0"] == pytest.approx(0.02)
    assert scalars["barrier_tax"] == pytest.approx(RunReport.from_records(step).barrier_tax)
    assert scalars["loss/mean"] == pytest.approx((1.9 + 2.9) / 2)


def test_jsonl_tracker_writes_what_gradsync_reads_back(tmp_path: Path) -> None:
    with make_tracker("jsonl", tmp_path) as tracker:
        assert isinstance(tracker, JsonlTracker)
        tracker(_records())
    assert read_records(tmp_path) == _records()


def test_tensorboard_event_files_hold_the_per_rank_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = _records()
    tracker = gs.make_tracker("tensorboard", tmp_path)
    tracker(records[:4])  # two gathers, as a run delivers them
    tracker(records[4:])
    tracker.finish(RunReport.from_records(records))
    tracker.close()

    events = EventAccumulator(str(tmp_path / trackers.TENSORBOARD_DIR))
    events.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            got.setdefault(event.step, {})[tag] = event.value
    final = got[STEPS - 1]
    assert final.pop("run/barrier_tax") == pytest.approx(
        RunReport.from_records(records).barrier_tax, rel=1e-6
    )
    assert final.pop("run/steps") == STEPS
    _assert_per_rank(got, rel=1e-6)  # event files keep float32
    # the event's time is the step's start, not when it was written
    assert events.Scalars("compute/rank0")[2].wall_time == pytest.approx(1.7e9 + 2)


def test_mlflow_file_store_holds_the_per_rank_scalars(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    from mlflow.tracking import MlflowClient

    records = _records()
    with gs.make_tracker("mlflow", tmp_path) as tracker:
        tracker(records)
        tracker.finish(RunReport.from_records(records), [])
    client = MlflowClient(tracking_uri=(tmp_path / trackers.MLFLOW_DIR).as_uri())
    experiment = client.get_experiment_by_name(trackers.WANDB_PROJECT)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    got: dict[int, dict[str, float]] = {}
    for key in _expected()[0]:
        for metric in client.get_metric_history(run.info.run_id, key):
            got.setdefault(metric.step, {})[key] = metric.value
    _assert_per_rank(got, rel=1e-12)
    assert run.data.metrics["run/steps"] == STEPS


def test_findings_become_scalars_at_the_end(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    from mlflow.tracking import MlflowClient

    from gradsync.telemetry.stragglers import find_stragglers, synthetic_records

    records = synthetic_records(60, 4, slow=[(2, 10, 59, 3.0)])
    findings = find_stragglers(records)
    assert [f.rank for f in findings] == [2]
    with make_tracker("mlflow", tmp_path) as tracker:
        tracker.finish(RunReport.from_records(records))  # findings: found from the records
    client = MlflowClient(tracking_uri=(tmp_path / trackers.MLFLOW_DIR).as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("gradsync").experiment_id])
    assert run.data.metrics["stragglers/rank2"] == pytest.approx(findings[0].slowdown)
    assert "rank 2" in run.data.tags["stragglers"]


@pytest.mark.parametrize(
    "spec", ["csv", "tensorboard,nope", "", "TensorBoard"], ids=["csv", "one-bad", "empty", "case"]
)
def test_a_bad_spec_names_the_value_and_the_choices(spec: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError) as caught:
        make_tracker(spec, tmp_path)
    message = str(caught.value)
    assert repr(spec.split(",")[-1].strip()) in message
    assert "jsonl, tensorboard, wandb, mlflow" in message
    assert not list(tmp_path.iterdir())  # nothing made before the spec was refused


def test_the_run_flag_refuses_a_bad_tracker_before_any_process() -> None:
    with pytest.raises(UsageError, match=r"--tracker: unknown tracker 'tb'.*valid: jsonl"):
        RunConfig(tracker="tb")


def test_a_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_import = builtins.__import__

    def no_wandb(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "wandb" or name.startswith("wandb."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    monkeypatch.delitem(__import__("sys").modules, "wandb", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'gradsync\[wandb\]'"):
        make_tracker("wandb", tmp_path)
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    assert trackers.missing_extras(["jsonl", "mlflow"]) == ["mlflow"]
    with pytest.raises(UsageError, match=r"--tracker mlflow needs.*gradsync\[mlflow\]"):
        RunConfig(tracker="jsonl,mlflow")


def test_ranks_other_than_0_write_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "1")  # torchrun's, before init_process_group
    tracker = make_tracker("jsonl", tmp_path)
    assert isinstance(tracker, NullTracker)
    tracker(_records())
    assert not list(tmp_path.iterdir())
    assert isinstance(make_tracker("jsonl", tmp_path, all_ranks=True), JsonlTracker)


class _Broken(JsonlTracker):
    name = "broken"

    def log(self, records: list[StepRecord]) -> None:
        raise OSError("disk full")


def test_a_failing_tracker_is_logged_once_and_the_others_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken, kept = _Broken(tmp_path / "a"), JsonlTracker(tmp_path / "b")
    both = Trackers([broken, kept])
    with caplog.at_level(logging.ERROR, logger="gradsync.telemetry.trackers"):
        both(_records()[:2])
        both(_records()[2:])
    assert [r.getMessage() for r in caplog.records] == [
        "the broken tracker failed and is off for the rest of the run"
    ]
    assert len(read_records(tmp_path / "b")) == len(_records())
    with pytest.raises(OSError, match="disk full"):  # called directly, log() raises
        broken.log(_records())
