"""Live membership's records without a quorum: ``membership.jsonl``'s lines as a process builds
them (``MembershipLog``), what report.json's ``membership`` section and the summary's line say
of a run's groups (``summarize``, ``describe``), what the trace shows, the run's report.json
over its group directories, and the seam that sees torchft's quorum results."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from gradsync.errors import UsageError
from gradsync.membership.ft_manager import _QuorumSeen
from gradsync.runner.config import RunConfig
from gradsync.runner.replica_groups import group_outcome, write_run_report
from gradsync.telemetry.cli import analyze_run
from gradsync.telemetry.membership import (
    MEMBERSHIP_FILE,
    GroupMembership,
    MembershipLog,
    describe,
    read_group,
    step_ranges,
    summarize,
)
from gradsync.telemetry.records import StepRecord
from gradsync.telemetry.trace import trace_events

pytestmark = pytest.mark.unit

A, B, B2 = "0:aaaa", "1:bbbb", "1:cccc"  # group 1's replacement is a new replica id


def _line(log: MembershipLog, step: int, quorum_id: int, members: list[str], **kw: Any) -> Any:
    seen = dict(
        step=step,
        time=1000.0 + step,
        quorum_s=0.01,
        quorum_id=quorum_id,
        participants=len(members),
        members=members,
        committed=True,
    )
    return log.write(**{**seen, **kw})


@pytest.mark.timeout(60)
def test_a_line_per_step_names_members_on_change_and_the_stall_against_the_normal(
    tmp_path: Path,
) -> None:
    log = MembershipLog(tmp_path / MEMBERSHIP_FILE, restart=0)
    first = _line(log, 0, 1, [A, B], quorum_s=0.5, healed_bytes=123)
    assert first["members"] == [A, B] and "left" not in first  # no earlier quorum here
    assert first["stall_s"] is None and first["healed_bytes"] == 123  # no normal yet
    for step in (1, 2, 3):
        same = _line(log, step, 1, [A, B], quorum_s=0.01)
        assert "members" not in same
    # the median of 0.5, 0.01, 0.01, 0.01 is 0.01: a 2.01 s quorum stalled 2 s
    lost = _line(log, 4, 2, [A], quorum_s=2.01)
    assert lost["left"] == [B] and lost["joined"] == [] and lost["participants"] == 1
    assert lost["stall_s"] == pytest.approx(2.0)
    back = _line(log, 5, 3, [A, B2], committed=False)
    assert (back["left"], back["joined"], back["committed"]) == ([], [B2], False)
    log.close()
    lines = [json.loads(x) for x in (tmp_path / MEMBERSHIP_FILE).read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3, 4, 5]
    assert read_group(tmp_path).entries == lines


def _group(
    name: str, *processes: list[dict[str, Any]], by_agent: bool = True, **files: Any
) -> GroupMembership:
    """A group's lines, process after process, built as a run builds them: each process a
    restart by the elastic agent (``by_agent``), or restart 0 with a pid of its own."""
    entries = []
    for k, lines in enumerate(processes):
        log = MembershipLog(None, restart=k if by_agent else 0, pid=100 + k)
        entries += [_line(log, **line) for line in lines]
    return GroupMembership(name, entries, files.get("healed", []), files.get("attempts", []))


def _steps(lo: int, hi: int, quorum_id: int, members: list[str], **kw: Any) -> list[dict]:
    return [dict(step=s, quorum_id=quorum_id, members=members, **kw) for s in range(lo, hi)]


def _lost_and_healed() -> list[GroupMembership]:
    """min_replicas 1: group 1 is lost at step 10, group 0 goes on alone (stalling 2 s at
    step 10, not committing it), and group 1's replacement heals at step 15."""
    survivor = _group(
        "0",
        _steps(0, 10, 1, [A, B])
        + _steps(10, 11, 2, [A], quorum_s=2.01, committed=False)
        + _steps(11, 15, 2, [A])
        + _steps(15, 20, 3, [A, B2]),
        attempts=[{"restart": 0}],
    )
    replaced = _group(
        "1",
        _steps(0, 10, 1, [A, B]),
        _steps(15, 20, 3, [A, B2]),
        healed=[
            {"step": 0, "bytes": 10, "seconds": 0.3, "restart": 0, "time": 1000.3},
            {"step": 15, "bytes": 2_000_000, "seconds": 1.5, "restart": 1, "time": 1016.5},
        ],
        attempts=[{"restart": 0}, {"restart": 1}],
    )
    return [survivor, replaced]


@pytest.mark.timeout(60)
def test_the_summary_names_the_loss_the_steps_short_of_members_the_healing_and_the_stall() -> None:
    section = summarize(_lost_and_healed(), expected=2)
    assert [q["id"] for q in section["quorums"]] == [1, 2, 3]
    assert [(q["step"], q["participants"]) for q in section["quorums"]] == [
        (0, 2),
        (10, 1),
        (15, 2),
    ]
    assert section["failures"] == [
        {"step": 10, "group": "1", "replica_id": B, "participants": 1, "seen_by": ["0"]}
    ]
    assert (section["steps_with_fewer_participants"], section["fewer_participants_at"]) == (
        5,
        "10-14",
    )
    assert (section["not_committed"], section["not_committed_at"]) == (1, "10")
    healings = section["healings"]
    assert (healings["count"], healings["bytes"], healings["seconds"]) == (1, 2_000_000, 1.5)
    assert healings["initial_syncs"] == 1  # restart 0's first quorum: not a replacement's
    assert section["max_stall"] == {"group": "0", "step": 10, "seconds": pytest.approx(2.0)}
    assert section["restarts"] == 1 and section["steps"] == 20
    assert describe(section) == (
        "membership: 3 quorums; lost group 1 at step 10 (seen by group 0); 5 of 20 steps with "
        "fewer than 2 participants (10-14); 1 healing (2.00 MB in 1.50 s); longest stall "
        "2.00 s (group 0, step 10); not committed: step(s) 10"
    )


@pytest.mark.timeout(60)
def test_a_run_without_a_loss_says_so() -> None:
    calm = [_group("0", _steps(0, 5, 1, [A, B])), _group("1", _steps(0, 5, 1, [A, B]))]
    section = summarize(calm)  # expected: the most participants any quorum had
    assert section["failures"] == [] and section["max_stall"] is None
    assert describe(section, exits=[0, 0]) == (
        "membership: 1 quorum; no group lost; 0 of 5 steps with fewer than 2 participants; "
        "0 healings (0.00 MB in 0.00 s); no stall over 0.1 s"
    )
    # without the groups' exits, only what the records show: no quorum saw a loss
    assert describe(section).startswith("membership: 1 quorum; no loss seen by a quorum; 0 of")


@pytest.mark.timeout(60)
def test_a_group_that_failed_unseen_is_not_said_to_be_no_loss() -> None:
    """Group 1's worker SIGKILLed with --max-restarts 0, and group 0 failed with it: no quorum
    was left to see group 1 go, so no line says it left; the exits say both failed."""
    both = [_group("0", _steps(0, 5, 1, [A, B])), _group("1", _steps(0, 4, 1, [A, B]))]
    section = summarize(both, expected=2)
    assert section["failures"] == []
    said = describe(section, exits=[1, -9])
    assert "no group lost" not in said, said
    assert said.startswith(
        "membership: 1 quorum; no loss seen by a quorum; group 0 exited 1; group 1 exited -9; "
        "0 of 5 steps with fewer than 2 participants; "
    ), said
    # a loss a quorum saw, and the lost group's exit beside it
    lost = describe(summarize(_lost_and_healed(), expected=2), exits=[0, 1])
    assert "; lost group 1 at step 10 (seen by group 0); group 1 exited 1; 5 of 20 " in lost


@pytest.mark.timeout(60)
def test_a_periodic_strategys_lines_are_counted_as_exchanges_not_steps() -> None:
    """A 30-step local:2 run: a line per period (15), at its last step, joined at its first:
    15 exchanges, not '15 steps'; the one with fewer participants named at its step."""
    periods = [dict(step=s + 1, joined_at=s, quorum_id=1, members=[A, B]) for s in range(0, 30, 2)]
    alone = [{**p, "members": [A]} if p["step"] == 9 else p for p in periods]
    groups = [_group("0", alone), _group("1", [p for p in periods if p["step"] != 9])]
    section = summarize(groups, expected=2)
    assert section["periodic"] is True and "steps" not in section
    assert (section["exchanges"], section["exchanges_with_fewer_participants"]) == (15, 1)
    said = describe(section, exits=[0, 0])
    assert "; 1 of 15 exchanges (one a period) with fewer than 2 participants (at step(s) 9); " in (
        said
    ), said
    # bsp's lines are steps: no joined_at
    flat = summarize([_group("0", _steps(0, 30, 1, [A, B]))], expected=2)
    assert flat["periodic"] is False and flat["steps"] == 30 and "exchanges" not in flat


@pytest.mark.timeout(60)
def test_a_replacement_started_by_hand_is_told_apart_by_its_pid_and_named_by_its_directory() -> (
    None
):
    # A script's own replica groups: no agent, so the replacement is restart 0 too; and no
    # REPLICA_GROUP_ID, so torchft's ids are bare UUIDs, each process saying which is its own.
    a, b, b2 = "aaaa-0000", "bbbb-1111", "cccc-2222"
    lost = _group(
        "1",
        _steps(0, 10, 1, [a, b], replica_id=b),
        _steps(12, 15, 3, [a, b2], replica_id=b2),
        by_agent=False,
    )
    assert "replica_id" in lost.entries[0] and "replica_id" not in lost.entries[1]
    lost.healed = [
        {"step": 0, "bytes": 10, "seconds": 0.1, "restart": 0, "pid": 100, "time": 1000.1},
        {"step": 12, "bytes": 20, "seconds": 0.2, "restart": 0, "pid": 101, "time": 1012.2},
    ]
    survivor = _group("0", _steps(0, 10, 1, [a, b]) + _steps(10, 12, 2, [a]))
    section = summarize([survivor, lost], expected=2)
    healings = section["healings"]
    assert (healings["count"], healings["bytes"], healings["initial_syncs"]) == (1, 20, 1)
    # the replacement's first line names its quorum's members, and no loss of its own
    assert [(f["group"], f["step"], f["seen_by"]) for f in section["failures"]] == [
        ("1", 10, ["0"])
    ]
    assert section["failures"][0]["replica_id"] == b


@pytest.mark.timeout(60)
def test_a_cut_off_live_process_that_heals_at_its_next_quorum_counts_as_a_healing() -> None:
    # benchmarks/live_partition.py: group 1's link down from step 43; its process, never
    # restarted, gets its next quorum at step 922 and heals there from group 0
    cut_off = _group(
        "1",
        _steps(0, 43, 1, [A, B]) + _steps(922, 930, 3, [A, B]),
        healed=[
            {"step": 0, "bytes": 10, "seconds": 0.02, "restart": 0, "pid": 100, "time": 1000.0},
            {"step": 922, "bytes": 40, "seconds": 4.1, "restart": 0, "pid": 100, "time": 1922},
        ],
    )
    survivor = _group("0", _steps(0, 43, 1, [A, B]) + _steps(43, 930, 2, [A]))
    healings = summarize([survivor, cut_off], expected=2)["healings"]
    assert (healings["count"], healings["bytes"], healings["initial_syncs"]) == (1, 40, 1)
    assert [h["step"] for h in healings["at"]] == [922]


@pytest.mark.timeout(60)
def test_without_member_lists_a_drop_in_participants_is_a_loss_of_someone() -> None:
    entries = [
        {"step": s, "restart": 0, "time": s, "quorum_id": q, "participants": n, "committed": True}
        for s, q, n in [(0, 1, 2), (1, 1, 2), (2, 2, 1), (3, 2, 1)]
    ]
    (failure,) = summarize([GroupMembership("0", entries)], expected=2)["failures"]
    assert (failure["step"], failure["group"], failure["seen_by"]) == (2, None, ["0"])


@pytest.mark.timeout(60)
def test_a_damaged_line_is_named_and_gradsync_report_says_so_in_one_line(tmp_path: Path) -> None:
    (tmp_path / MEMBERSHIP_FILE).write_text('{"step": 0, "time": 1.0}\n{"step": 1, "ti')
    with pytest.raises(ValueError, match=rf"{MEMBERSHIP_FILE}: line 1 has no quorum_id, parti"):
        read_group(tmp_path)
    records = [StepRecord(0, 0, 1.0, 0.5, 0.1, 0.0, 0.0, 8, 0)]
    (tmp_path / "metrics.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    with pytest.raises(UsageError, match=r"cannot report on .*: line 1 has no quorum_id"):
        analyze_run(tmp_path, plots=False)
    (tmp_path / MEMBERSHIP_FILE).write_text("{not json}\n")
    with pytest.raises(UsageError, match=r"line 1 is not JSON"):
        analyze_run(tmp_path, plots=False)


@pytest.mark.timeout(60)
def test_step_ranges() -> None:
    assert step_ranges([]) == ""
    assert step_ranges([3, 4, 5, 9, 11, 12]) == "3-5, 9, 11-12"


@pytest.mark.timeout(60)
def test_the_trace_shows_quorum_changes_stalls_uncommitted_steps_and_healings() -> None:
    survivor, replaced = _lost_and_healed()
    records = [StepRecord(0, s, 1000.0 + s, 0.5, 0.1, 0.0, 0.0, 8, 0) for s in range(20)]
    events = trace_events(records, membership=survivor)["traceEvents"]
    marks = [e for e in events if e.get("cat") == "membership"]
    assert [(e["ph"], e["name"]) for e in marks] == [
        ("i", "quorum 1: 2 participant(s)"),
        ("i", "quorum 2: 1 participant(s) (lost group 1)"),
        ("X", "stall 2.00 s (quorum)"),
        ("i", "not committed"),
        ("i", "quorum 3: 2 participant(s) (joined group 1)"),
    ]
    stall = marks[2]
    assert (stall["ts"], stall["dur"], stall["args"]["step"]) == (10_000_000, 2_010_000, 10)
    assert {(e["pid"], e["tid"]) for e in marks} == {(0, 99)}
    names = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert "membership" in names
    # A replacement's healing, before its first step record: the trace starts there.
    late = [r for r in records if r.step >= 15]
    trace = trace_events(late, membership=replaced)
    heal = [e for e in trace["traceEvents"] if e["name"].startswith("healed from a peer: step 15")]
    assert heal[0]["ph"] == "X" and heal[0]["dur"] == 1_500_000
    assert trace["otherData"]["start_epoch_s"] <= 1000.0  # restart 0's first quorum


@pytest.mark.timeout(60)
def test_the_runs_report_sums_up_every_groups_directory(tmp_path: Path) -> None:
    for group in _lost_and_healed():
        directory = tmp_path / f"group-{group.name}"
        (directory / "faults").mkdir(parents=True)
        lines = "".join(json.dumps(e) + "\n" for e in group.entries)
        (directory / MEMBERSHIP_FILE).write_text(lines)
        for name, rows in (("healed", group.healed), ("attempts", group.attempts)):
            (directory / "faults" / f"{name}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in rows)
            )
    cfg = RunConfig(replica_groups=2, nproc=1, workload="mlp", out=str(tmp_path))
    outcomes = [{"group": 0, "exit": 0}, {"group": 1, "exit": 0}]
    written = write_run_report(cfg, tmp_path, outcomes)
    assert json.loads((tmp_path / "report.json").read_text()) == written
    assert written["groups"] == outcomes and written["replica_groups"] == 2
    assert written["membership"] == summarize(_lost_and_healed(), expected=2)


@pytest.mark.timeout(60)
def test_a_groups_outcome_names_the_steps_some_rank_has_no_record_of(tmp_path: Path) -> None:
    # a group of two ranks that reached step 11: rank 1's steps 0-3 and both ranks' step 7
    # were not recorded (lost with a killed process, or skipped by a healing). The summary's
    # "steps" (12, the step reached) and the group's report.json (the steps recorded) then
    # differ: the outcome says where (was: nothing did).
    held = {0: [s for s in range(12) if s != 7], 1: [s for s in range(4, 12) if s != 7]}
    records = [
        StepRecord(rank, step, 1000.0 + step, 0.5, 0.1, 0.0, 0.0, 8, 0, loss=1.0)
        for rank, steps in held.items()
        for step in steps
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    got = group_outcome(tmp_path)
    assert (got["steps"], got["unrecorded_at"]) == (12, "0-3, 7")
    full = [StepRecord(0, s, 1000.0 + s, 0.5, 0.1, 0.0, 0.0, 8, 0) for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("".join(r.to_json() + "\n" for r in full))
    assert group_outcome(tmp_path)["unrecorded_at"] == ""


class _Client:
    def __init__(self) -> None:
        self.asked: list[Any] = []

    def _quorum(self, **kwargs: Any) -> str:
        self.asked.append(kwargs)
        return f"quorum {len(self.asked)}"

    def should_commit(self, *args: Any) -> bool:
        return True


class _Manager:
    def __init__(self, client: Any) -> None:
        self._client = client


@pytest.mark.timeout(60)
def test_the_quorum_seam_keeps_the_last_result_and_passes_every_call_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = _Client()
    manager = _Manager(client)
    seen = _QuorumSeen.wrap(manager)
    assert seen is not None and manager._client is seen
    assert manager._client._quorum(step=3) == "quorum 1" and seen.last == "quorum 1"
    assert client.asked == [{"step": 3}]
    assert manager._client.should_commit(0, 3, True) is True
    with caplog.at_level(logging.WARNING):
        assert _QuorumSeen.wrap(_Manager(object())) is None  # a torchft without the seam
    assert "records each step's participants but not who they were" in caplog.text
