"""Issue 43, item 7: bad input is one line naming the bad value and what is valid (exit 2 for
the CLI) or a ``UsageError`` from the library, never a traceback or a raw error. The commands
run in this process (``gradsync.runner.cli.main``); none starts a worker."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.runner.cli import main
from gradsync.telemetry.records import METRICS_FILE, StepRecord

pytestmark = pytest.mark.unit


def _records(run_dir: Path, **field: Any) -> Path:
    """A run directory whose metrics.jsonl holds two ranks' 12 steps, ``field`` set in each."""
    run_dir.mkdir()
    lines = []
    for step in range(12):
        for rank in (0, 1):
            record = json.loads(
                StepRecord(rank, step, 100.0 + step, 0.5, 0.1, 0, 0, 4, 8).to_json()
            )
            lines.append(json.dumps({**record, **field}) + "\n")
    (run_dir / METRICS_FILE).write_text("".join(lines))
    return run_dir


def _arrays(run_dir: Path) -> Path:
    run_dir.mkdir()
    (run_dir / METRICS_FILE).write_text("[0, 1, 2.0]\n[1, 1, 2.0]\n")
    return run_dir


def _metrics_directory(run_dir: Path) -> Path:
    (run_dir / METRICS_FILE).mkdir(parents=True)
    return run_dir


def _trace_is_a_directory(run_dir: Path) -> Path:
    _records(run_dir)
    (run_dir / "trace.json").mkdir()
    return run_dir


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradsync: error: "), err
    return lines[0]


REPORT_CASES: dict[str, tuple[Callable[[Path], Path], list[str]]] = {
    "lines that are JSON arrays": (_arrays, ["line 1 is a JSON array, not an object"]),
    "metrics.jsonl a directory": (_metrics_directory, ["metrics.jsonl is not a file"]),
    "NaN time": (lambda d: _records(d, time=float("nan")), ["time is NaN", "valid is"]),
    "-1e308 time": (lambda d: _records(d, time=-1e308), ["time is -1e+308", "valid is"]),
    "NaN compute": (lambda d: _records(d, compute=float("nan")), ["compute is NaN"]),
    "string compute": (lambda d: _records(d, compute="x"), ['compute is "x"', "from 0 to"]),
    "string loss": (lambda d: _records(d, loss="low"), ['loss is "low"', "valid is a number"]),
    "true step": (lambda d: _records(d, step=True), ["step is true", "whole number"]),
    "huge bytes": (lambda d: _records(d, bytes=1e308), ["bytes is 1e+308", "whole number"]),
    "missing sync": (lambda d: _records(d, sync=None), ["sync is null"]),
    "trace.json a directory": (_trace_is_a_directory, ["cannot write", "make it writable"]),
}


@pytest.mark.parametrize("case", REPORT_CASES)
def test_report_on_a_bad_run_directory_is_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, expected = REPORT_CASES[case]
    run_dir = make(tmp_path / "run")
    assert main(["report", str(run_dir), "--no-plots"]) == 2
    line = _one_error_line(capsys)
    for text in expected:
        assert text in line, line


def test_a_full_disk_at_report_time_says_so_not_make_it_writable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training ended, then the disk was full when the report wrote trace.json: the advice
    was 'make it writable' (a tester's)."""
    import errno

    from gradsync.telemetry import cli as telemetry_cli

    def full(path: Path, *args: object, **kwargs: object) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(telemetry_cli, "write_trace", full)
    assert main(["report", str(_records(tmp_path / "run")), "--no-plots"]) == 2
    line = _one_error_line(capsys)
    assert "No space left on device" in line and "free space there" in line, line
    assert "make it writable" not in line


def test_a_diverged_loss_is_still_reported(tmp_path: Path) -> None:
    """NaN is what a diverged step's loss is recorded as: the report takes it."""
    assert main(["report", str(_records(tmp_path / "run", loss=float("nan"))), "--no-plots"]) == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_report_on_a_read_only_run_directory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _records(tmp_path / "run")
    run_dir.chmod(0o555)
    try:
        assert main(["report", str(run_dir), "--no-plots"]) == 2
    finally:
        run_dir.chmod(0o755)
    assert "Permission denied" in _one_error_line(capsys)


def _png_is_a_directory(tmp_path: Path) -> list[str]:
    (tmp_path / "plots" / "sim_scaling.png").mkdir(parents=True)
    return ["--sweep-workers", "2,4", "--plot-dir", str(tmp_path / "plots")]


def _non_object_lines(tmp_path: Path) -> list[str]:
    _arrays(tmp_path / "run")
    return ["--from", str(tmp_path / "run")]


def _calibration_list(tmp_path: Path) -> list[str]:
    (tmp_path / "calibration.json").write_text("[1, 2]\n")
    return ["--calibration", str(tmp_path / "calibration.json")]


SIMULATE_CASES: dict[str, tuple[Callable[[Path], list[str]], list[str]]] = {
    "--from with non-object lines": (_non_object_lines, ["--from", "not an object"]),
    "a calibration file that is a list": (_calibration_list, ["calibration.json", "not a"]),
    "--workers 100000000": (
        lambda _: ["--workers", "100000000"],
        ["--workers 100000000 x --steps 100", "or fewer"],
    ),
    "--sweep-workers to 100000000": (
        lambda _: ["--sweep-workers", "4,100000000"],
        ["--workers 100000000", "or fewer"],
    ),
    "a --plot-dir whose PNG is a directory": (
        _png_is_a_directory,
        ["--plot-dir", "sim_scaling.png", "writable directory"],
    ),
}


@pytest.mark.parametrize("case", SIMULATE_CASES)
def test_simulate_on_bad_input_is_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, expected = SIMULATE_CASES[case]
    assert main(["simulate", *make(tmp_path)]) == 2
    line = _one_error_line(capsys)
    for text in expected:
        assert text in line, line


def test_run_with_more_threads_than_the_machine_runs_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--workload", "mlp", "--steps", "2", "--out", str(tmp_path / "out")]
    assert main([*argv, "--threads", "100000"]) == 2
    line = _one_error_line(capsys)
    assert "--threads 100000" in line and "use at most" in line, line
    assert not (tmp_path / "out").exists()


# The library: a one-rank gloo group in this process (tests/conftest.py's one_rank)


def _model() -> torch.nn.Module:
    return torch.nn.Linear(3, 2)


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


SYNCHRONIZER_CASES: dict[str, tuple[Callable[[], gs.Synchronizer], str]] = {
    "a model that is a string": (
        lambda: gs.Synchronizer("x", _sgd(_model())),  # type: ignore[arg-type]
        "model must be a torch.nn.Module, got str 'x'",
    ),
    "an optimizer of None": (
        lambda: gs.Synchronizer(_model(), None),  # type: ignore[arg-type]
        "optimizer must be a torch.optim.Optimizer",
    ),
    "timeout_s='10'": (
        lambda: gs.Synchronizer(m := _model(), _sgd(m), timeout_s="10"),  # type: ignore[arg-type]
        "timeout_s must be a number of seconds > 0, got '10'",
    ),
    "telemetry_every='10'": (
        lambda: gs.Synchronizer(m := _model(), _sgd(m), telemetry_every="10"),  # type: ignore[arg-type]
        "telemetry_every must be an integer >= 1, got '10'",
    ),
    "sparse gradients": (
        lambda: gs.Synchronizer(e := torch.nn.Embedding(8, 3, sparse=True), _sgd(e)),
        "Embedding (the model) was built with sparse=True",
    ),
}


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("case", SYNCHRONIZER_CASES)
def test_a_bad_synchronizer_argument_is_a_usage_error(case: str) -> None:
    make, expected = SYNCHRONIZER_CASES[case]
    with pytest.raises(UsageError) as refused:
        make()
    assert expected in str(refused.value)


@pytest.mark.usefixtures("one_rank")
def test_step_and_load_after_close_and_load_of_a_file_are_usage_errors(tmp_path: Path) -> None:
    model = _model()
    sync = gs.Synchronizer(model, _sgd(model), telemetry=False)
    a_file = tmp_path / "checkpoint.pt"
    a_file.write_text("not a checkpoint directory")
    try:
        with pytest.raises(UsageError, match=r"checkpoint.pt'\): a file, not a checkpoint"):
            sync.load(a_file)
    finally:
        sync.close()
    with pytest.raises(UsageError, match=r"sync.step\(\) after sync.close\(\)"), sync.step():
        model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(UsageError, match=r"sync.load\(\) after sync.close\(\)"):
        sync.load(tmp_path)
