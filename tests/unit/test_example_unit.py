"""The example says how it runs in its first line: under plain torchrun, not gradsync's
launcher (run so: tests/e2e/test_example.py)."""

from __future__ import annotations

import pytest

from tests.support.torchrun import ROOT

pytestmark = pytest.mark.unit

EXAMPLE = ROOT / "examples" / "train_charlm.py"


def test_example_opens_with_the_command_this_test_runs() -> None:
    first = EXAMPLE.read_text().splitlines()[0]
    assert (
        first == "# torchrun --standalone --nproc_per_node=4 examples/train_charlm.py --steps 100"
    )
