"""``benchmarks.guard_costs`` in its quick mode, so that it cannot rot unseen: it runs, writes its
section, leaves the thread count as it was, and its same-bits check refuses a new version that
does other work than the old (the full run: BENCHMARKS.md, guard_costs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from benchmarks import guard_costs
from tests.support.bench_sections import quick_section

pytestmark = pytest.mark.unit


def test_the_quick_run_writes_its_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # its git look-up starts a process, which a unit test may not
    monkeypatch.setattr(guard_costs, "guards_revision", lambda: "guards.py under test")
    section = quick_section(guard_costs.main, "guard_costs", tmp_path)
    assert "guards.py under test" in section
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) == len(guard_costs.OPERATIONS) * 2  # the quick mode's two sizes
    assert section.strip() in capsys.readouterr().out


def test_old_and_new_agree_bit_for_bit_and_a_different_new_is_refused() -> None:
    for op in guard_costs.OPERATIONS:
        assert guard_costs.check_same_bits(op, 257, seed=1) > 0

    def float_zero_if_(t: torch.Tensor, bad: torch.Tensor) -> None:
        t.mul_((~bad).to(t.dtype))  # NaN * 0 is NaN, not the +0.0 the old code wrote

    (zeroing,) = [op for op in guard_costs.OPERATIONS if op.function == "zero_if_"]
    with pytest.raises(AssertionError, match="zero_if_: old and new differ"):
        guard_costs.check_same_bits(dataclasses.replace(zeroing, new=float_zero_if_), 257, 1)
