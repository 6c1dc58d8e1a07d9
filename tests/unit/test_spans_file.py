"""``spans.jsonl`` as each rank appends to it: a resume drops the spans of the steps it runs
again (``drop_steps_from``), under the lock the appends take."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync.telemetry.records import Span, drop_steps_from, read_spans, write_records

pytestmark = pytest.mark.unit


def test_a_resume_keeps_the_spans_of_the_steps_before_it_only(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    write_records(path, [Span(r, s, "compute", 100.0 + s, 0.01) for r in (0, 1) for s in range(6)])
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('{"rank": 1, "step": 2, "na')  # a killed rank's torn last line
    drop_steps_from(path, 4)
    kept = read_spans(path)
    assert sorted((s.rank, s.step) for s in kept) == [(r, s) for r in (0, 1) for s in range(4)]
    write_records(path, [Span(0, 4, "compute", 104.0, 0.01)])  # the resumed run appends on
    assert [(s.rank, s.step) for s in read_spans(path)][-1] == (0, 4)


def test_no_spans_file_is_nothing_to_drop(tmp_path: Path) -> None:
    drop_steps_from(tmp_path / "spans.jsonl", 3)
    assert not (tmp_path / "spans.jsonl").exists()
