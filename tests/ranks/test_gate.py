"""Timeouts that bound only gradsync's own waits (the step gate, gradsync.checks.gate), and a
block that raises on one rank: every rank skips that step together and stays in step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gradsync.testing import RankFailure, run_ranks
from tests.support import gate_ranks
from tests.support.overlap import Overlapped, overlapped, ranks

pytestmark = pytest.mark.ranks

GROUP_TIMEOUT_S = 30  # the process group's own, which the user's collectives keep
#: the strategies rank 0's long evaluation runs under, a launch each (their waits overlap)
LONG_EVALUATION = ("bsp", "local:2")


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Overlapped]:
    """This file's launches that mostly wait (an evaluation past the timeout under each
    strategy, a stopped rank's timeout, a peer's silence), started at once so that the waits
    overlap (tests/support/overlap.py); each test below reads its own."""
    long_evaluations = {
        f"long evaluation {strategy}": ranks(
            gate_ranks.long_evaluation_each,
            2,
            [strategy],
            collective_timeout_s=GROUP_TIMEOUT_S,
            timeout_s=140,
        )
        for strategy in LONG_EVALUATION
    }
    with overlapped(
        {
            **long_evaluations,
            "frozen": ranks(
                gate_ranks.frozen_between_steps,
                3,
                collective_timeout_s=GROUP_TIMEOUT_S,
                timeout_s=90,
            ),
            "uncaught": ranks(gate_ranks.raises_uncaught, 2, timeout_s=90, allow_failures=True),
            "raise while stopped": ranks(
                gate_ranks.raises_while_peer_stopped,
                2,
                collective_timeout_s=GROUP_TIMEOUT_S,
                timeout_s=80,
            ),
            "save on rank 0": ranks(
                gate_ranks.save_on_rank_0_only,
                2,
                str(tmp_path_factory.mktemp("save-on-rank-0")),
                collective_timeout_s=GROUP_TIMEOUT_S,
                timeout_s=90,
            ),
        }
    ) as out:
        yield out


@pytest.mark.timeout(150)
def test_a_long_evaluation_on_rank_0_is_not_cut_short(launched: Overlapped) -> None:
    for strategy in LONG_EVALUATION:
        by_rank = launched.result(f"long evaluation {strategy}")
        r0, r1 = (out[strategy] for out in by_rank)
        assert r0["steps"] == r1["steps"] == 6
        assert torch.equal(r0["params"], r1["params"]), strategy


@pytest.mark.timeout(120)
def test_a_rank_that_stops_responding_between_steps_is_named_within_the_timeout(
    launched: Overlapped,
) -> None:
    r0, r1, r2 = launched.result("frozen")
    assert r2 == {"stayed_away": True}
    for r in (r0, r1):
        assert r["error"] is not None
        assert r["error"].startswith("step 3: the step (waiting"), r["error"]
        assert "never arrived: ranks [2]" in r["error"], r["error"]
        assert "Rank 2 stopped responding" in r["error"], r["error"]
        assert "between steps 2 and 3" in r["error"], r["error"]
        # its second in its own code, the heartbeat's silence, then the timeout: not 1800 s
        assert r["waited"] < gate_ranks.TIMEOUT_S + 8, r


@pytest.mark.timeout(90)
def test_a_block_that_raises_at_an_exchange_step_still_waits_at_the_gate(
    launched: Overlapped,
) -> None:
    r0, r1 = launched.result("raise while stopped")
    assert r0 == {"stayed_away": True}
    (note,) = r1["notes"]
    assert "could not be completed for the other ranks" in note, note
    assert "Rank 0 stopped responding" in note, note
    assert r1["waited"] < GROUP_TIMEOUT_S / 2, r1  # the gate's bound, not the group's


@pytest.mark.timeout(150)
def test_a_block_that_raises_on_one_rank_is_skipped_by_every_rank() -> None:
    by_rank = run_ranks(gate_ranks.raises_in_block_each_way, 2, timeout_s=140)
    for strategy, where in gate_ranks.RAISES:
        r0, r1 = (out[(strategy, where)] for out in by_rank)
        assert r1["caught"] == [3]
        assert r0["steps"] == r1["steps"] == 6  # in step: the abandoned step counts everywhere
        assert torch.equal(r0["params"], r1["params"]), (strategy, where)
        if strategy == "bsp" and where == "before backward":
            # Its buckets went out as NaN: rank 0 skipped the same step and was told why.
            assert r0["skipped"] == [3]
            assert r0["reasons"] == ["rank 1's step 3 block raised Boom: bad batch"]
        if strategy == "bsp" and where.startswith("after backward"):
            # Every bucket's gradients were final, in flight or (rank 0 late) held back for the
            # gate: the step completed on every rank, rank 1 included.
            assert r0["skipped"] == [], (where, r0["skipped"])


@pytest.mark.timeout(120)
def test_an_uncaught_exception_in_a_block_fails_the_peers_within_seconds(
    launched: Overlapped,
) -> None:
    r0, r1 = launched.result("uncaught")
    assert isinstance(r1, RankFailure) and "Boom: bad batch" in str(r1)
    assert r0["error"] is not None
    assert r0["error"].startswith("step 4: the step (waiting"), r0["error"]
    assert "Rank 1's step 3 block raised Boom: bad batch" in r0["error"], r0["error"]
    assert r0["waited"] < 15, r0  # the heartbeat's silence, not the 60 s timeout


@pytest.mark.timeout(120)
def test_ranks_in_different_collectives_say_where_each_one_is(launched: Overlapped) -> None:
    r0, r1 = launched.result("save on rank 0")
    assert r0["error"] is not None and r1["error"] is not None
    assert r0["error"].startswith("step 2: sync.save() (waiting"), r0["error"]
    assert "Rank 1 is waiting to begin the step (step 2)" in r0["error"], r0["error"]
    assert r1["error"].startswith("step 2: the step (waiting"), r1["error"]
    assert "Rank 0 is waiting to begin sync.save() (step 2)" in r1["error"], r1["error"]
