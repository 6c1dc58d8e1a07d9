"""``benchmarks.store_calls`` in its quick mode, so that it cannot rot unseen: it runs, writes its
section and leaves the thread count as it was (the full run: BENCHMARKS.md, store_calls)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import store_calls
from tests.support.bench_sections import quick_section

pytestmark = pytest.mark.unit


def test_the_quick_run_writes_its_section(tmp_path: Path) -> None:
    section = quick_section(store_calls.main, "store_calls", tmp_path)
    rows = [r for r in section.splitlines() if r.startswith("| ") and "us per" not in r]
    assert len(rows) == 5, rows
