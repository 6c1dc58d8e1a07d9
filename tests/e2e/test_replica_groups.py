"""``gradsync run --replica-groups 2``: two replica groups on loopback, each a torchft
participant with its own elastic agent; group 1 is SIGKILLed mid-run and restarted by its own
agent, its replacement heals from group 0, and the run ends with both groups' final parameters
bitwise equal; the run directory records each step's quorum, the loss group 0 saw and waited
out, and the healing, which RUN/report.json, the summary and the traces show. One run (each
group costs seconds of start-up); and Ctrl-C, which stops every group and leaves nothing
running.

``--min-replicas 2`` makes group 0 wait at the step group 1 died in for the replacement, rather
than train on alone (tests/ranks/test_live_membership.py tests that): so the replacement heals
at exactly that step, and the test does not race the survivor to the end of the run."""

from __future__ import annotations

import functools
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.overlap import overlapped
from tests.support.proctree import (
    Watched,
    assert_listens_on_loopback_only,
    describe_listeners,
    reaped_within,
    watch_until_exit,
)
from tests.support.torchrun import ROOT

pytestmark = pytest.mark.e2e
pytest.importorskip("torchft", reason="--replica-groups needs torchft: pip install 'gradsync[ft]'")

STEPS, KILL_AT = 30, 8


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _kill_heal_run(
    out: Path,
    *extra: str,
    kill_at: int = KILL_AT,
    nproc: int = 1,
    killed: int = 0,
    min_replicas: int = 2,
) -> tuple[str, str, Watched, int]:
    """Two groups of ``nproc`` ranks, --min-replicas 2, group 1's rank ``killed`` (0: its first)
    SIGKILLed at step ``kill_at`` and the group restarted once by its own agent: the run's
    stdout and stderr once it exited 0, leaving nothing running (the groups' agents, workers,
    forkservers), what was seen of its tree, and its pid."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradsync", "run", *extra]
        + ["--replica-groups", "2", "--nproc", str(nproc), "--min-replicas", str(min_replicas)]
        + ["--workload", "mlp", "--params", "5000", "--steps", str(STEPS)]
        + ["--max-restarts", "1", "--kill", f"{nproc + killed}:{kill_at}"]  # group 1's rank
        + ["--timeout", "90", "--no-plots", "--no-progress", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    watched = Watched()
    try:
        rc = watch_until_exit(proc, watched, timeout_s=240)
        stdout, stderr = proc.communicate(timeout=30)
        left = [pid for pid in watched.survivors() if not reaped_within(pid, 10)]
    finally:
        _stop(proc, watched)
    assert rc == 0, stderr[-4000:]
    assert not left, f"still running after the run: {left}"
    return stdout, stderr, watched, proc.pid


def _group0_unbroken_group1_restarted_once(out: Path) -> list[dict[str, Any]]:
    """Group 0 never restarted (one process, every step once); group 1 restarted once by its
    own agent. Group 1's healings by its replacement."""
    group0, group1 = out / "group-0", out / "group-1"
    assert [a["restart"] for a in _jsonl(group0 / "faults" / "attempts.jsonl")] == [0]
    records = _jsonl(group0 / "metrics.jsonl")
    for rank in {r["rank"] for r in records}:
        assert sorted(r["step"] for r in records if r["rank"] == rank) == list(range(STEPS))
    assert [a["restart"] for a in _jsonl(group1 / "faults" / "attempts.jsonl")] == [0, 1]
    return [h for h in _jsonl(group1 / "faults" / "healed.jsonl") if h["restart"] == 1]


@pytest.mark.timeout(280)
def test_a_killed_replica_group_is_restarted_alone_and_heals_from_the_other(
    tmp_path: Path,
) -> None:
    """Groups of two ranks (each rank exchanges with the same rank of the other group, after
    its group's own all-reduce), fp16 across groups (each group casts its share, the Manager
    sums the casts); group 1's rank 0 is killed and its agent restarts the group's two."""
    out = tmp_path / "run"
    stdout, stderr, watched, pid = _kill_heal_run(out, "--compress", "fp16", nproc=2)
    group0, group1 = out / "group-0", out / "group-1"
    # Group 1's replacement healed from group 0 at the step it died in (group 0 waited there:
    # --min-replicas 2).
    healed = _group0_unbroken_group1_restarted_once(out)
    assert [h["step"] for h in healed] == [KILL_AT], healed
    assert healed[0]["bytes"] > 0
    # said once for the group, not once per rank
    said = f"replica group 1 healed from a live peer: at step {KILL_AT}"
    assert stderr.count(said) == 1, stderr[-4000:]
    # ... and ended at --steps, as group 0 did, not --steps past the step it healed at.
    assert max(json.loads(line)["step"] for line in (group1 / "metrics.jsonl").open()) == STEPS - 1
    # The replicas agree bitwise at the end.
    a, b = (torch.load(g / "final_model.pt", weights_only=True) for g in (group0, group1))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # ... which the run's report.json and summary say, from each group's own fingerprint of
    # its final model (a group cut off from the quorum would end apart, with a warning)
    final = json.loads((out / "report.json").read_text())["final_models"]
    assert final["agree"] is True and sorted(final["groups"]) == ["0", "1"], final
    assert f"final models equal across 2 groups (step {STEPS})" in stdout, stdout
    # a step sends 4 bytes an element inside the group and 2 (fp16) across groups
    numel = sum(t.numel() for t in a.values())
    sent = {json.loads(line)["bytes"] for line in (group0 / "metrics.jsonl").open()}
    assert sent == {(4 + 2) * numel}, (sent, numel)
    # The summary: each group's steps and restarts (exit, steps, final loss, restarts, healed).
    rows = re.findall(r"^\s+(\d)\s+0\s+(\d+)\s+\S+\s+(\d+)\s+(.*)$", stdout, re.M)
    assert [(g, s, r) for g, s, r, _ in rows] == [("0", str(STEPS), "0"), ("1", str(STEPS), "1")]
    _assert_membership_recorded(out, stdout, healed[0])
    # Everything listened on loopback: the lighthouse (in gradsync run itself), each group's
    # stores, torchft Manager servers and gloo sockets.
    assert_listens_on_loopback_only(watched)
    root = {entry for entry in watched.listeners if entry[1] == pid}
    assert root, "the lighthouse's listener was not seen:\n  " + describe_listeners(
        watched.listeners
    )


@pytest.mark.timeout(280)
@pytest.mark.parametrize("strategy", ["zero:2"])
def test_zero_inside_each_group_heals_a_rank_from_its_peer_rank_and_ends_bitwise_equal(
    tmp_path: Path, strategy: str
) -> None:
    """``zero:2`` inside replica groups of two ranks (HSDP's shape): each rank owns half of
    the optimizer state within its group; each rank's part of the group's reduce-scatter is
    averaged with the same rank's part in the other group; each step the quorum does not
    commit is skipped by both ranks of a group (``zero:1``, whose gradient crosses the quorum
    as under ``bsp``, is the compressor test's strategy below).
    Group 1's rank 1 is killed; each new rank heals from the same rank of group 0, whose
    shard of the optimizer state is its own (the same ownership in every group), and both
    groups end bitwise equal, with parameters and optimizer state that every rank of a group
    agrees on (the run's final divergence check)."""
    out = tmp_path / "run"
    _, stderr, _, _ = _kill_heal_run(out, "--strategy", strategy, nproc=2, killed=1)
    assert f"strategy {strategy}, membership torchft" in stderr, stderr[-2000:]
    healed = _group0_unbroken_group1_restarted_once(out)
    assert [h["step"] for h in healed] == [KILL_AT], healed
    a, b = (
        torch.load(g / "final_model.pt", weights_only=True)
        for g in (out / "group-0", out / "group-1")
    )
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.timeout(280)
def test_a_compressor_crosses_the_quorum_and_a_healed_group_ends_where_ranks_would(
    tmp_path: Path,
) -> None:
    """``--compress int8`` under ``zero:1`` (BSP's exchange, and the quorum's commit asked
    before the sharded update): each bucket's int8 codes and scales are all-gathered over the
    quorum's participants (torchft's process group), decoded in the participants' order, as
    ``--nproc 2`` does over two ranks. Group 1 is killed at KILL_AT and its replacement heals
    from group 0 (int8's step counters come along); both groups end bitwise equal to an
    uninterrupted ``--nproc 2`` run of ``bsp`` with int8, and each step sends what two ranks'
    int8 exchange sends."""
    out, plain = tmp_path / "run", tmp_path / "plain"
    # The uninterrupted --nproc 2 run is independent of the groups' (its own ports and
    # directory; it heals nothing and nothing in it is timed): started beside it
    # (tests/support/overlap.py), where it ran after it.
    runs = {
        "groups": functools.partial(
            _kill_heal_run, out, "--strategy", "zero:1", "--compress", "int8"
        ),
        "plain": functools.partial(
            subprocess.run,
            [sys.executable, "-m", "gradsync", "run", "--compress", "int8", "--nproc", "2"]
            + ["--workload", "mlp", "--params", "5000", "--steps", str(STEPS), "--timeout", "90"]
            + ["--no-plots", "--no-progress", "--out", str(plain)],
            check=True,
            capture_output=True,
            timeout=200,
        ),
    }
    with overlapped(runs) as done:
        done.result("groups")
        healed = _group0_unbroken_group1_restarted_once(out)
        assert [h["step"] for h in healed] == [KILL_AT], healed
        done.result("plain")
    expected = torch.load(plain / "final_model.pt", weights_only=True)
    for group in (out / "group-0", out / "group-1"):
        got = torch.load(group / "final_model.pt", weights_only=True)
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), (group.name, key)
    sent = {r["bytes"] for r in _jsonl(out / "group-0" / "metrics.jsonl")}
    assert sent == {r["bytes"] for r in _jsonl(plain / "metrics.jsonl")}, sent


def _assert_membership_recorded(out: Path, stdout: str, healed: dict[str, Any]) -> None:
    """What the run recorded of its membership (docs/membership.md): each step's quorum per
    group, the loss group 0 saw and waited out, the healing; RUN/report.json, the summary's
    line and the groups' traces say the same."""
    group0, group1 = out / "group-0", out / "group-1"
    seen0 = _jsonl(group0 / "membership.jsonl")
    assert [m["step"] for m in seen0] == list(range(STEPS))
    assert all(m["participants"] == 2 and m["committed"] for m in seen0)
    # At the step group 1 died in, group 0's quorum lost its replica and took in the
    # replacement (another replica id of group 1): a new quorum, which it waited for.
    at = seen0[KILL_AT]
    assert at["quorum_id"] != seen0[KILL_AT - 1]["quorum_id"]
    assert [r.split(":")[0] for r in at["left"] + at["joined"]] == ["1", "1"]
    assert at["left"] != at["joined"]
    # the lost replica's heartbeat timeout (1.5 s, --heartbeat-timeout), at least, and not
    # over issue 45's 2 s (it was 2.03-2.13 s at a 2 s timeout)
    assert 1.0 < at["stall_s"] < 2.0, at
    assert all((m["stall_s"] or 0) < at["stall_s"] for m in seen0 if m["step"] != KILL_AT)
    # Group 1's file: the killed process's every step (each line written at its step), then
    # the replacement's from the step it healed at.
    seen1 = _jsonl(group1 / "membership.jsonl")
    assert [(m["restart"], m["step"]) for m in seen1] == [(0, s) for s in range(KILL_AT)] + [
        (1, s) for s in range(KILL_AT, STEPS)
    ]
    assert seen1[KILL_AT]["healed_bytes"] == healed["bytes"]
    report = json.loads((out / "report.json").read_text())
    membership = report["membership"]
    assert [(f["group"], f["step"], f["seen_by"]) for f in membership["failures"]] == [
        ("1", KILL_AT, ["0"])
    ]
    assert membership["steps_with_fewer_participants"] == 0  # --min-replicas 2: it waited
    assert [q["step"] for q in membership["quorums"]] == [0, KILL_AT]
    healings = membership["healings"]
    assert (healings["count"], healings["bytes"]) == (1, healed["bytes"])
    stall = membership["max_stall"]
    assert (stall["group"], stall["step"]) == ("0", KILL_AT)
    assert [g["restarts"] for g in report["groups"]] == [0, 1]
    # each group's own report.json: its view (group 0 saw the loss)
    own = json.loads((group0 / "report.json").read_text())["membership"]
    assert [(f["group"], f["step"]) for f in own["failures"]] == [("1", KILL_AT)]
    assert f"lost group 1 at step {KILL_AT} (seen by group 0)" in stdout, stdout
    assert f"longest stall {stall['seconds']:.2f} s (group 0, step {KILL_AT})" in stdout
    # The traces: the new quorum and the stall in group 0's, the healing in group 1's.
    marks0 = _membership_marks(group0)
    assert any(n.startswith("quorum ") and "(lost group 1; joined group 1)" in n for n in marks0)
    assert any(n.startswith("stall ") for n in marks0), marks0
    assert any(
        n.startswith(f"healed from a peer: step {KILL_AT}") for n in _membership_marks(group1)
    )
    _assert_run_trace_lines_them_up(out)


def _assert_run_trace_lines_them_up(out: Path) -> None:
    """RUN/trace.json: both groups (two ranks each) on one clock, group 0's stall ending
    after group 1's replacement healed (the stall waited for it: --min-replicas 2)."""
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {
        0: "group 0 rank 0",
        1: "group 0 rank 1",
        2: "group 1 rank 0",
        3: "group 1 rank 1",
    }, names
    marks = [e for e in events if e.get("cat") == "membership" and e.get("ph") == "X"]
    # each group's rank 0 keeps its membership record: pid 0 for group 0, 2 for group 1
    stall = next(e for e in marks if e["pid"] == 0 and e["args"]["step"] == KILL_AT)
    healed = next(e for e in marks if e["pid"] == 2 and e["args"]["step"] == KILL_AT)
    assert stall["name"].startswith("stall ") and healed["name"].startswith("healed from")
    assert healed["ts"] < stall["ts"] + stall["dur"], (stall, healed)
    assert stall["ts"] < healed["ts"] + healed["dur"], (stall, healed)


def _membership_marks(directory: Path) -> list[str]:
    trace = json.loads((directory / "trace.json").read_text())
    return [e["name"] for e in trace["traceEvents"] if e.get("cat") == "membership"]


@pytest.mark.timeout(280)
# local:2 with groups of two ranks; DiLoCo's groups (of one and of two) heal in the streaming
# test below, plain diloco:H being its one-fragment case, and groups of one under local:2 take
# the same one-rank path there (the suite's time: issue 45's cases were folded so)
@pytest.mark.parametrize(("strategy", "nproc"), [("local:2", 2)])
def test_periodic_groups_heal_at_a_period_start_and_end_bitwise_equal(
    tmp_path: Path, strategy: str, nproc: int
) -> None:
    """``local:2`` and ``diloco:2``: one quorum a period, joined before its first local step;
    the killed group's replacement heals there from group 0 (DiLoCo's global copy and outer
    momentum with it), trains the period on its own data (its share of the period's exchange is
    its own, not its donor's again), and the last exchange leaves both groups' parameters
    bitwise equal; group 0 never restarts. With groups of two ranks, group 1's rank 1 is killed
    and its agent restarts both (its rank 0, blocked in the quorum with the dead rank, is
    stopped by the agent's SIGTERM and writes its step records first); each exchange is
    summed in the group first (the bytes say so), and the run's final divergence check holds
    each group's two ranks bitwise equal, so all four ranks end with the same bits (without
    the group's sum it failed). Run with ``--compress int8``: local:H's change since its
    anchor (which the replacement heals with: without it, it failed under fp16), summed and
    divided in the group, crosses the quorum as int8 codes and scales all-gathered over its
    participants (fp16's cast through the Manager's all-reduce is the bsp test's and
    tests/unit/test_group_quorum_mean_unit.py's). With a checkpoint every 5 steps: the
    replacement loads its group's of step 5, mid-period, and heals forward at the survivor's
    step 8, at its first step's start."""
    out = tmp_path / "run"
    # KILL_AT: a period's first step
    stdout, stderr, _, _ = _kill_heal_run(
        out,
        *["--strategy", strategy, "--compress", "int8", "--checkpoint-every", "5"],
        nproc=nproc,
        killed=nproc - 1,
    )
    assert f"strategy {strategy}, membership torchft" in stderr, stderr[-2000:]
    group0, group1 = out / "group-0", out / "group-1"
    healed = _group0_unbroken_group1_restarted_once(out)
    assert [h["step"] for h in healed] == [KILL_AT], healed
    # The replacement loaded its group's checkpoint of step 5 (a checkpoint every 5 steps),
    # mid-period, and healed forward at the survivor's step; group 0 never restarted (before,
    # the survivor's Manager, counting its quorums, looked behind the replacement's and healed
    # back from it: 7 of 7 tries of a tester's, under local:2 and diloco:4).
    assert "restart: resuming at step 5 (restart 1 of 1)" in stderr, stderr[-3000:]
    # Every step group 1's survivor completed before the kill is in its metrics.jsonl: it
    # wrote its records no gather took when its agent stopped it (was: lost with it, and the
    # replacement runs none of those steps again). The killed rank's were never gathered (the
    # first gather is after step 10): those before the checkpoint come back from it, the
    # others are lost with it (docs/membership.md).
    records1 = _jsonl(group1 / "metrics.jsonl")
    for rank in range(nproc):
        steps = sorted(r["step"] for r in records1 if r["rank"] == rank)
        lost = range(5, KILL_AT) if rank == nproc - 1 else range(0)
        assert steps == [s for s in range(STEPS) if s not in lost], (rank, steps)
    # ... which the summary and RUN/report.json say, where the steps reached and the group's
    # report.json (the steps recorded) differ
    said = f"group 1: no step records of step(s) 5-{KILL_AT - 1} (skipped by a healing"
    assert said in stdout, stdout
    outcomes = json.loads((out / "report.json").read_text())["groups"]
    assert [g["unrecorded_at"] for g in outcomes] == ["", f"5-{KILL_AT - 1}"], outcomes
    # One quorum a period, recorded at its average (the period's last step), all committed,
    # each saying the step it was joined before (the period's first).
    seen0 = _jsonl(group0 / "membership.jsonl")
    assert [m["step"] for m in seen0] == list(range(1, STEPS, 2))
    assert all(m["participants"] == 2 and m["committed"] for m in seen0), seen0
    assert [m["joined_at"] for m in seen0] == list(range(0, STEPS, 2)), seen0
    # The loss and the healing at the step they happened at, the step healed.jsonl says: the
    # quorum joined at KILL_AT (was: lost at KILL_AT + 1, the period's average, after a
    # healing at KILL_AT).
    seen1 = [m for m in _jsonl(group1 / "membership.jsonl") if "healed_bytes" in m]
    assert [(m["restart"], m["joined_at"]) for m in seen1][-1] == (1, KILL_AT), seen1
    report = json.loads((out / "report.json").read_text())
    membership = report["membership"]
    assert [(f["group"], f["step"]) for f in membership["failures"]] == [("1", KILL_AT)]
    assert [h["step"] for h in membership["healings"]["at"]] == [KILL_AT]
    # each group's fingerprint taken after the final average (report()) says so too
    assert report["final_models"]["agree"] is True, report["final_models"]
    a, b = (torch.load(g / "final_model.pt", weights_only=True) for g in (group0, group1))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # an average sends the model's values across groups as int8 (a byte each, and a 4-byte
    # scale per 1024), and inside a group of several ranks as fp32 (4 bytes each) first
    numel = sum(t.numel() for t in a.values())
    records = _jsonl(group0 / "metrics.jsonl")
    sent = {r["bytes"] for r in records if r["step"] % 2 == 1}
    int8 = numel + 4 * -(-numel // 1024)
    assert sent == {int8 + (0 if nproc == 1 else 4 * numel)}, (sent, numel)


@pytest.mark.timeout(280)
# groups of two ranks: the group's sum and the quorum's exchange; a group of one takes the
# quorum's exchange alone (the compressor test's groups, tests/unit/test_streaming_live_unit.py)
@pytest.mark.parametrize("nproc", [2])
def test_a_group_lost_mid_exchange_fails_it_and_heals_at_the_next_quorum(
    tmp_path: Path, nproc: int
) -> None:
    """Streaming DiLoCo ``diloco:6:2:1`` (fragment 0's exchange starts after steps 2, 8, ...
    and is applied one step later, fragment 1's after 5, 11, ...; one quorum an exchange,
    joined at step 0 and after each applied one: 4, 7, 10, ...), group 1 killed at step 8,
    inside the quorum joined at 7: group 0's exchange of fragment 0 started at 8 finds its
    peer gone and is not committed at 9 (group 0 keeps that fragment, its global copy and
    outer momentum), group 0 never restarts, the next quorum (step 10) takes in group 1's
    replacement, which heals there from group 0 (the streaming state with it, nothing in
    flight), and both end bitwise equal. Plain ``diloco:H`` is its one-fragment, undelayed
    case, through the same code (docs/membership.md). With groups of two ranks, group 1's rank
    0 is killed: both of group 0's ranks fail that exchange (rank 1's peer in group 1 never
    sends: its group's sum failed first), and the end's divergence check holds each group's
    ranks equal."""
    out = tmp_path / "run"
    _, stderr, _, _ = _kill_heal_run(out, "--strategy", "diloco:6:2:1", kill_at=8, nproc=nproc)
    group0, group1 = out / "group-0", out / "group-1"
    healed = _group0_unbroken_group1_restarted_once(out)
    assert [h["step"] for h in healed] == [10], healed
    # one line an exchange, at the step it was applied; then the run's end: the exchange
    # started at its last step (applied at 30), and every fragment at once
    seen0 = _jsonl(group0 / "membership.jsonl")
    assert [m["step"] for m in seen0 if m["step"] < STEPS] == list(range(3, STEPS, 3)), seen0
    assert len(seen0) == STEPS // 3 + 1, seen0
    # the final average after the last step: said so, at a step (was: at END, 2**62)
    assert seen0[-1]["final"] and seen0[-1]["step"] == STEPS, seen0[-1]
    assert not any(m.get("final") for m in seen0[:-1]), seen0
    assert [m["step"] for m in seen0 if not m["committed"]] == [9], seen0
    at = next(m for m in seen0 if m["step"] == 12)  # the quorum the replacement joined
    assert [r.split(":")[0] for r in at["left"] + at["joined"]] == ["1", "1"], at
    a, b = (torch.load(g / "final_model.pt", weights_only=True) for g in (group0, group1))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _stop(proc: subprocess.Popen[str], watched: Watched) -> None:
    """Whatever a test leaves of a run when it ends, passed or failed: killed and reaped."""
    watched.kill_all()
    if proc.poll() is None:
        proc.kill()
        proc.communicate(timeout=30)


def _training_run(
    out: Path, watched: Watched, *extra: str, nproc: int = 1
) -> subprocess.Popen[str]:
    """A long two-group run of ``nproc`` ranks a group, returned once both groups are training
    (each has gathered its first records): what the signal tests then stop."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradsync", "run", "--replica-groups", "2", "--nproc", str(nproc)]
        + ["--workload", "mlp", "--params", "5000", "--steps", "100000", *extra]
        + ["--no-plots", "--no-progress", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 150
    while not all((out / f"group-{k}" / "metrics.jsonl").exists() for k in (0, 1)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the groups never trained: {proc.communicate(timeout=30)[1]}")
        watched.sample(proc.pid)
        time.sleep(0.1)
    watched.sample(proc.pid)
    return proc


@pytest.mark.timeout(240)
def test_ctrl_c_stops_every_replica_group_and_leaves_nothing_running(tmp_path: Path) -> None:
    """And --resume continues the run: see ``_resume_each_group``."""
    watched = Watched()
    out = tmp_path / "run"
    proc = _training_run(out, watched, "--checkpoint-every", "1", nproc=2)
    try:
        # The resume below needs group 0 two commits in (its first file, step 1, and the 64th
        # step's): the first records can come before them (the checkpoint writer runs at the
        # lowest priority), and a CI run once stopped the run at its first commit.
        # And each group's log past its newest file: a checkpoint every step is held in its
        # writer's memory (docs/checkpoints.md, "Held snapshots"), which the stop must write.
        deadline = time.monotonic() + 60
        while (
            len(_committed(out / "group-0" / "checkpoints")) < 2
            or any(_logged(out / f"group-{k}") <= _newest(out / f"group-{k}") for k in (0, 1))
        ) and proc.poll() is None:
            if time.monotonic() > deadline:
                break
            watched.sample(proc.pid)
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # Ctrl-C reaches gradsync run (the groups have sessions)
        rc = watch_until_exit(proc, watched, timeout_s=60)
        _, stderr = proc.communicate(timeout=30)
        left = [pid for pid in watched.survivors() if not reaped_within(pid, 10)]
    finally:
        _stop(proc, watched)
    assert rc == 130, stderr[-3000:]
    assert "interrupted by SIGINT: every replica group was stopped" in stderr, stderr[-3000:]
    # Each group's agent stopped its workers: none had to be killed past the grace period
    # (a worker's SIGINT handler waits for a quorum that never forms; SIGTERM ends it).
    assert "did not stop within" not in stderr, stderr[-3000:]
    assert not left, f"still running after the run: {left}"
    # Every checkpoint a group logged as taken is on disk, committed: the run killed each
    # group's session as soon as its agent ended, with its writers still writing them.
    for k in (0, 1):
        assert _newest(out / f"group-{k}") >= _logged(out / f"group-{k}"), k
    _resume_each_group(out, nproc=2)


def _logged(group: Path) -> int:
    """The newest step the group's checkpoints/log.jsonl lists (rank 0 took that save)."""
    log = group / "checkpoints" / "log.jsonl"
    return max((r["step"] for r in _jsonl(log)), default=-1) if log.exists() else -1


def _newest(group: Path) -> int:
    return max(_committed(group / "checkpoints"), default=-1)


def _committed(checkpoints: Path) -> list[int]:
    return sorted(
        int(d.name[5:]) for d in checkpoints.glob("step-*") if (d / "MANIFEST.json").is_file()
    )


def _resume_each_group(out: Path, nproc: int) -> None:
    """``--resume`` of a stopped run of replica groups: each group loads its own newest
    checkpoint, and the first quorum heals the groups behind the furthest one from it. Group
    0's newest checkpoint is removed first, so it resumes behind group 1 and must heal at
    group 1's step; left to torchft's choice among replicas that all count from 0, group 1
    healed from group 0 and lost its steps."""
    newest = [_committed(out / f"group-{k}" / "checkpoints") for k in (0, 1)]
    assert len(newest[0]) >= 2 and newest[1], newest
    ahead = newest[1][-1]
    shutil.rmtree(out / "group-0" / "checkpoints" / f"step-{newest[0][-1]:06d}")
    behind = _committed(out / "group-0" / "checkpoints")[-1]
    assert behind < ahead, (behind, ahead)
    steps = ahead + 10
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "run", "--replica-groups", "2", "--nproc", str(nproc)]
        + ["--workload", "mlp", "--params", "5000", "--steps", str(steps), "--resume"]
        + ["--checkpoint-every", "5", "--no-plots", "--no-progress", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for at in (ahead, behind):
        assert f"--resume: resuming at step {at}" in done.stderr, done.stderr[-4000:]
    files = [out / f"group-{k}" / "faults" / "healed.jsonl" for k in (0, 1)]
    healed = [_jsonl(f) if f.exists() else [] for f in files]
    assert [h["step"] for h in healed[0]][-1] == ahead, healed
    # where group 0 resumed is where it healed to, not the checkpoint it loaded
    recovered = _jsonl(out / "group-0" / "faults" / "recoveries.jsonl")[-1]
    assert recovered["resumed_at_step"] == ahead, recovered
    assert all(h["step"] == 0 for h in healed[1]), healed  # at most the first run's start
    group1 = _jsonl(out / "group-1" / "metrics.jsonl")
    for rank in range(nproc):  # every step once: none redone, none lost
        assert sorted(r["step"] for r in group1 if r["rank"] == rank) == list(range(steps))
    quorums = [m["step"] for m in _jsonl(out / "group-1" / "membership.jsonl")]
    assert sorted(quorums) == list(range(steps)), quorums  # the stopped run's after it dropped
    a, b = (torch.load(out / f"group-{k}" / "final_model.pt", weights_only=True) for k in (0, 1))
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.timeout(200)
def test_a_run_killed_with_sigkill_leaves_no_replica_group_running(tmp_path: Path) -> None:
    """And (--min-replicas 1, the default) the groups started together: each one's first
    quorum held both, where the first group up used to train alone until the other healed
    from it (up to 71 steps in RELIABILITY.md's 20-failure benchmark)."""
    watched = Watched()
    out = tmp_path / "run"
    proc = _training_run(out, watched)
    try:
        first = [_jsonl(out / f"group-{k}" / "membership.jsonl")[0] for k in (0, 1)]
        proc.kill()  # no handler runs: the groups, in sessions of their own, must stop alone
        proc.communicate(timeout=30)
        left = [pid for pid in watched.survivors() if not reaped_within(pid, 40)]
    finally:
        _stop(proc, watched)
    assert not left, f"still running 40 s after the run was killed: {left}"
    assert [m["participants"] for m in first] == [2, 2], first


@pytest.mark.timeout(200)
# diloco:2 aligns the model as bsp does, and its strategy's state besides (the suite's time)
@pytest.mark.parametrize("strategy", ["diloco:2"])
def test_a_script_whose_groups_start_apart_ends_with_one_model_on_every_rank(
    tmp_path: Path, strategy: str
) -> None:
    """Two groups of two ranks running a user's script that seeds each group's model
    differently (tests/support/replica_group_script.py): torchft's first quorum heals rank R
    of a group from rank R of a peer, and where both groups are at step 0 rank 0 and rank 1
    may take different groups' weights; the group's ranks then take their rank 0's (without
    it, each group's ranks diverged: the end-of-run check failed), and under DiLoCo its global
    copy and outer momentum with them (without those, a rank's pseudo-gradient mixed one
    group's copy with the other's weights: the end-of-run check failed too)."""
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "run", "--replica-groups", "2", "--nproc", "2"]
        + ["--strategy", strategy]
        + ["--timeout", "60", "--no-plots", "--no-progress", "--out", str(tmp_path / "run")]
        + ["--", str(ROOT / "tests" / "support" / "replica_group_script.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    files = [out / f"final-{g}-{r}.pt" for g in (0, 1) for r in (0, 1)]
    finals = [torch.load(f, weights_only=True) for f in files]
    for other in finals[1:]:
        for key in finals[0]:
            assert torch.equal(finals[0][key], other[key]), key
