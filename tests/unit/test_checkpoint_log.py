"""``gradsync run``'s CHECKPOINTS/log.jsonl: a JSON line per save, flushed once a second and
at the end rather than per line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.runner.train import _CheckpointLog

pytestmark = pytest.mark.unit


def test_every_save_is_a_json_line_once_closed(tmp_path: Path) -> None:
    log = _CheckpointLog(tmp_path / "checkpoints")
    for step in range(1, 201):
        log.write(step, step * 1.25e-4)
    log.close()
    lines = [
        json.loads(x) for x in (tmp_path / "checkpoints" / "log.jsonl").read_text().splitlines()
    ]
    assert [x["step"] for x in lines] == list(range(1, 201))
    assert lines[7]["seconds"] == 8 * 1.25e-4 and all(x["time"] > 0 for x in lines)


def test_lines_reach_the_file_within_a_second_not_per_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr("gradsync.runner.train.time.time", lambda: now[0])
    log = _CheckpointLog(tmp_path)
    path = tmp_path / "log.jsonl"
    log.write(1, 0.001)  # the first line goes out at once
    assert len(path.read_text().splitlines()) == 1
    for step in range(2, 6):
        now[0] += 0.1
        log.write(step, 0.001)
    assert len(path.read_text().splitlines()) == 1  # held: a system call per save saved
    now[0] += 1.0
    log.write(6, 0.001)
    assert len(path.read_text().splitlines()) == 6
    log.close()
