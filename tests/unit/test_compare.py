"""`gradsync compare`'s curve arithmetic, heartbeat watching and refusals, in this process. The
command end to end: tests/e2e/test_compare_e2e.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from gradsync.progress import HEARTBEAT_FILE, Progress, read_heartbeat
from gradsync.runner.cli import main as cli_main
from gradsync.runner.compare import _watch, curve_from_records, parse_strategies, summarize
from gradsync.telemetry.records import StepRecord

pytestmark = pytest.mark.unit


def _records(losses: list[float], step_s: float, nbytes: int) -> list[StepRecord]:
    return [
        StepRecord(r, s, 100.0 + s * step_s, step_s / 2, step_s / 2, 0.0, 0.0, 4, nbytes, loss=v)
        for s, v in enumerate(losses)
        for r in (0, 1)
    ]


def test_target_is_reached_on_the_smoothed_curve(tmp_path: Path) -> None:
    fast = curve_from_records("fast", _records([1.0] * 5 + [0.1] * 25, 0.1, 10))
    slow = curve_from_records("slow", _records([1.0] * 20 + [0.5] * 10, 0.1, 1))
    assert fast.bytes[-1] == 2 * 30 * 10  # cumulative over both ranks
    assert np.isclose(fast.seconds[-1], 3.0)
    # the 10-step moving average crosses 0.55 only once enough low values are in the window
    assert fast.first_below(0.55) == 9
    result = summarize([fast, slow], None, tmp_path)
    assert result["target_loss"] == pytest.approx(0.5)  # default: the worst final loss
    rows = {r["strategy"]: r for r in result["rows"]}
    assert rows["fast"]["steps_to_target"] < rows["slow"]["steps_to_target"]
    assert rows["slow"]["steps_to_target"] == 30
    assert json.loads((tmp_path / "compare.json").read_text())["rows"][0]["strategy"] == "fast"
    assert (tmp_path / "loss_vs_time.png").stat().st_size > 0


def test_curve_counts_pulls_and_keeps_the_raw_loss() -> None:
    c = curve_from_records("ps", _records([1.0] * 29 + [0.0], 0.1, 10), pull_bytes=100)
    # every worker step: its own 10 bytes pushed plus the 100 the servers sent back
    assert c.bytes[-1] == 2 * 30 * (10 + 100)
    assert c.raw[-1] == 0.0  # the last step's mean loss, as the runs' progress lines show it
    assert c.loss[-1] == pytest.approx(0.9)  # the moving average the target is judged on


def test_heartbeat_is_written_without_a_progress_line(tmp_path: Path) -> None:
    assert read_heartbeat(tmp_path) is None
    shown = Progress(10, enabled=False, heartbeat=tmp_path / HEARTBEAT_FILE)
    shown.update(7, 1.25, 0.0, 0.0)
    assert read_heartbeat(tmp_path) == {"step": 7, "total": 10, "loss": 1.25}
    (tmp_path / HEARTBEAT_FILE).write_text("{half")  # never raises on a bad file
    assert read_heartbeat(tmp_path) is None


class _Recorder(Progress):
    def __init__(self) -> None:
        super().__init__(100, enabled=False)
        self.seen: list[tuple[int, float | None]] = []

    def update(self, step: int, loss: float | None, samples_per_s: float, tax: float) -> None:
        self.seen.append((step, loss))


def test_watch_advances_the_comparison_from_the_heartbeat(tmp_path: Path) -> None:
    recorder, stop = _Recorder(), threading.Event()
    watcher = threading.Thread(target=_watch, args=(tmp_path, 40, recorder, stop, 0.01))
    watcher.start()
    try:
        for step in (10, 20):
            Progress(50, enabled=False, heartbeat=tmp_path / HEARTBEAT_FILE).update(
                step, 2.0 - step / 100, 0.0, 0.0
            )
            for _ in range(500):  # up to 5 s for the watcher to poll
                if recorder.seen and recorder.seen[-1][0] == 40 + step:
                    break
                stop.wait(0.01)
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert recorder.seen == [(50, 1.9), (60, 1.8)]  # offset + step, each heartbeat once


def test_compare_refuses_the_run_strategy_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["compare", "--strategy", "ssp:2", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--strategies" in err and "'ssp:2'" in err


def test_strategy_list_errors() -> None:
    with pytest.raises(ValueError, match="valid: bsp"):
        parse_strategies("bsp,gossip")
    with pytest.raises(ValueError, match="twice"):
        parse_strategies("bsp,bsp")
    with pytest.raises(ValueError, match="at least one"):
        parse_strategies(" , ")


def test_the_table_s_final_loss_is_the_last_step_s_as_gradsync_run_reports_it(
    tmp_path: Path,
) -> None:
    from gradsync.runner.compare import format_table

    curve = curve_from_records("bsp", _records([1.0] * 29 + [0.0], 0.1, 10))
    result = summarize([curve], None, tmp_path, plots=False)
    (row,) = result["rows"]
    # RunReport's final_loss: the last step's loss averaged over the ranks
    assert row["final_loss"] == 0.0
    assert row["final_loss_moving_average"] == pytest.approx(0.9)
    line = next(x for x in format_table(result).splitlines() if x.startswith("bsp"))
    assert line.split()[1:3] == ["0.0000", "0.9000"]


def test_a_run_that_counted_no_samples_shows_no_rate(tmp_path: Path) -> None:
    """A script that gives sync.step() no samples= counts none: its rate is unknown ("n/a"),
    not 0 samples/s beside a run that counted them."""
    from gradsync.runner.compare import format_table

    counted = curve_from_records("bsp", _records([1.0] * 10, 0.1, 10))
    uncounted = [
        StepRecord(r, s, 100.0 + s * 0.1, 0.05, 0.05, 0.0, 0.0, 0, 10, loss=1.0)
        for s in range(10)
        for r in (0, 1)
    ]
    result = summarize(
        [counted, curve_from_records("local:2", uncounted)], None, tmp_path, plots=False
    )
    rows = {r["strategy"]: r for r in result["rows"]}
    assert rows["bsp"]["samples_per_s"] == pytest.approx(2 * 10 * 4 / 1.0)  # 10 steps of 0.1 s
    assert rows["local:2"]["samples_per_s"] is None
    table = format_table(result).splitlines()
    assert next(x for x in table if x.startswith("local:2")).split()[5] == "n/a"
    assert next(x for x in table if x.startswith("bsp ")).split()[5] == "80"


def test_a_log_gets_the_last_steps_line_once() -> None:
    """compare's heartbeat watcher and its own end both report the last step: a log (not a
    terminal) showed the final progress line twice."""
    import io

    class Log(io.StringIO):
        def isatty(self) -> bool:
            return False

    log = Log()
    progress = Progress(160, stream=log)
    progress.label = "async (4/4)"
    progress.update(160, 0.0918, 0.0, 0.0)
    progress.update(160, 0.0918, 0.0, 0.0)
    assert log.getvalue().count("step 160/160") == 1, log.getvalue()


def test_a_script_s_runs_end_their_line_at_their_last_step_and_name_their_notices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script's comparison ended each run's progress line at "step 0" (its number of steps
    is its own: the line's total is 0); each run's config.json names the run, for rank 0's
    straggler notices (attached_run.RunSink)."""
    import gradsync.processes.launch as launching
    from gradsync.runner.compare import run_comparison
    from gradsync.runner.config import RunConfig
    from gradsync.telemetry.records import METRICS_FILE, write_records

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    named: dict[str, str] = {}

    def launch(fn: object, args: tuple[dict[str, object]], **_: object) -> None:
        run_dir = Path(str(args[0]["out"]))
        config = json.loads((run_dir / "config.json").read_text())
        named[str(config["strategy"])] = config["compare_run"]
        write_records(run_dir / METRICS_FILE, _records([2.0] * 24 + [1.5], 0.01, 10))

    monkeypatch.setattr(launching, "launch", launch)
    base = RunConfig(script=[str(script)], out=str(tmp_path / "cmp"), plots=False)
    run_comparison(base, ["bsp", "local:2"], None, show_progress=True)
    err = capsys.readouterr().err
    assert "bsp (1/2) step 25  loss 1.5000" in err, err
    assert "local:2 (2/2) step 25  loss 1.5000" in err, err
    assert "step 0 " not in err, err
    assert named == {"bsp": "bsp (1/2)", "local:2": "local:2 (2/2)"}


@pytest.mark.parametrize("recorded", [True, False])
def test_a_script_s_parameter_server_run_counts_its_pulls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorded: bool
) -> None:
    """ssp/async on a script: the pulls its rank 0 counted (config.json's pull_bytes_per_step,
    attached_run.pulled_bytes) are in MB sent, as a built-in workload's are; a run that
    recorded none says its figure is pushes only."""
    import torch

    import gradsync.processes.launch as launching
    from gradsync.attached_run import AttachedRun, pulled_bytes
    from gradsync.runner.compare import format_table, run_comparison
    from gradsync.runner.config import RunConfig
    from gradsync.telemetry.records import METRICS_FILE, write_records

    model = torch.nn.Linear(10, 5)  # 55 fp32 parameters
    params = list(model.parameters())
    assert pulled_bytes(params, 0) == 0
    assert pulled_bytes(params, 2) == 55 * 4 + 2 * 4  # a one-element header per server
    script = tmp_path / "train.py"
    script.write_text("pass\n")

    def launch(fn: object, args: tuple[dict[str, object]], **_: object) -> None:
        run_dir = Path(str(args[0]["out"]))
        if recorded:  # as rank 0's first gs.Synchronizer does
            servers = 1 if args[0]["strategy"] == "ssp:2" else 0
            AttachedRun(run_dir).start(0, 2, 55, pulled_bytes(params, servers))
        write_records(run_dir / METRICS_FILE, _records([1.0] * 10, 0.01, 220))

    monkeypatch.setattr(launching, "launch", launch)
    base = RunConfig(script=[str(script)], out=str(tmp_path / "cmp"), plots=False)
    result = run_comparison(base, ["bsp", "ssp:2"], None, show_progress=False)
    rows = {r["strategy"]: r for r in result["rows"]}
    assert rows["bsp"]["mb_sent"] * 1e6 == 2 * 10 * 220
    pulls = 2 * 10 * (55 * 4 + 4) if recorded else 0
    assert rows["ssp:2"]["mb_sent"] * 1e6 == pytest.approx(2 * 10 * 220 + pulls)
    note = "ssp:2: pushes only"
    assert (note in format_table(result)) is not recorded
