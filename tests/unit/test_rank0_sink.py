"""The progress line that rank 0 of a run directory keeps (``attached_run.RunSink``): its rate,
and its silence while a restart loads the records a checkpoint brought back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gradsync.attached_run import RunSink, run_settings
from gradsync.telemetry.records import METRICS_FILE, StepRecord, read_records

pytestmark = pytest.mark.unit


class _Lines:
    """Stands in for ``Progress``: keeps what each update would show."""

    def __init__(self) -> None:
        self.updates: list[tuple[int, float | None, float, float]] = []

    def update(self, step: int, loss: float | None, samples_per_s: float, tax: float) -> None:
        self.updates.append((step, loss, samples_per_s, tax))

    def interrupt(self, line: str) -> None:
        pass


def _records(first: int, count: int, start: float, seconds: float) -> list[StepRecord]:
    """``count`` steps of one rank of 16 samples each, ``seconds`` apart from ``start``."""
    return [
        StepRecord(0, first + i, start + i * seconds, seconds, 0.0, 0.0, 0.0, 16, 0, loss=1.0)
        for i in range(count)
    ]


def _sink(tmp_path: Path) -> tuple[RunSink, _Lines]:
    lines = _Lines()
    sink = RunSink(tmp_path, run_settings(tmp_path), 1)
    progress: Any = lines
    sink.progress = progress
    return sink, lines


def test_the_rate_counts_the_time_between_updates(tmp_path: Path) -> None:
    sink, lines = _sink(tmp_path)
    sink(_records(0, 10, start=100.0, seconds=0.01))
    # 50 ms between the two batches (a gather, a save): part of the run's time
    sink(_records(10, 10, start=100.15, seconds=0.01))
    rates = [rate for _, _, rate, _ in lines.updates]
    assert rates == pytest.approx([1600.0, 160 / 0.15]), rates  # 16 samples per 10 ms, then the gap


def test_a_restarted_process_rates_its_own_steps_not_the_downtime(tmp_path: Path) -> None:
    # The restarted attempt's sink is a new one: the steps it restored from the checkpoint
    # (written before the kill, 30 s earlier) do not start its rate.
    sink, lines = _sink(tmp_path)
    sink.showing = False
    sink(_records(0, 5, start=100.0, seconds=0.01))
    sink.showing = True
    sink(_records(5, 10, start=130.0, seconds=0.01))
    assert [rate for _, _, rate, _ in lines.updates] == pytest.approx([1600.0])


def test_records_restored_while_loading_are_written_but_not_shown(tmp_path: Path) -> None:
    sink, lines = _sink(tmp_path)
    sink.showing = False
    sink(_records(0, 5, start=100.0, seconds=0.01))
    assert lines.updates == []
    assert [r.step for r in read_records(tmp_path / METRICS_FILE)] == [0, 1, 2, 3, 4]
    sink.showing = True
    sink(_records(5, 5, start=130.0, seconds=0.01))
    assert [step for step, *_ in lines.updates] == [10]


@pytest.mark.parametrize(
    ("run", "prefix"),
    [
        ("ssp:2 (2/2)", "gradsync: ssp:2 (2/2): straggler: rank 1: "),
        (None, "gradsync: straggler: rank 1: "),
    ],
)
def test_a_straggler_notice_names_the_compare_run_it_is_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], run: str | None, prefix: str
) -> None:
    from gradsync.telemetry.scores import synthetic_records

    # gradsync compare writes which of its runs this is into each run's config.json
    (tmp_path / "config.json").write_text(json.dumps({"compare_run": run} if run else {}))
    sink = RunSink(tmp_path, run_settings(tmp_path), 2)
    sink(synthetic_records(60, 2, slow=[(1, 15, 59, 4.0)]))
    notices = [x for x in capsys.readouterr().err.splitlines() if "straggler" in x]
    assert len(notices) == 1 and notices[0].startswith(prefix), notices
