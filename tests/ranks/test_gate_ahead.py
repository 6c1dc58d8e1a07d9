"""The step gate waited on its own thread from the block's entry and joined before gradsync's
first collective (gradsync.checks.gate_ahead): its round trips leave the training thread, and
what the gate guarantees holds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import gate_ahead_ranks
from tests.support.overlap import Overlapped, overlapped, ranks

pytestmark = pytest.mark.ranks

GROUP_TIMEOUT_S = 30  # the process group's own, which the user's collectives keep


#: gates in steps 4-9: every step's, or (issue 46) only the steps an exchange follows. local:H
#: is left out: it arms its gate through Periodic.gate_at, as diloco:H does (only the steps an
#: exchange follows differ, Periodic._exchanges_after, which every local:H test runs), so the
#: diloco:4:2:1 case covers its path (both failed alike with Periodic.gate_at returning None)
GATES = {"bsp": 6, "zero:2": 6, "diloco:4:2:1": 3}


@pytest.fixture(scope="module")
def launched() -> Iterator[Overlapped]:
    """This file's launches that mostly wait (a late rank's 3.2 s, an interrupted peer's 6 s),
    started at once so that the waits overlap (tests/support/overlap.py): each strategy's
    ``store_requests_per_step``, for both tests that read it, and the interrupt's."""
    launches = {
        strategy: ranks(
            gate_ahead_ranks.store_requests_per_step,
            2,
            strategy,
            collective_timeout_s=GROUP_TIMEOUT_S,
            timeout_s=140,
        )
        for strategy in GATES
    }
    launches["interrupt"] = ranks(
        gate_ahead_ranks.interrupted_while_a_peer_is_away, 2, timeout_s=140
    )
    launches["late"] = ranks(gate_ahead_ranks.backward_while_a_peer_is_late, 2, timeout_s=140)
    launches["late clip"] = ranks(gate_ahead_ranks.clip_while_a_peer_is_late, 2, timeout_s=140)
    with overlapped(launches) as out:
        yield out


@pytest.fixture(scope="module", params=list(GATES))
def counted(
    request: pytest.FixtureRequest, launched: Overlapped
) -> tuple[str, list[dict[str, Any]]]:
    """The strategy and each rank's result of its ``store_requests_per_step`` launch."""
    strategy = request.param
    return strategy, launched.result(strategy)


@pytest.mark.timeout(150)
def test_the_gate_waits_on_its_own_thread_and_a_late_rank_is_waited_for(
    counted: tuple[str, list[dict[str, Any]]],
) -> None:
    strategy, (r0, r1) = counted
    for r in (r0, r1):
        assert r["steps"] == 10
        # steps 4-9: the training thread asks the store nothing; the gate's thread does
        assert r["training"] == 0, r
        gates = GATES[strategy]
        assert r["gate"] >= 2 * gates, r
        # two requests a gate (issue 44): a set of its own key, which nothing answers, then a
        # wait for every rank's; a wait that outlasts arrive_after_s polls with check (and
        # reads beats: get)
        by = r["gate_by"]
        assert by.get("set") == gates and by.get("wait") == gates, r
        assert set(by) <= {"set", "wait", "check", "get"}, r
    if strategy != "diloco:4:2:1":  # streaming: replicas agree only after report()
        assert torch.equal(r0["params"], r1["params"])


@pytest.mark.timeout(120)
def test_the_gate_thread_ends_with_close(counted: tuple[str, list[dict[str, Any]]]) -> None:
    for r in counted[1]:
        assert r["threads"] == []


@pytest.mark.timeout(120)
def test_a_block_raising_before_the_first_collective_is_skipped_by_every_rank() -> None:
    r0, r1 = run_ranks(gate_ahead_ranks.loss_before_any_collective, 2, timeout_s=100)
    assert r0["skipped"] == r1["skipped"] == [False, True, False, False]
    assert r1["errors"] == ["a bad batch"] and r0["errors"] == []
    assert torch.equal(r0["params"], r1["params"])


@pytest.mark.timeout(150)
def test_a_keyboard_interrupt_leaves_the_block_without_waiting_out_the_gate(
    launched: Overlapped,
) -> None:
    """A Ctrl-C'd worker must end promptly: its peer, interrupted too, never comes to the
    gate, and the launcher kills what is left only after 30 s."""
    r0, _ = launched.result("interrupt")
    assert r0["left_after_s"] < 4, r0


@pytest.mark.timeout(150)
def test_the_backward_pass_goes_on_while_a_peer_is_late_to_the_gate(launched: Overlapped) -> None:
    """bsp: buckets ready before the gate opens are posted later (at a later gradient's hook or
    the block's end), not waited for in the hook: rank 0's backward at the step rank 1 is
    late for took a fraction of the delay (before, it stopped at its first bucket for all of
    it), its step still waited for the peer, and the replicas agree."""
    r0, r1 = launched.result("late")
    late = gate_ahead_ranks.LATE_S
    assert r0["buckets"] >= 2, r0["buckets"]
    assert r0["backward_s"][3] < late / 2, r0["backward_s"]
    assert r0["step_s"][3] > late / 2, r0["step_s"]  # the gate did wait for rank 1
    assert torch.equal(r0["params"], r1["params"])


@pytest.mark.timeout(150)
def test_a_clip_of_buckets_held_back_for_a_late_peer_is_refused_as_one_in_flight(
    launched: Overlapped,
) -> None:
    """A bucket held back until the gate opens is written by a clip inside the block before
    it is posted: refused as a write in flight is, on every rank, at that step (rank 0's were
    held back, rank 1's in flight), not summed as each rank's own clipped gradient."""
    for rank, out in enumerate(launched.result("late clip")):
        assert out["step"] == 2, (rank, out)
        assert "UsageError" in out["error"] and "changed in place" in out["error"], (rank, out)
