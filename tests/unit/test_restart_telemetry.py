"""Telemetry of a run restarted by the elastic agent: every completed step once, the latest
attempt's record where a step ran twice, and report.json with the straggler findings."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gradsync.attached_run import drop_records_from, write_report
from gradsync.telemetry.records import (
    METRICS_FILE,
    StepRecord,
    check_record,
    read_records,
    restarted_counts,
    write_records,
)
from gradsync.telemetry.report import RunReport
from gradsync.telemetry.stragglers import StragglerConfig, synthetic_records
from gradsync.telemetry.timing import _COLUMNS, _record
from tests.support.restart_telemetry import tear_last_line

pytestmark = pytest.mark.unit

STEPS, RANKS, BYTES = 40, 2, 1000


def _attempts(tmp: Path, killed_at: int, resumed_at: int) -> Path:
    """metrics.jsonl as two attempts append it: the first ran steps 0..killed_at-1, the second
    (bytes doubled, to tell them apart) steps resumed_at..STEPS-1."""
    first = synthetic_records(STEPS, RANKS, bytes_per_step=BYTES, seed=1)
    second = synthetic_records(STEPS, RANKS, bytes_per_step=2 * BYTES, seed=2)
    write_records(tmp / METRICS_FILE, [r for r in first if r.step < killed_at])
    write_records(tmp / METRICS_FILE, [r for r in second if r.step >= resumed_at])
    return tmp


@pytest.mark.parametrize("resumed_at", [0, 15], ids=["no-checkpoint", "checkpoint"])
def test_each_step_counts_once_with_its_latest_attempt(tmp_path: Path, resumed_at: int) -> None:
    records = read_records(_attempts(tmp_path, killed_at=20, resumed_at=resumed_at))
    assert sorted((r.rank, r.step) for r in records) == [
        (rank, step) for rank in range(RANKS) for step in range(STEPS)
    ]
    rerun = {r.step for r in records if r.bytes == 2 * BYTES}
    assert rerun == set(range(resumed_at, STEPS))  # the rerun steps: the second attempt's
    report = RunReport.from_records(records)
    assert report.steps == STEPS
    # Without the merge: 60 steps' bytes per rank without a checkpoint (rolled back twice).
    expected = resumed_at * BYTES + (STEPS - resumed_at) * 2 * BYTES
    assert [t.bytes for t in report.ranks] == [expected] * RANKS


def test_report_json_covers_every_attempt_and_names_the_stragglers(tmp_path: Path) -> None:
    recs = synthetic_records(120, 4, slow=[(2, 40, 119, 2.0)], bytes_per_step=BYTES, seed=3)
    write_records(tmp_path / METRICS_FILE, recs)
    write_records(tmp_path / METRICS_FILE, [r for r in recs if r.step >= 100])  # a rerun
    # This attempt's own report holds only its steps since the resume point.
    own = RunReport.from_records([r for r in recs if r.step >= 100])
    cfg = StragglerConfig(window=20, threshold=0.75, warmup=10)
    result = write_report(tmp_path, cfg, own)
    data = json.loads((tmp_path / "report.json").read_text())
    assert result["steps"] == data["steps"] == 120
    assert [r["steps"] for r in data["ranks"]] == [120] * 4
    assert [(f["rank"], f["first_step"]) for f in data["stragglers"]] == [(2, 40)]
    assert data["straggler_window"] == cfg.window and len(data["scores"]) == 4


def test_a_resume_leaves_each_earlier_step_once_in_the_raw_file(tmp_path: Path) -> None:
    # Steps 0-9 gathered before the failure; the checkpoint resumed from (step 8) held the
    # records of steps 6 and 7 not gathered when it was taken, which load() writes again.
    path = tmp_path / METRICS_FILE
    records = synthetic_records(10, RANKS, bytes_per_step=BYTES, seed=3)
    write_records(path, records + [r for r in records if r.step in (6, 7)])
    drop_records_from(path, 8)
    keys = [(d["rank"], d["step"]) for d in map(json.loads, path.read_text().splitlines())]
    assert sorted(keys) == [(rank, step) for rank in range(2) for step in range(8)]
    assert len(keys) == len(set(keys))


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("one_rank", "inline_writer")
@pytest.mark.parametrize("strategy", ["bsp", "hogwild"])
def test_loads_in_the_same_process_leave_each_step_once_in_the_report(
    tmp_path: Path, strategy: str
) -> None:
    """A rollback in the same process (steps 5..9 run twice) and a second load in a row: the
    report holds every step once, the latest run of it."""
    import gradsync as gs
    from gradsync.workloads import make_workload

    w = make_workload("mlp", seed=1, params=2000)
    model = w.build_model()
    sync = gs.Synchronizer(
        model, w.make_optimizer(model, w.default_lr), strategy=strategy, telemetry_every=4
    )

    def run_to(stop: int) -> None:
        while sync.step_count < stop:
            s = sync.step_count
            with sync.step():
                w.loss(model, *w.batch(s, 8, 0, 8)).backward()

    try:
        run_to(5)
        sync.save(tmp_path)
        run_to(10)
        for _ in range(2):
            loaded = sync.load(tmp_path)
            assert loaded is not None and loaded["step"] == 5
        run_to(10)
        records = sync.report().records
    finally:
        sync.close()
    assert sorted(r.step for r in records) == list(range(10))


def test_a_torn_last_line_is_dropped_with_a_warning_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    write_records(path, synthetic_records(10, RANKS, bytes_per_step=BYTES, seed=3))
    torn = json.loads(tear_last_line(path))
    for read in (lambda: read_records(tmp_path), lambda: drop_records_from(path, 10)):
        with pytest.warns(RuntimeWarning, match=rf"{re.escape(str(path))}: .*\(line 20\)"):
            read()
    # the resume's rewrite of the file leaves every whole line, and none torn
    keys = [(d["rank"], d["step"]) for d in map(json.loads, path.read_text().splitlines())]
    assert len(keys) == 2 * 10 - 1 and (torn["rank"], torn["step"]) not in keys


def test_an_append_after_a_torn_last_line_cuts_it_first(tmp_path: Path) -> None:
    """A resume's restored records are appended before anything reads metrics.jsonl: glued to
    a torn last line they made a line that is not JSON mid-file, and every later resume and
    report failed (a tester's full-disk case). The torn tail is cut, with a warning."""
    path = tmp_path / METRICS_FILE
    records = synthetic_records(10, RANKS, bytes_per_step=BYTES, seed=3)
    write_records(path, records[:12])
    torn = json.loads(tear_last_line(path))
    with pytest.warns(RuntimeWarning, match=rf"{re.escape(str(path))}: dropped its last line"):
        write_records(path, records[12:])
    keys = [(r.rank, r.step) for r in read_records(tmp_path)]  # no warning, no error
    assert len(keys) == 2 * 10 - 1 and (torn["rank"], torn["step"]) not in keys


def test_a_damaged_line_before_the_last_is_an_error_naming_the_file_and_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / METRICS_FILE
    write_records(path, synthetic_records(10, RANKS, bytes_per_step=BYTES, seed=3))
    lines = path.read_text().splitlines(keepends=True)
    lines[6] = lines[6][:40] + "\n"  # a crash cannot leave this: a line after it was written
    path.write_text("".join(lines))
    where = rf"{re.escape(str(path))}: line 7 is not JSON"
    with pytest.raises(ValueError, match=where):
        read_records(tmp_path)
    with pytest.raises(ValueError, match=where):
        drop_records_from(path, 10)
    assert path.read_text() == "".join(lines)  # left for the user to look at


def _attempt(rank: int, step: int, attempt: int) -> StepRecord:
    return StepRecord(rank, step, 100.0 + step, 0.5, 0.5, 0.0, 0.0, 4, 10, attempt=attempt)


def test_an_attempt_that_counts_from_0_again_follows_the_ones_before(tmp_path: Path) -> None:
    """A script resumed without sync.load (its own torch.save, or none): the restart's steps
    are numbered from 0 again. Its records follow the first attempt's, none replacing
    another's; metrics.jsonl keeps them as recorded, with their attempt."""
    first = [_attempt(1, s, 0) for s in range(8)]  # rank 0 was killed: its records lost
    second = [_attempt(r, s, 1) for s in range(20) for r in range(2)]
    write_records(tmp_path / METRICS_FILE, first + second)
    raw = [json.loads(line) for line in (tmp_path / METRICS_FILE).open()]
    assert "attempt" not in raw[0] and raw[-1]["attempt"] == 1 and raw[-1]["step"] == 19
    assert restarted_counts(first + second) == {1: 8}
    records = read_records(tmp_path)
    assert len(records) == 48
    assert sorted(r.step for r in records if r.rank == 1) == list(range(28))
    assert sorted(r.step for r in records if r.rank == 0) == list(range(8, 28))
    assert RunReport.from_records(records).steps == 28


def test_an_attempt_resumed_through_load_keeps_its_step_numbers(tmp_path: Path) -> None:
    """sync.load resumed at step 12 (the records from 12 on dropped): the restart's records
    go on from 12, and a replica group's replacement, healed at a live peer's step, is not
    moved either, even where a step repeats."""
    first = [_attempt(r, s, 0) for s in range(12) for r in range(2)]
    second = [_attempt(r, s, 1) for s in range(12, 20) for r in range(2)]
    assert restarted_counts(first + second) == {}
    healed = [_attempt(r, s, 1) for s in range(11, 20) for r in range(2)]
    assert restarted_counts(first + healed) == {}
    write_records(tmp_path / METRICS_FILE, first + healed)
    assert sorted({r.step for r in read_records(tmp_path)}) == list(range(20))


def test_a_records_attempt_is_checked() -> None:
    good = json.loads(_attempt(0, 0, 2).to_json())
    assert check_record(good)["attempt"] == 2
    with pytest.raises(ValueError, match="attempt is -1: valid is a whole number"):
        check_record({**good, "attempt": -1})


def test_records_name_the_attempt_that_took_their_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The row's own attempt (a record a restart restored from its checkpoint keeps the
    attempt that ran it); a row without one (a checkpoint's of an older gradsync) is this
    process's."""
    row = [3.0, 100.0, 0.5, 0.5, 4.0, 10.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert len(row) == len(_COLUMNS)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert _record(1, row).attempt == 1 and _record(1, row).step == 3
    legacy = row[:-1]
    assert _record(1, legacy).attempt == 2
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert _record(0, legacy).attempt == 0


def test_records_no_gather_took_get_their_idle_from_every_rank(tmp_path: Path) -> None:
    """Each rank writes alone the records no gather took (a script that never calls report()):
    idle 0 at a barrier, no comm. Read back, they get both from every rank's compute, as a
    gather gives them (a front-door port's summary said comm 0, idle 0, barrier tax 0%); a
    gathered record keeps what its gather gave it."""

    def own(rank: int, step: int, compute: float, gathered: bool = False) -> StepRecord:
        return StepRecord(
            rank, step, 100.0 + step, compute, 0.5, idle=0.0, comm=0.0, samples=8, bytes=8,
            gathered=gathered,
        )  # fmt: skip

    gathered = own(0, 0, 0.1, gathered=True)
    gathered.idle, gathered.comm = 0.25, 0.25
    written = [gathered, own(0, 1, 0.1), own(1, 1, 0.4), own(0, 2, 0.3), own(1, 2, 0.2)]
    write_records(tmp_path / METRICS_FILE, written)
    assert '"gathered":false' in (tmp_path / METRICS_FILE).read_text()
    read = {(r.rank, r.step): r for r in read_records(tmp_path)}
    assert (read[0, 0].idle, read[0, 0].comm) == (0.25, 0.25)
    assert read[0, 1].idle == pytest.approx(0.3) and read[0, 1].comm == pytest.approx(0.2)
    assert (read[1, 1].idle, read[1, 1].comm) == (0.0, 0.5)
    assert read[1, 2].idle == pytest.approx(0.1) and read[0, 2].idle == 0.0


def test_a_full_disk_names_the_file_it_could_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write's error names no file: a rank failed with "OSError: [Errno 28] No space left on
    device" alone (the checkpoint tester's, on a full tmpfs), which left the file to guess."""
    import builtins
    import errno

    from gradsync.telemetry import records

    class _Full:
        def __init__(self, fh: Any) -> None:
            self.fh = fh

        def __enter__(self) -> _Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self.fh.close()

        def fileno(self) -> int:
            return int(self.fh.fileno())

        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    real_open = builtins.open
    monkeypatch.setattr(records, "open", lambda *a, **k: _Full(real_open(*a, **k)), raising=False)
    path = tmp_path / METRICS_FILE
    with pytest.raises(OSError, match=r"No space left on device: '.*metrics\.jsonl'"):
        write_records(path, synthetic_records(1, 1, bytes_per_step=BYTES, seed=1))
