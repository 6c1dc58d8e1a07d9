"""Two DDP scripts and their gradsync ports (examples/ddp_lm.py and examples/ddp_vision.py, each
with a ``_gradsync`` twin): the port changes few lines. Both run and compared:
tests/e2e/test_ddp_port.py."""

from __future__ import annotations

import difflib

import pytest

from tests.support.ddp_port import RUNS, pair

pytestmark = pytest.mark.unit
HEADER = 2  # each file's first two lines name the file itself: its command and docstring


def changed_lines(name: str) -> tuple[int, int]:
    """(lines of the DDP script the port removes or rewrites, lines it adds), headers aside."""
    original, port = pair(name)
    a = original.read_text().splitlines()[HEADER:]
    b = port.read_text().splitlines()[HEADER:]
    diff = list(difflib.unified_diff(a, b, lineterm="", n=0))[2:]
    removed = sum(1 for line in diff if line.startswith("-"))
    added = sum(1 for line in diff if line.startswith("+"))
    return removed, added


@pytest.mark.parametrize("name", RUNS)
def test_the_port_changes_at_most_15_lines_of_the_ddp_script(name: str) -> None:
    removed, added = changed_lines(name)
    assert removed <= 15 and added <= 15, (removed, added)
    for script in pair(name):
        assert (
            script.read_text()
            .splitlines()[0]
            .startswith(f"# torchrun --standalone --nproc_per_node=2 examples/{script.name}")
        )
