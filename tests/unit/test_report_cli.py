"""`gradsync report RUN_DIR` on run directories written the way the runtime writes them, through
its handler in this process (the module run as a command: tests/e2e/test_report_cli_e2e.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gradsync.errors import UsageError
from gradsync.telemetry.cli import add_parsers, handler, main, summarize_run
from gradsync.telemetry.plots import PLOT_FILES
from gradsync.telemetry.records import METRICS_FILE, write_records
from gradsync.telemetry.stragglers import synthetic_records

pytestmark = pytest.mark.unit


def make_run(
    path: Path, slow: list[tuple[int | None, int, int, float]], fp32: int | None = None
) -> Path:
    path.mkdir()
    recs = synthetic_records(120, 4, slow=slow, bytes_per_step=250_000, seed=11)
    write_records(path / METRICS_FILE, recs)
    config = {"strategy": "bsp"} | ({"fp32_bytes_per_step": fp32} if fp32 else {})
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_report_names_the_straggler_and_writes_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path / "run", slow=[(2, 40, 90, 1.8)], fp32=1_000_000)
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "compute s" in out and "barrier tax:" in out  # RunReport's table
    assert "rank 2: 1.8x slower than the fastest rank over steps 40-90" in out
    assert "0.250 MB per rank per step" in out
    assert "4.0x fewer than fp32" in out
    for name in ["trace.json", *PLOT_FILES]:
        assert (run / name).stat().st_size > 0, name
        assert str(run / name) in out


def test_report_json_and_no_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path / "run", slow=[(1, 50, 119, 2.0)])
    assert main(["report", str(run), "--json", "--no-plots", "--window", "10"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["window"] == 10 and data["threshold"] == 0.75
    assert [(f["rank"], f["first_step"], f["last_step"]) for f in data["stragglers"]] == [
        (1, 50, 119)
    ]
    assert data["report"]["steps"] == 120
    assert "compression_ratio" not in data["bytes"]  # no fp32 size in config.json
    assert (run / "trace.json").exists()
    assert not any((run / name).exists() for name in PLOT_FILES)


def test_report_warmup_leaves_early_steps_unscored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # rank 3 is slow over steps 0-40 only: a start-up effect if the warm-up covers it
    run = make_run(tmp_path / "run", slow=[(3, 0, 40, 2.0)])
    found = []
    for warmup in ("0", "60"):
        assert main(["report", str(run), "--json", "--no-plots", "--warmup", warmup]) == 0
        found.append([f["rank"] for f in json.loads(capsys.readouterr().out)["stragglers"]])
    assert found == [[3], []]
    assert main(["report", str(run), "--warmup", "-2"]) == 2
    assert "warmup must be an integer >= 0" in capsys.readouterr().err


def test_summarize_run_on_a_clean_run(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", slow=[])
    text = summarize_run(run, plots=False)
    assert "stragglers (window 20 steps, threshold 0.75):\n  none:" in text
    assert "rank 0:" not in text


def test_add_parsers_registers_report_on_a_host_parser(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="gradsync")
    add_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", "somewhere", "--threshold", "0.6", "--no-plots"])
    assert args.func is handler
    assert (args.run_dir, args.window, args.threshold, args.no_plots) == (
        "somewhere",
        20,
        0.6,
        True,
    )
    with pytest.raises(UsageError, match="somewhere"):
        handler(args)


@pytest.mark.parametrize(
    ("setup", "argv", "message"),
    [
        ("none", [], "no run directory at"),
        ("empty-dir", [], "has no metrics.jsonl"),
        ("empty-file", [], "holds no step records"),
        ("run", ["--threshold", "1.5"], "threshold must be between 0 and 1"),
        ("run", ["--window", "1"], "window must be an integer >= 2"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, argv: list[str], message: str
) -> None:
    run = tmp_path / "run"
    if setup == "run":
        make_run(run, slow=[])
    elif setup != "none":
        run.mkdir()
        if setup == "empty-file":
            (run / METRICS_FILE).write_text("")
    assert main(["report", str(run), "--no-plots", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradsync report: error: ") and message in err
    assert "Traceback" not in err


def _groups_dir(path: Path, subdirs: list[str]) -> Path:
    """A directory whose sub-directories are the runs: gradsync run --replica-groups writes
    group-K/, gradsync compare one directory a strategy."""
    path.mkdir()
    (path / "config.json").write_text("{}")
    for name in subdirs:
        (path / name).mkdir()
        write_records(path / name / METRICS_FILE, synthetic_records(10, 1, seed=1))
    return path


@pytest.mark.parametrize("subdirs", [["group-0", "group-1"], ["bsp", "local-4"]])
def test_a_directory_of_runs_points_to_them(
    subdirs: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "is it a gradsync run directory?", of the directory the command just wrote."""
    top = _groups_dir(tmp_path / "top", subdirs)
    assert main(["report", str(top), "--no-plots"]) == 2
    err = capsys.readouterr().err
    shown = ", ".join(str(top / d) for d in subdirs)
    assert f"its sub-directories are runs, each with its own: give one of {shown}" in err, err
    assert main(["report", str(top / subdirs[0]), "--no-plots"]) == 0
    # one rank, and steps: singular where one
    assert f"run: {top / subdirs[0]} (10 steps, 1 rank)" in capsys.readouterr().out


def test_a_run_of_no_steps_has_no_bytes_per_step(tmp_path: Path) -> None:
    """A script that called report() without a step (a docs tester's) raised ZeroDivisionError
    here, before gradsync run could say it wrote no step records."""
    from gradsync.telemetry.cli import _bytes

    assert _bytes([], tmp_path) == {"total": 0.0, "per_rank_step": 0.0}


@pytest.mark.parametrize(
    ("per_rank", "fp32", "said"),
    [
        (400.0, 400_384.0, "0.0004 MB per rank per step"),  # sparseloco's: was 0.000 MB
        (410_394.0, 400_384.0, "1.03x more than fp32"),  # zero:1 + int8's: was 1.0x more
        (100_096.0, 400_384.0, "4.0x fewer than fp32"),
    ],
)
def test_small_byte_counts_and_ratios_near_1_keep_their_digits(
    per_rank: float, fp32: float, said: str
) -> None:
    from gradsync.telemetry.cli import _format_bytes

    line = _format_bytes(
        {
            "per_rank_step": per_rank,
            "total": per_rank * 80,
            "fp32_per_rank_step": fp32,
            "compression_ratio": fp32 / per_rank,
        },
        2,
    )
    assert said in line, line
