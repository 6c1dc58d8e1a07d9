"""A benchmark's quick mode run into a BENCHMARKS.md of a test's own, for the tests that keep
each benchmark from rotting unseen (``tests/unit/test_*_bench.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

#: another benchmark's section, which a benchmark's ``--write`` must leave as it is
OTHER_SECTION = "<!-- other:start -->\nkept\n<!-- other:end -->"


def quick_section(main: Callable[[list[str]], object], name: str, tmp_path: Path) -> str:
    """Run ``benchmarks.<name>``'s ``main`` with ``--quick --write`` into a BENCHMARKS.md that
    holds another section; check that the other section is kept, the thread count is left as it
    was and the command is named; return the benchmark's own section."""
    md = tmp_path / "BENCHMARKS.md"
    md.write_text(f"# Benchmarks\n\n{OTHER_SECTION}\n")
    threads = torch.get_num_threads()
    main(["--quick", "--write", "--md", str(md)])
    assert torch.get_num_threads() == threads
    text = md.read_text()
    assert OTHER_SECTION in text
    section = text.split(f"<!-- {name}:start -->")[1].split(f"<!-- {name}:end -->")[0]
    assert f"Command: `python -m benchmarks.{name} --quick --write`" in section
    return section
