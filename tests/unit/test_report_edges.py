"""`gradsync report` at its edges: settings that leave no step to judge, settings other than
the run's own (report.json keeps the run's), a torn metrics.jsonl line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.telemetry.cli import REPORT_FILE, analyze_records, main
from gradsync.telemetry.records import METRICS_FILE, write_records
from gradsync.telemetry.stragglers import StragglerConfig, synthetic_records
from tests.support.restart_telemetry import tear_last_line

pytestmark = pytest.mark.unit


def _run(path: Path, steps: int = 40) -> Path:
    path.mkdir()
    records = synthetic_records(steps, 2, bytes_per_step=1000, seed=5)
    write_records(path / METRICS_FILE, records)
    (path / "config.json").write_text(json.dumps({"strategy": "bsp"}))
    # report.json as the run writes it: its own straggler settings (the defaults)
    analysis = analyze_records(path, records, StragglerConfig())
    (path / REPORT_FILE).write_text(json.dumps(analysis.run_report()))
    return path


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--warmup", "1000"], "the warm-up (1000) plus one window (20 steps)"),
        (["--window", "1000"], "the warm-up (10) plus one window (1000 steps)"),
        (["--warmup", "25"], "the warm-up (25) plus one window (20 steps)"),
    ],
)
def test_settings_that_leave_no_step_to_judge_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    run = _run(tmp_path / "run")
    assert main(["report", str(run), "--no-plots", *flags]) == 0
    out = capsys.readouterr().out
    assert f"none judged: the run has 40 steps, fewer than {named}: no step was scored" in out
    assert "none: no rank was" not in out  # not "no straggler for 500 steps or more"
    assert main(["report", str(run), "--no-plots", "--json", *flags]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "40 steps" in data["unjudged"] and not data["stragglers"]


def test_a_run_long_enough_is_judged_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run", steps=30)  # warm-up 10 + window 20: exactly enough
    assert main(["report", str(run), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "none judged" not in out and "none: no rank was" in out and "scores (" in out
    assert "report.json keeps" not in out  # the run's own settings: nothing to say


def test_other_settings_leave_report_json_and_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run")
    before = (run / REPORT_FILE).read_text()
    assert main(["report", str(run), "--no-plots", "--window", "2"]) == 0
    out = capsys.readouterr().out
    assert (run / REPORT_FILE).read_text() == before
    assert (
        f"note: {run / REPORT_FILE} keeps the run's own findings and scores (window 20, "
        "threshold 0.75, warm-up 10) and is left as it was; the findings and scores above, "
        "trace.json and the plots are for window 2, threshold 0.75, warm-up 10"
    ) in out
    assert main(["report", str(run), "--no-plots", "--json", "--window", "2"]) == 0
    assert "window 20" in json.loads(capsys.readouterr().out)["run_settings"]


def test_a_torn_line_is_one_clean_line_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recwarn: pytest.WarningsRecorder
) -> None:
    run = _run(tmp_path / "run")
    tear_last_line(run / METRICS_FILE)
    assert main(["report", str(run), "--no-plots"]) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"gradsync: warning: {run / METRICS_FILE}: dropped its last line")
    assert "(line 80)" in err and "\n" not in err and "RuntimeWarning" not in err
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
