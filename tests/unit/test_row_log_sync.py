"""Step-record logs through the Synchronizer, under a barrier-free strategy (hogwild, one rank):
every checkpoint still in a directory keeps the rows it names, whatever happens between
saves (a gather, saves into another directory, another spelling of the path)."""

from __future__ import annotations

import gc
import os
import warnings
from pathlib import Path

import pytest

import gradsync as gs
from gradsync.checkpoint.row_log import log_path, read_rows
from gradsync.telemetry.timing import ROW_COLUMNS
from gradsync.workloads import make_workload

pytestmark = [
    pytest.mark.unit,
    pytest.mark.timeout(60),
    pytest.mark.usefixtures("one_rank", "inline_writer"),
]


def _sync() -> tuple[object, object, gs.Synchronizer]:
    w = make_workload("mlp", seed=1, params=2000)
    model = w.build_model()
    opt = w.make_optimizer(model, w.default_lr)
    return w, model, gs.Synchronizer(model, opt, strategy="hogwild", timeout_s=30)


def _steps(w: object, model: object, sync: gs.Synchronizer, n: int) -> None:
    for _ in range(n):
        s = sync.step_count
        with sync.step():
            x, y = w.batch(s, 8, 0, 8)  # type: ignore[attr-defined]
            w.loss(model, x, y).backward()  # type: ignore[attr-defined]


def _corrupt(directory: Path, step: int) -> None:
    path = directory / f"step-{step:06d}" / "rank-0.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _resumed_records(directory: Path) -> tuple[int, list[int], list[str]]:
    """The step a new Synchronizer resumes at from ``directory``, the steps whose records it
    restored (gathered by its report), and the warnings of its load."""
    _, _, sync = _sync()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            extra = sync.load(directory)
        steps = sorted(r.step for r in sync.report().records)
    finally:
        sync.close()
    assert extra is not None
    return extra["step"], steps, [str(c.message) for c in caught]


def test_a_gather_between_saves_keeps_the_rows_an_older_checkpoint_names(tmp_path: Path) -> None:
    w, model, sync = _sync()
    try:
        _steps(w, model, sync, 5)
        sync.save(tmp_path)
        _steps(w, model, sync, 2)
        assert [r.step for r in sync.flush_telemetry()] == list(range(7))
        _steps(w, model, sync, 3)
        sync.save(tmp_path)
    finally:
        sync.close()
    _corrupt(tmp_path, 10)  # the newest is lost: the resume falls back to step 5's
    resumed, steps, warned = _resumed_records(tmp_path)
    assert resumed == 5 and steps == list(range(5))
    assert not [m for m in warned if "row log" in m], warned


def test_saves_alternating_between_directories_append_only_their_new_rows(
    tmp_path: Path,
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    w, model, sync = _sync()
    converted = []
    rows_from = sync._collector.rows_from

    def counting(number: int) -> object:
        rows = rows_from(number)
        converted.append(rows.shape[0])
        return rows

    sync._collector.rows_from = counting  # type: ignore[method-assign]
    try:
        for i in range(20):
            _steps(w, model, sync, 1)
            sync.save(a if i % 2 else b, wait=False)
        sync.wait_for_checkpoints()
    finally:
        sync.close()
    assert sum(converted) == 20 + 19  # a's 20 rows and b's 19, each once
    # Each log holds every row once (header, then 80 bytes a row), not rewritten per save.
    for directory in (a, b):
        assert log_path(directory, 0).stat().st_size == 24 + 20 * ROW_COLUMNS * 8 - (
            ROW_COLUMNS * 8 if directory == b else 0
        )
    resumed, steps, _ = _resumed_records(a)
    assert resumed == 20 and steps == list(range(20))


def test_the_same_directory_spelled_otherwise_is_the_same_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "ck"
    w, model, sync = _sync()
    try:
        _steps(w, model, sync, 6)
        sync.save(directory)
    finally:
        sync.close()
    monkeypatch.chdir(tmp_path)
    w, model, sync = _sync()
    try:
        assert sync.load(directory.resolve()) is not None
        _steps(w, model, sync, 1)
        sync.save("ck", wait=False)  # relative: the log load() opened, not a new one
        sync.wait_for_checkpoints()
    finally:
        sync.close()
    assert read_rows(directory, 0, 6, 7, ROW_COLUMNS)[:, 0].tolist() == [6.0]
    assert log_path(directory, 0).stat().st_size == 24 + 7 * ROW_COLUMNS * 8


def _open_logs() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith(".rows"):
            found.append(target)
    return found


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_synchronizer_dropped_without_close_leaves_no_log_open(tmp_path: Path) -> None:
    w, model, sync = _sync()
    _steps(w, model, sync, 1)
    sync.save(tmp_path)
    assert _open_logs() == [str(log_path(tmp_path, 0))]
    sync._checkpoints.close_writer()  # the writer process is not what this is about
    sync._close()  # everything close() releases but the logs
    del sync, model
    gc.collect()
    assert _open_logs() == []
