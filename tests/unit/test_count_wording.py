"""Counts in what ``gradsync run`` prints say "1 worker", "1 step", "1 rank" (testers read
"1 workers" in the start line of a one-worker run), and the summary's header is still
recognised, and rewritten after a --resume, when it counts one step or one rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import gradsync.processes.launch
from gradsync.runner.cli import _attempts_header, main
from gradsync.telemetry.membership import counted
from gradsync.telemetry.records import METRICS_FILE, StepRecord, write_records
from gradsync.telemetry.report import RunReport

pytestmark = pytest.mark.unit


def _record(rank: int, step: int) -> StepRecord:
    return StepRecord(rank, step, 100.0 + step, 0.5, 0.5, 0.0, 0.0, 4, 10, loss=1.0)


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers: one step record per rank and step of the run's config."""

    def fake(entry: Any, args: tuple[dict[str, Any], ...], **kwargs: Any) -> dict[int, Any]:
        cfg = args[0]
        records = [_record(r, s) for s in range(cfg["steps"]) for r in range(cfg["nproc"])]
        write_records(Path(cfg["out"]) / METRICS_FILE, records)
        return {0: {}}

    monkeypatch.setattr(gradsync.processes.launch, "launch", fake)


def test_counted() -> None:
    assert counted(1, "worker") == "1 worker" and counted(2, "worker") == "2 workers"
    assert counted(0, "step") == "0 steps"
    assert counted(1, "process", "processes") == "1 process"
    assert counted(3, "process", "processes") == "3 processes"


def test_a_one_worker_one_step_run_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: None
) -> None:
    flags = ["--no-plots", "--no-progress", "--workload=mlp"]
    argv = ["run", "--nproc=1", "--steps=1", f"--out={tmp_path / 'run'}", *flags]
    assert main(argv) == 0
    captured = capsys.readouterr()
    start = captured.err.splitlines()[0]
    assert start.startswith("gradsync run: mlp, strategy bsp, 1 worker, 1 step, batch 16/worker")
    out = captured.out
    assert f"run: {tmp_path / 'run'} (1 step, 1 rank)" in out, out
    assert "pace-setter: rank 0 was the slowest in 1 of 1 step\n" in out, out
    assert "1 steps" not in out + captured.err and "1 workers" not in captured.err


def test_two_workers_keep_the_plural(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: None
) -> None:
    argv = ["run", "--nproc=2", "--steps=3", f"--out={tmp_path / 'run'}", "--no-plots"]
    assert main([*argv, "--workload=mlp", "--strategy=ssp:1"]) == 0
    captured = capsys.readouterr()
    start = captured.err.splitlines()[0]
    assert "strategy ssp:1, 2 workers + 1 server, 3 steps," in start, start
    assert "slowest in 3 of 3 steps" in captured.out


def test_the_header_of_one_step_is_rewritten_after_a_resume_on_fewer_ranks() -> None:
    text = "run: runs/x (1 step, 2 ranks)\n\nrest"
    assert (
        _attempts_header(text, 1, 2) == "run: runs/x (1 step, 1 rank; 2 before the resume)\n\nrest"
    )
    # one rank recorded, two in this attempt (the records of the saved run's rank only)
    text = "run: runs/x (5 steps, 1 rank)\nrest"
    assert (
        _attempts_header(text, 2, 1) == "run: runs/x (5 steps, 2 ranks; 1 before the resume)\nrest"
    )
    # more ranks than before the resume: the records hold this attempt's ranks, named anyway
    text = "run: runs/x (5 steps, 4 ranks)\nrest"
    assert (
        _attempts_header(text, 4, 2) == "run: runs/x (5 steps, 4 ranks; 2 before the resume)\nrest"
    )


def test_the_run_reports_pace_setter_line_counts_steps() -> None:
    report = RunReport.from_records([_record(0, 0), _record(1, 0)])
    assert "was the slowest in 1 of 1 step\n" in report.format() + "\n"
