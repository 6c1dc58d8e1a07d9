"""`gradsync compare` takes `gradsync run`'s flags, so each must work there or be refused
(issue 41): --max-restarts reaches the launcher, --hosts/--link (the emulated cluster, which
compare does not launch on) are refused, saying where they work. The launcher is replaced here
by one that writes each run's records (the command end to end: tests/e2e/test_compare_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import gradsync.processes.launch
from gradsync.flags import option_of
from gradsync.runner.cli import main as cli_main
from gradsync.runner.compare import RUN_ONLY_FIELDS
from gradsync.runner.config import RunConfig
from gradsync.telemetry.records import METRICS_FILE, StepRecord, write_records

pytestmark = pytest.mark.unit


class FakeLaunch:
    """Records what each launch was asked, and writes the run's step records as rank 0 would."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, entry: Any, args: tuple[Any, ...], **kwargs: Any) -> dict[int, Any]:
        cfg = args[0]
        self.calls.append({"strategy": cfg["strategy"], **kwargs})
        records = [
            StepRecord(r, s, 100.0 + s, 0.5, 0.5, 0.0, 0.0, 4, 10, loss=1.0 / (s + 1))
            for s in range(cfg["steps"])
            for r in (0, 1)
        ]
        write_records(Path(cfg["out"]) / METRICS_FILE, records)
        return {0: None}


COMPARE = ["compare", "--strategies", "bsp,local:2", "--steps", "4", "--no-plots"]


def test_max_restarts_reaches_the_launcher_of_every_strategy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeLaunch()
    monkeypatch.setattr(gradsync.processes.launch, "launch", fake)
    out = tmp_path / "cmp"
    assert cli_main([*COMPARE, "--max-restarts", "2", "--out", str(out), "--no-progress"]) == 0
    assert [(c["strategy"], c["max_restarts"]) for c in fake.calls] == [
        ("bsp", 2),
        ("local:2", 2),
    ]
    rows = json.loads((out / "compare.json").read_text())["rows"]
    assert [r["strategy"] for r in rows] == ["bsp", "local:2"]
    assert "bsp" in capsys.readouterr().out


def test_hosts_and_link_are_refused_naming_gradsync_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeLaunch()
    monkeypatch.setattr(gradsync.processes.launch, "launch", fake)
    argv = [*COMPARE, "--hosts", "2", "--link", "10mbit", "--out", str(tmp_path / "cmp")]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "gradsync compare runs each strategy on local processes" in err, err
    assert "--hosts 2 and --link 10mbit" in err and "gradsync run --hosts 2" in err, err
    assert fake.calls == []  # nothing launched
    assert not (tmp_path / "cmp").exists()  # and no directory made


def test_compare_help_lists_no_flag_compare_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["compare", "--help"])
    text = capsys.readouterr().out
    for name in sorted(RUN_ONLY_FIELDS):
        assert f"{option_of(RunConfig, name)} " not in text, name


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (["--target-loss", "nan"], "--target-loss must be a finite number, got nan"),
        (["--target-loss", "inf"], "--target-loss must be a finite number, got inf"),
        (["--target-loss", "-1"], "--target-loss -1 is below 0, which the built-in workloads'"),
        (["--strategies", "bsp,,local:2"], "--strategies has an empty item in 'bsp,,local:2'"),
        (["--strategies", "bsp,"], "--strategies has an empty item in 'bsp,'"),
    ],
)
def test_targets_no_run_reaches_and_empty_strategies_are_refused_before_any_launch(
    given: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """They were accepted: every row then showed "never", or the empty item was dropped."""
    fake = FakeLaunch()
    monkeypatch.setattr(gradsync.processes.launch, "launch", fake)
    assert cli_main([*COMPARE, *given, "--out", str(tmp_path / "cmp"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert fake.calls == []
    assert not (tmp_path / "cmp").exists()


def test_a_script_may_time_to_a_negative_loss() -> None:
    """A script's own loss may be below 0 (a negated reward): its target is its own."""
    from gradsync.runner.compare import check_target_loss

    check_target_loss(-1.0, ["train.py"])


def test_a_strategy_its_own_config_refuses_is_refused_before_the_first_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """bsp refuses --bucket-mb auto with --compress fp16; local:2 (first) takes it: the
    comparison stopped after local:2's run."""
    fake = FakeLaunch()
    monkeypatch.setattr(gradsync.processes.launch, "launch", fake)
    argv = ["compare", "--strategies", "local:2,bsp", "--steps", "4", "--no-plots"]
    argv += ["--bucket-mb", "auto", "--compress", "fp16", "--out", str(tmp_path / "cmp")]
    assert cli_main(argv) == 2
    assert "--strategies bsp: --bucket-mb auto with --compress fp16" in capsys.readouterr().err
    assert fake.calls == []
