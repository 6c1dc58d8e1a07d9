"""The load balancer's arithmetic: an exact, deterministic split that moves toward speed. The
guards on real gloo ranks: tests/ranks/test_guards.py."""

from __future__ import annotations

import pytest

from gradsync.balance import ShardBalancer, split
from gradsync.telemetry.records import StepRecord

pytestmark = pytest.mark.unit


def test_split_is_exact_and_deterministic() -> None:
    assert split(16, [1, 3]) == [4, 12]
    assert split(10, [1, 1, 1]) == [4, 3, 3]
    assert sum(split(1000, [0.1, 0.7, 0.2])) == 1000
    assert min(split(3, [1e-9, 1, 1])) == 1  # every rank keeps at least one sample
    with pytest.raises(ValueError, match="cannot give each of 3 ranks"):
        split(2, [1, 1, 1])


def test_balancer_moves_toward_speed() -> None:
    b = ShardBalancer(2, damping=0.0)
    recs = [
        StepRecord(r, s, 0.0, 0.01 * (3 if r == 1 else 1) * 8, 0.0, 0.0, 0.0, 8, 0)
        for s in range(4)
        for r in (0, 1)
    ]
    b.observe(recs)
    assert b.shares == pytest.approx([0.75, 0.25])
    assert b.sizes(64) == [48, 16]
