"""Live membership's records under a periodic strategy (``local:H``, ``diloco:H``), without a
quorum: one quorum a period, joined before the period's first step and deciding its average
at the last. What ``TorchftMembership`` hands ``membership.jsonl`` (the step whose average a
quorum decided, the step it was joined before, the final average after the last step), and
what the summary then says: a loss, a stall and a healing at the step they happened at, the
step ``faults/healed.jsonl`` names (was: the loss at the period's last step, after a healing
at its first; and the final average at the step ``END``, 2**62)."""

from __future__ import annotations

from typing import Any

import pytest

from gradsync.checks.diagnose import END
from gradsync.membership import StepQuorum
from gradsync.membership.ft_manager import TorchftMembership
from gradsync.telemetry.membership import GroupMembership, MembershipLog, describe, summarize

pytestmark = pytest.mark.unit

A, B, B2 = "0:aaaa", "1:bbbb", "1:cccc"  # group 1's replacement is a new replica id


class _Manager:
    """torchft's Manager as ``start_step`` and ``commit`` use it; ``heal_to``: the step of the
    peer state the next quorum heals this replica with (as torchft calls ``_heal``)."""

    def __init__(self, membership: TorchftMembership) -> None:
        self.membership = membership
        self.heal_to: int | None = None
        self.state = {"step": 0, "batches_committed": 0}

    def state_dict(self) -> dict[str, int]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = dict(state)

    def start_quorum(self) -> None:
        if self.heal_to is not None:
            self.membership._healed = (self.heal_to, 4096)
            self.heal_to = None

    def should_commit(self) -> bool:
        return True

    def num_participants(self) -> int:
        return 2


def _membership() -> tuple[TorchftMembership, _Manager, list[StepQuorum]]:
    """A TorchftMembership over ``_Manager``, its quorums' records in the list."""
    recorded: list[StepQuorum] = []
    membership = object.__new__(TorchftMembership)
    manager = _Manager(membership)
    membership.manager = manager  # type: ignore[assignment]
    membership._align_after_quorum = False
    membership._seen = None
    membership._replica_id = B2
    membership._name = "replica group 1"
    membership._on_healed = None
    membership._on_step = recorded.append
    membership._quorum = None
    membership._healed = None
    membership._first_quorum = True
    membership._last_step = 0
    membership._group = None  # a world of one: its rank 0 says a healing
    membership._min_replicas, membership._warned_small = 1, False
    membership._committed_steps, membership._met_a_peer = 0, False
    return membership, manager, recorded


@pytest.mark.timeout(60)
def test_a_periodic_quorum_is_recorded_at_its_average_saying_where_it_was_joined() -> None:
    # local:4, a replacement: its first quorum, joined at its own step 0, heals it to its
    # peer's step 16; the period's average is decided at 19
    membership, manager, recorded = _membership()
    manager.heal_to = 16
    membership.start_step(0)
    membership.commit(19)
    membership.start_step(20)
    membership.commit(23)
    assert [(q.step, q.joined_at, q.healed_bytes) for q in recorded] == [
        (19, 16, 4096),
        (23, 20, None),
    ]
    # bsp: joined and decided at the same step, which the line says once
    membership.start_step(24)
    membership.commit(24)
    assert (recorded[-1].step, recorded[-1].joined_at, recorded[-1].final) == (24, None, False)


@pytest.mark.timeout(60)
def test_the_final_average_is_recorded_at_a_step_and_said_final() -> None:
    # local:4 over 30 steps: the last period's quorum joined at 28, its average decided in
    # report() (at END) after step 29
    membership, _, recorded = _membership()
    membership.start_step(24)
    membership.commit(27)
    membership.start_step(28)
    membership.commit(END)
    assert [(q.step, q.joined_at, q.final) for q in recorded] == [
        (27, 24, False),
        (28, None, True),
    ]
    # streaming DiLoCo: the final average's quorum joined for it (none was open), after an
    # exchange applied at the run's end (step 30)
    membership, _, recorded = _membership()
    membership.start_step(28)
    membership.commit(30)
    membership.start_step(END)
    membership.commit(END)
    assert [(q.step, q.joined_at, q.final) for q in recorded] == [
        (30, 28, False),
        (30, None, True),
    ]
    lines = [_write(MembershipLog(None, restart=0), q) for q in recorded]
    assert all(line["step"] < 2**31 for line in lines), lines
    assert [line.get("final") for line in lines] == [None, True]
    assert [line.get("joined_at") for line in lines] == [28, None]


def _write(log: MembershipLog, quorum: StepQuorum, **kw: Any) -> dict[str, Any]:
    """A line as ``AttachedRun.quorum`` writes it: every field of the quorum."""
    fields = {name: getattr(quorum, name) for name in quorum.__slots__}  # type: ignore[attr-defined]
    return log.write(**{**fields, **kw})


def _period(
    log: MembershipLog, joined: int, members: list[str], quorum_id: int, **kw: Any
) -> dict[str, Any]:
    """local:4's quorum joined at ``joined``, its average decided 3 steps later."""
    quorum = StepQuorum(
        step=joined + 3,
        time=1000.0 + joined,
        quorum_s=kw.pop("quorum_s", 0.01),
        quorum_id=quorum_id,
        participants=len(members),
        members=members,
        committed=kw.pop("committed", True),
        joined_at=joined,
    )
    return _write(log, quorum, **kw)


@pytest.mark.timeout(60)
def test_the_summary_tells_a_periodic_loss_stall_and_healing_at_the_step_they_happened() -> None:
    # local:4, min_replicas 1: group 1 killed at step 13; group 0's period 12-15 is not
    # committed at 15, and its quorum joined at 16 waits 1.5 s for the replacement, which
    # heals there (faults/healed.jsonl: step 16)
    log0 = MembershipLog(None, restart=0, pid=100)
    survivor = [_period(log0, j, [A, B], 1) for j in (0, 4, 8)]
    survivor.append(_period(log0, 12, [A, B], 1, committed=False))
    survivor.append(_period(log0, 16, [A, B2], 2, quorum_s=1.51))
    log1, log1b = MembershipLog(None, restart=0, pid=101), MembershipLog(None, restart=1, pid=102)
    lost = [_period(log1, j, [A, B], 1) for j in (0, 4, 8)]
    lost.append(_period(log1b, 16, [A, B2], 2, healed_bytes=4096, replica_id=B2))
    healed = [
        {"step": 0, "bytes": 10, "seconds": 0.1, "restart": 0, "pid": 101, "time": 1000.1},
        {"step": 16, "bytes": 4096, "seconds": 1.0, "restart": 1, "pid": 102, "time": 1017.0},
    ]
    section = summarize(
        [GroupMembership("0", survivor), GroupMembership("1", lost, healed)], expected=2
    )
    assert [(f["group"], f["step"]) for f in section["failures"]] == [("1", 16)]
    assert [h["step"] for h in section["healings"]["at"]] == [16]
    assert section["healings"]["initial_syncs"] == 1
    assert (section["max_stall"]["step"], section["not_committed_at"]) == (16, "15")
    said = describe(section)
    assert "lost group 1 at step 16 (seen by group 0)" in said, said
    assert "(group 0, step 16); not committed: step(s) 15" in said, said


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("restart", "heal_to", "said"),
    [
        ("0", 0, "replica group 1 started from a live peer's weights, the first quorum's"),
        ("1", 0, "replica group 1 healed from a live peer: at step 0"),  # a replacement
        ("0", 16, "replica group 1 healed from a live peer: at step 16"),  # a resume behind
    ],
)
def test_the_first_quorum_s_sync_is_said_apart_from_a_healing(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    restart: str,
    heal_to: int,
    said: str,
) -> None:
    """Groups that start together take one replica's weights at their first quorum: the run's
    report counts that an initial sync, not a healing, and so does the line on stderr (it said
    "healed from a live peer: at step 0" beside a summary of 0 healings)."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    membership, manager, _ = _membership()
    manager.heal_to = heal_to
    with caplog.at_level("INFO", logger="gradsync.membership"):
        membership.start_step(0)
        manager.heal_to = 24
        membership.start_step(24)  # a later quorum's: a healing whatever came before
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith(said), lines
    assert lines[1].startswith("replica group 1 healed from a live peer: at step 24"), lines


@pytest.mark.timeout(60)
def test_each_quorum_is_asked_at_the_synchronizers_step_not_the_managers_count() -> None:
    """torchft heals the replicas below a quorum's highest step. Its Manager counts committed
    quorums, one a period under local:H, so a replacement that loaded a checkpoint of step 15
    looked further than a survivor at step 17 (count 8), which healed from it and went back.
    Every quorum is now asked at the Synchronizer's step, on every replica alike."""
    membership, manager, _ = _membership()
    manager.state = {"step": 8, "batches_committed": 16}
    membership.start_step(18)
    assert manager.state == {"step": 18, "batches_committed": 16}
