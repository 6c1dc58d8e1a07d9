"""Telemetry of a run restarted by the elastic agent: every completed step once, the latest
attempt's record where a step ran twice, and report.json with the straggler findings."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.checkpoint.store import CheckpointStore
from gradsync.config import RunConfig
from gradsync.telemetry.records import METRICS_FILE, read_records, write_records
from gradsync.telemetry.report import RunReport
from gradsync.telemetry.stragglers import synthetic_records
from gradsync.worker import _drop_records_from, _write_report

STEPS, RANKS, BYTES = 40, 2, 1000


def _attempts(tmp: Path, killed_at: int, resumed_at: int) -> Path:
    """metrics.jsonl as two attempts append it: the first ran steps 0..killed_at-1, the second
    (bytes doubled, to tell them apart) steps resumed_at..STEPS-1."""
    first = synthetic_records(STEPS, RANKS, bytes_per_step=BYTES, seed=1)
    second = synthetic_records(STEPS, RANKS, bytes_per_step=2 * BYTES, seed=2)
    write_records(tmp / METRICS_FILE, [r for r in first if r.step < killed_at])
    write_records(tmp / METRICS_FILE, [r for r in second if r.step >= resumed_at])
    return tmp


@pytest.mark.unit
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


@pytest.mark.unit
def test_report_json_covers_every_attempt_and_names_the_stragglers(tmp_path: Path) -> None:
    recs = synthetic_records(120, 4, slow=[(2, 40, 119, 2.0)], bytes_per_step=BYTES, seed=3)
    write_records(tmp_path / METRICS_FILE, recs)
    write_records(tmp_path / METRICS_FILE, [r for r in recs if r.step >= 100])  # a rerun
    cfg = RunConfig(workload="mlp", nproc=4, out=str(tmp_path))
    # This attempt's own report holds only its steps since the resume point.
    own = RunReport.from_records([r for r in recs if r.step >= 100])
    result = _write_report(tmp_path, cfg, own)
    data = json.loads((tmp_path / "report.json").read_text())
    assert result["steps"] == data["steps"] == 120
    assert [r["steps"] for r in data["ranks"]] == [120] * 4
    assert [(f["rank"], f["first_step"]) for f in data["stragglers"]] == [(2, 40)]
    assert data["straggler_window"] == cfg.straggler_window and len(data["scores"]) == 4


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_restarted_run_reports_every_step_once(tmp_path: Path) -> None:
    # Checkpoints every 3 steps, telemetry gathered every 10: at the kill (step 17) the restart
    # resumes from step 15 (or 12, if the background write of 15 was not complete yet); steps
    # 10..14 (10..11) come before it, were never gathered and never run again: their records
    # can only come back with the checkpoint.
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync.cli", "run", "--workload", "mlp", "--nproc", "2"]
        + ["--steps", "30", "--checkpoint-every", "3", "--kill", "1:17", "--max-restarts", "1"]
        + ["--no-plots", "--no-progress", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"restart: resuming at step (15|12)\b", proc.stderr), proc.stderr[-3000:]
    lines = (out / METRICS_FILE).read_text().splitlines()
    keys = [(d["rank"], d["step"]) for d in map(json.loads, lines)]
    assert sorted(keys) == [(rank, step) for rank in range(2) for step in range(30)]
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 30 and [r["steps"] for r in report["ranks"]] == [30, 30]
    per_step = {d["bytes"] for d in map(json.loads, lines)}
    assert len(per_step) == 1 and [r["bytes"] for r in report["ranks"]] == [30 * per_step.pop()] * 2
    # Present; not asserted empty: on a loaded machine the restart's catch-up can make one
    # rank genuinely slower for a window, which the detector rightly reports.
    assert isinstance(report["stragglers"], list)
    # The checkpoint records its compressor, which a --resume with another one is refused by.
    store = CheckpointStore(out / "checkpoints")
    newest = store.latest()
    assert newest is not None and store.load(newest, 0)["compression"] == "none"


def _resized(rank: int, world: int, directory: str, resume: bool) -> list[tuple[int, int, int]]:
    """3 steps on 2 ranks, each step's record naming its rank by its sample count (10 + rank),
    saved with the records not gathered yet (periodic gathers every 4 steps); or the resume of
    that on 3 ranks followed by 6 steps, across periodic gathers: the new rank restored no
    records, so gathers scheduled by each rank's pending count alone would come after
    different steps on different ranks (a hang)."""
    import gradsync as gs
    from tests import zero_ranks as zr

    w = zr._workload()
    model = w.build_model()
    sync = gs.Synchronizer(model, zr.make_optimizer("sgd", model), telemetry_every=4, timeout_s=20)
    steps = range(3)
    if resume:
        assert sync.load(directory) is not None
        steps = range(3, 9)
    for step in steps:
        with sync.step(samples=10 + rank):
            w.loss(model, *zr._batch(w, step, rank, world)).backward()
    if not resume:
        sync.save(directory)
    sync.report()  # gathers the records, the restored ones included
    sync.close()
    assert sorted({r.step for r in sync._collector.records}) == list(range(9 if resume else 3))
    return sorted((r.rank, r.step, r.samples) for r in sync._collector.records if r.step < 3)


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_a_resume_on_more_ranks_restores_each_ranks_own_records(tmp_path: Path) -> None:
    """Rank 1 gets its own records of the steps before the checkpoint back, not rank 0's; the
    new rank 2, which never ran them, gets none; the periodic gathers after it stay in step."""
    from gradsync.testing import run_ranks

    run_ranks(_resized, 2, str(tmp_path), False, timeout_s=90)
    resumed = run_ranks(_resized, 3, str(tmp_path), True, timeout_s=90)
    expected = [(rank, step, 10 + rank) for rank in range(2) for step in range(3)]
    assert resumed[0] == expected


@pytest.mark.unit
def test_a_resume_leaves_each_earlier_step_once_in_the_raw_file(tmp_path: Path) -> None:
    # Steps 0-9 gathered before the failure; the checkpoint resumed from (step 8) held the
    # records of steps 6 and 7 not gathered when it was taken, which load() writes again.
    path = tmp_path / METRICS_FILE
    records = synthetic_records(10, RANKS, bytes_per_step=BYTES, seed=3)
    write_records(path, records + [r for r in records if r.step in (6, 7)])
    _drop_records_from(path, 8)
    keys = [(d["rank"], d["step"]) for d in map(json.loads, path.read_text().splitlines())]
    assert sorted(keys) == [(rank, step) for rank in range(2) for step in range(8)]
    assert len(keys) == len(set(keys))


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("one_rank")
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


def _torn(path: Path) -> str:
    """Cut ``path``'s last line in the middle, as a full disk or a crash mid-write leaves it;
    the line as it was."""
    text = path.read_text()
    last = text.splitlines()[-1]
    path.write_text(text[: len(text) - len(last) // 2 - 1])  # no newline after it
    return last


@pytest.mark.unit
def test_a_torn_last_line_is_dropped_with_a_warning_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    write_records(path, synthetic_records(10, RANKS, bytes_per_step=BYTES, seed=3))
    torn = json.loads(_torn(path))
    for read in (lambda: read_records(tmp_path), lambda: _drop_records_from(path, 10)):
        with pytest.warns(RuntimeWarning, match=rf"{re.escape(str(path))}: .*\(line 20\)"):
            read()
    # the resume's rewrite of the file leaves every whole line, and none torn
    keys = [(d["rank"], d["step"]) for d in map(json.loads, path.read_text().splitlines())]
    assert len(keys) == 2 * 10 - 1 and (torn["rank"], torn["step"]) not in keys


@pytest.mark.unit
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
        _drop_records_from(path, 10)
    assert path.read_text() == "".join(lines)  # left for the user to look at


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_resume_after_a_torn_metrics_line_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "run"
    flags = ["--workload", "mlp", "--params", "20000", "--nproc", "1", "--out", str(out)]
    flags += ["--checkpoint-every", "5", "--no-plots", "--no-progress"]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "gradsync.cli", "run", *flags, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180)

    first = run("--steps", "10")
    assert first.returncode == 0, first.stderr[-3000:]
    torn = json.loads(_torn(out / METRICS_FILE))
    more = run("--steps", "14", "--resume")
    assert more.returncode == 0, more.stderr[-3000:]
    notice = [line for line in more.stderr.splitlines() if "dropped its last line" in line]
    assert len(notice) == 1 and str(out / METRICS_FILE) in notice[0], more.stderr[-3000:]
    assert notice[0].startswith("gradsync: "), notice[0]
    steps = [d["step"] for d in map(json.loads, (out / METRICS_FILE).read_text().splitlines())]
    assert sorted(steps) == [s for s in range(14) if s != torn["step"]]
    assert json.loads((out / "report.json").read_text())["steps"] == 13
