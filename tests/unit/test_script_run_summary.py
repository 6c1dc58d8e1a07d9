"""What ``gradsync run -- SCRIPT`` says of a script's run, with the workers faked: a --resume
without --nproc continues on the saved run's ranks (not the default 4), and the header names a
change of their number both ways; a --kill that never fired is reported; progress.json ends at
the run's last step; the start line names the compressor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import gradsync.processes.launch
from gradsync.progress import HEARTBEAT_FILE
from gradsync.runner.cli import main
from gradsync.telemetry.records import METRICS_FILE, StepRecord, write_records

pytestmark = pytest.mark.unit

FLAGS = ["--no-plots", "--no-progress"]


class FakeLaunch:
    """The workers of a script that takes ``steps`` steps on every rank; ``fired``: the
    --kill markers it leaves (rank, step), as a kill that fired does."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.steps = 20
        self.fired: list[tuple[int, int]] = []
        #: the steps of a first attempt on rank 1 before a restart that counts from 0 again
        self.restarted_after = 0

    def __call__(self, entry: Any, args: tuple[Any, ...], **kwargs: Any) -> dict[int, Any]:
        cfg = args[0]
        self.calls.append({**cfg, **kwargs})
        run = Path(cfg["out"])
        # rank 0's heartbeat at its last gather, as a script without report() leaves it
        (run / HEARTBEAT_FILE).write_text(json.dumps({"step": 10, "total": 0, "loss": None}))
        attempt = 1 if self.restarted_after else 0
        records = [
            StepRecord(1, s, 50.0 + s, 0.5, 0.5, 0.0, 0.0, 4, 10)
            for s in range(self.restarted_after)
        ] + [
            StepRecord(r, s, 100.0 + s, 0.5, 0.5, 0.0, 0.0, 4, 10, float(r + 1), attempt=attempt)
            for s in range(self.steps)
            for r in range(cfg["nproc"])
        ]
        write_records(run / METRICS_FILE, records)
        for rank, step in self.fired:
            (run / "faults").mkdir(exist_ok=True)
            (run / "faults" / f"kill-rank{rank}-step{step}.json").write_text("{}")
        return {0: {"run_dir": cfg["out"]}}


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch) -> FakeLaunch:
    fake = FakeLaunch()
    monkeypatch.setattr(gradsync.processes.launch, "launch", fake)
    return fake


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def _saved_nproc(run: Path) -> int:
    return int(json.loads((run / "config.json").read_text())["nproc"])


def test_a_resume_without_nproc_continues_on_the_saved_runs_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch, script: str
) -> None:
    run = tmp_path / "run"
    assert main(["run", "--nproc=2", f"--out={run}", *FLAGS, "--", script]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", f"--out={run}", *FLAGS, "--", script]) == 0
    captured = capsys.readouterr()
    assert launch.calls[-1]["nproc"] == 2 and _saved_nproc(run) == 2
    assert ", 2 workers, " in captured.err.splitlines()[0], captured.err
    assert captured.out.splitlines()[0] == f"run: {run} (20 steps, 2 ranks)", captured.out
    # a given --nproc is taken, even the default's value; the header names both, for growth too
    assert main(["run", "--resume", "--nproc=4", f"--out={run}", *FLAGS, "--", script]) == 0
    out = capsys.readouterr().out.splitlines()
    assert launch.calls[-1]["nproc"] == 4 and _saved_nproc(run) == 4
    assert out[0] == f"run: {run} (20 steps, 4 ranks; 2 before the resume)", out[:3]
    # without --resume, the default stays 4
    fresh = tmp_path / "fresh"
    assert main(["run", f"--out={fresh}", *FLAGS, "--", script]) == 0
    assert launch.calls[-1]["nproc"] == 4


def test_a_builtin_resume_without_nproc_continues_on_the_saved_runs_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch
) -> None:
    run = tmp_path / "run"
    argv = ["run", "--workload=mlp", "--steps=20", f"--out={run}", *FLAGS]
    assert main([*argv, "--nproc=2"]) == 0
    assert main([*argv, "--resume"]) == 0
    assert launch.calls[-1]["nproc"] == 2 and _saved_nproc(run) == 2
    assert capsys.readouterr().out.count("2 before the resume") == 0


def test_a_kill_that_never_fired_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch, script: str
) -> None:
    run = tmp_path / "run"
    kill = ["--kill=1:500", "--max-restarts=1"]
    assert main(["run", "--nproc=2", *kill, f"--out={run}", *FLAGS, "--", script]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        "warning: --kill 1:500 did not fire: rank 1's last step was 19, so no fault was "
        "injected and nothing restarted"
    ), out[:3]
    # one that fired (its marker in faults/) is not
    launch.fired = [(1, 5)]
    kill = ["--kill=1:5", "--max-restarts=1", "--overwrite"]
    assert main(["run", "--nproc=2", *kill, f"--out={run}", *FLAGS, "--", script]) == 0
    assert "did not fire" not in capsys.readouterr().out


def test_progress_ends_at_the_last_step_and_the_start_line_names_the_compressor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch, script: str
) -> None:
    run = tmp_path / "run"
    launch.steps = 40
    argv = ["run", "--nproc=2", "--compress=int8", f"--out={run}", *FLAGS, "--", script]
    assert main(argv) == 0
    start = capsys.readouterr().err.splitlines()[0]
    assert "its own strategy, compression int8, 2 workers" in start, start
    beat = json.loads((run / HEARTBEAT_FILE).read_text())
    assert beat == {"step": 40, "total": 40, "loss": 1.5}, beat


def test_a_restart_that_counted_from_0_again_is_said_and_counted_after_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch, script: str
) -> None:
    """A script resumed without sync.load, killed at step 8: the restart's records (steps 0-19
    again) follow the first attempt's 8 steps, and a line says why the numbers are not the
    script's own iterations, naming sync.load and register_state."""
    run = tmp_path / "run"
    launch.restarted_after = 8
    kill = ["--kill=0:8", "--max-restarts=1"]
    launch.fired = [(0, 8)]
    assert main(["run", "--nproc=2", *kill, f"--out={run}", *FLAGS, "--", script]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"run: {run} (28 steps, 2 ranks)", out[:3]
    assert out[1] == (
        "restart 1 of 1: the script counted its steps from 0 again (it resumed without "
        "sync.load), so gradsync cannot know its own iterations: steps 8 on are that "
        "attempt's steps 0 on; sync.load (sync.register_state for the script's other state) "
        "keeps the step numbers"
    ), out[:3]
    assert json.loads((run / HEARTBEAT_FILE).read_text())["step"] == 28
