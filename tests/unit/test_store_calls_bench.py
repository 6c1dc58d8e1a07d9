"""``benchmarks.store_calls`` in its quick mode, so that it cannot rot unseen: it runs, writes its
section and leaves the thread count as it was (the full run: BENCHMARKS.md, store_calls)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import store_calls

pytestmark = pytest.mark.unit


def test_the_quick_run_writes_its_section(tmp_path: Path) -> None:
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    threads = torch.get_num_threads()
    store_calls.main(["--quick", "--write", "--md", str(md)])
    assert torch.get_num_threads() == threads
    text = md.read_text()
    assert "<!-- other:start -->\nkept\n<!-- other:end -->" in text
    section = text.split("<!-- store_calls:start -->")[1].split("<!-- store_calls:end -->")[0]
    assert "Command: `python -m benchmarks.store_calls --quick --write`" in section
    rows = [r for r in section.splitlines() if r.startswith("| ") and "us per" not in r]
    assert len(rows) == 5, rows
