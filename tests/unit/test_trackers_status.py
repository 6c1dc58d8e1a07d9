"""How a tracker's run ends: ``close(status)`` with FINISHED, FAILED or KILLED (MLflow's run
statuses), and how a run directory's rank 0 tells which its attempt is
(``attached_run.ending_status``), and gives its trackers the records no gather took."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path

import pytest

from gradsync import attached_run
from gradsync.attached_run import AttachedRun, ending_status
from gradsync.telemetry import trackers
from gradsync.telemetry.records import StepRecord
from gradsync.telemetry.trackers import FAILED, FINISHED, KILLED, Trackers, status_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# Importing mlflow runs `uname -p` once: done at collection, as tests/unit/test_trackers.py does
with contextlib.suppress(ImportError):
    import mlflow.tracking  # noqa: F401


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (None, FINISHED),
        (SystemExit(0), FINISHED),
        (SystemExit(None), FINISHED),
        (RuntimeError("x"), FAILED),
        (SystemExit(1), FAILED),
        (SystemExit("a message"), FAILED),
        (KeyboardInterrupt(), KILLED),
        (SystemExit(128 + signal.SIGINT), KILLED),  # gradsync's launch turns Ctrl-C into it
        (SystemExit(128 + signal.SIGTERM), KILLED),
    ],
)
def test_status_of_an_ending(error: BaseException | None, status: str) -> None:
    assert status_of(error) == status


def _mlflow_status(directory: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(directory / trackers.MLFLOW_DIR).as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("gradsync").experiment_id])
    return str(run.info.status)


def test_mlflow_run_ends_with_the_status_given(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    # through Trackers, as a run directory's rank 0 holds several
    both = Trackers([trackers.MlflowTracker(tmp_path), trackers.JsonlTracker(tmp_path)])
    both.close(KILLED)
    assert _mlflow_status(tmp_path) == KILLED


def test_a_with_block_left_by_an_error_ends_the_run_failed(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    with pytest.raises(RuntimeError), trackers.MlflowTracker(tmp_path):
        raise RuntimeError("the training failed")
    assert _mlflow_status(tmp_path) == FAILED


def test_the_ending_seen_from_a_close() -> None:
    assert ending_status() == FINISHED
    try:
        raise RuntimeError("the script's error")
    except RuntimeError:
        assert ending_status() == FAILED  # a close() in an except, finally or with block
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        assert ending_status() == KILLED


def test_a_rank_stopped_by_sigterm_ends_its_trackers_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """runner.stopped writes a stopped rank's records through write_unreported_records, then
    ends the process: rank 0's trackers are told KILLED by it."""
    from gradsync import synchronizer

    told: list[str] = []

    class Stopped:
        _closed = False

        def _write_own_records(self, status: str) -> None:
            told.append(status)

    stopped = Stopped()
    monkeypatch.setattr(synchronizer, "_ATTACHED", [stopped])
    synchronizer.write_unreported_records()
    assert told == [KILLED]


def test_an_earlier_error_is_not_this_close_s(monkeypatch: pytest.MonkeyPatch) -> None:
    # an interactive session keeps the last cell's error in sys.last_value: it counts only at
    # the process's exit (the Synchronizer's exit finalizer asks with at_exit)
    monkeypatch.setattr("sys.last_value", RuntimeError("an earlier cell's"), raising=False)
    assert ending_status() == FINISHED
    assert ending_status(at_exit=True) == FAILED


class _Recorder(trackers._Base):
    """A tracker that keeps what it is given and how it was closed."""

    def __init__(self) -> None:
        self.logged: list[StepRecord] = []
        self.status: str | None = None

    def log(self, records: list[StepRecord]) -> None:
        self.logged += records

    def close(self, status: str = FINISHED) -> None:
        self.status = status


def _record(rank: int, step: int, *, gathered: bool = True, attempt: int = 0) -> StepRecord:
    return StepRecord(
        rank,
        step,
        100.0 + step,
        0.1,
        0.01,
        0.0,
        0.0,
        8,
        64,
        1.0,
        gathered=gathered,
        attempt=attempt,
    )


def test_rank_0_s_own_end_gives_its_trackers_every_rank_s_ungathered_steps(
    tmp_path: Path,
) -> None:
    run = AttachedRun(tmp_path)
    run.start(0, 2, 10)
    assert run.sink is not None
    recorder = run.sink.trackers = _Recorder()
    run.sink([_record(r, 0) for r in (0, 1)])  # a gather: logged as it came
    # rank 1 wrote its own last steps already; an earlier attempt's stay out
    others = [_record(1, s, gathered=False) for s in (1, 2)]
    others.append(_record(1, 0, gathered=False, attempt=7))
    attached_run.write_records(tmp_path / "metrics.jsonl", others)
    run.write_own_records([_record(0, s, gathered=False) for s in (1, 2)])
    got = sorted((r.step, r.rank) for r in recorder.logged)
    assert got == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert recorder.status == FINISHED and run.sink.trackers is None
    run.close()  # the Synchronizer's close after: nothing left to end


class _Hanging(_Recorder):
    """A tracker whose log never returns (W&B's, its service process gone after a Ctrl-C)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def log(self, records: list[StepRecord]) -> None:
        self.release.wait()


def test_a_tracker_that_hangs_at_the_end_keeps_none_before_it_from_ending(
    tmp_path: Path,
) -> None:
    """Each tracker gets the last steps and is closed before the next starts: MLflow's run
    stayed RUNNING when W&B's log, after it, hung (a Ctrl-C under --replica-groups)."""
    run = AttachedRun(tmp_path)
    run.start(0, 1, 10)
    assert run.sink is not None
    first, hanging = _Recorder(), _Hanging()
    run.sink.trackers = trackers.Trackers([first, hanging])
    ending = threading.Thread(
        target=run.write_own_records,
        args=([_record(0, 1, gathered=False)], KILLED),
        daemon=True,
    )
    ending.start()
    try:
        deadline = time.monotonic() + 10
        while first.status is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r.step for r in first.logged] == [1] and first.status == KILLED
        assert hanging.status is None  # still in its log
    finally:
        hanging.release.set()
        ending.join(timeout=10)
    assert hanging.status == KILLED
