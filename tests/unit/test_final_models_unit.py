"""Whether ``gradsync run --replica-groups``'s groups ended with the same model (issue 45): each
group's rank 0 records its final model's fingerprint at ``report()``
(``Synchronizer._record_final_model``), and the run's summary and report.json compare the
groups' (``compare_final_models``). A group cut off from the quorum past the lighthouse's
heartbeat timeout (SIGSTOPped, partitioned) trains on alone and ends with another model than
the others, every group exiting 0: the summary must say so. Fake group directories here; the
e2e kill/heal run (tests/e2e/test_replica_groups.py) checks the "agree" of a real run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import gradsync as gs
from gradsync.runner.config import RunConfig
from gradsync.runner.replica_groups import summarize_groups
from gradsync.telemetry.membership import (
    FINAL_MODEL_PATH,
    MEMBERSHIP_FILE,
    MembershipLog,
    compare_final_models,
    read_final_model,
    write_final_model,
)

pytestmark = pytest.mark.unit

A, B = "0:aaaa", "1:bbbb"
STEPS = 20


def _membership(directory: Path, alone_from: int) -> None:
    """Both groups in one quorum until ``alone_from``, then each in a quorum of its own (group 1
    stopped past the heartbeat timeout: group 0 went on alone, and so did group 1 once
    continued), both to STEPS."""
    me = A if directory.name == "group-0" else B
    log = MembershipLog(directory / MEMBERSHIP_FILE, restart=0, pid=100)
    for step in range(STEPS):
        both = step < alone_from
        log.write(
            step=step,
            time=1000.0 + step,
            quorum_s=0.01,
            quorum_id=1 if both else (2 if me == A else 3),
            participants=2 if both else 1,
            members=[A, B] if both else [me],
            committed=True,
        )
    log.close()


def _run(tmp_path: Path, fingerprints: list[str | None], alone_from: int = 8) -> RunConfig:
    for k, fp in enumerate(fingerprints):
        directory = tmp_path / f"group-{k}"
        _membership(directory, alone_from)
        if fp is not None:
            write_final_model(directory, step=STEPS, fingerprint=fp, restart=0)
    return RunConfig(replica_groups=len(fingerprints), nproc=1, workload="mlp", out=str(tmp_path))


def _report(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "report.json").read_text())


@pytest.mark.timeout(60)
def test_the_summary_warns_where_groups_that_trained_alone_end_with_different_models(
    tmp_path: Path,
) -> None:
    cfg = _run(tmp_path, ["1111aaaa2222bbbb", "3333cccc4444dddd"])
    summary = summarize_groups(cfg, tmp_path, [0, 0])
    membership = next(line for line in summary.splitlines() if line.startswith("membership:"))
    assert "12 of 20 steps with fewer than 2 participants (8-19)" in membership
    assert membership.endswith("final models differ (warning below)"), membership
    warning = summary[summary.index("warning:") :]
    assert warning.startswith(
        "warning: the replica groups' final models differ: at step 20, "
        "group 0 (1111aaaa2222bbbb) != group 1 (3333cccc4444dddd)\n"
    ), summary
    # why, where the steps without the other group are, and where to read on
    assert "a group cut off from the quorum (stopped, or partitioned" in warning
    assert "fewer than 2 participants at step(s) 8-19" in warning
    assert 'docs/membership.md, "Final models"' in warning
    final = _report(tmp_path)["final_models"]
    assert final["agree"] is False
    assert final["groups"] == {
        "0": {"step": STEPS, "fingerprint": "1111aaaa2222bbbb"},
        "1": {"step": STEPS, "fingerprint": "3333cccc4444dddd"},
    }
    assert final["differ"] == [{"step": STEPS, "models": [["0"], ["1"]]}]


@pytest.mark.timeout(60)
def test_groups_with_one_final_model_get_no_warning_and_report_that_they_agree(
    tmp_path: Path,
) -> None:
    cfg = _run(tmp_path, ["1111aaaa2222bbbb"] * 2, alone_from=STEPS)
    summary = summarize_groups(cfg, tmp_path, [0, 0])
    assert "warning" not in summary, summary
    assert "; final models equal across 2 groups (step 20)\n" in summary, summary
    assert _report(tmp_path)["final_models"]["agree"] is True


@pytest.mark.timeout(60)
def test_a_group_without_a_record_is_not_compared_and_not_said_to_agree(tmp_path: Path) -> None:
    # group 1 failed for good (or its script never called report()): nothing to compare with
    cfg = _run(tmp_path, ["1111aaaa2222bbbb", None])
    summary = summarize_groups(cfg, tmp_path, [0, 1])
    assert "warning" not in summary, summary
    assert "final models not compared: group 0 at step 20, group 1 none recorded" in summary, (
        summary
    )
    final = _report(tmp_path)["final_models"]
    assert final["agree"] is None and final["groups"]["1"] is None


@pytest.mark.timeout(60)
def test_only_groups_at_one_step_are_compared_and_equal_models_are_named_together() -> None:
    fp = {"x": "aaaa", "y": "bbbb"}
    records: dict[str, dict[str, Any] | None] = {
        "0": {"step": 30, "fingerprint": fp["x"]},
        "1": {"step": 30, "fingerprint": fp["y"]},
        "2": {"step": 30, "fingerprint": fp["x"]},
        "3": {"step": 25, "fingerprint": fp["y"]},  # at another step: not compared
    }
    got = compare_final_models(records)
    assert got["agree"] is False
    assert got["differ"] == [{"step": 30, "models": [["0", "2"], ["1"]]}]
    # the others agreeing, the one at step 25 is still not compared
    records["1"] = {"step": 30, "fingerprint": fp["x"]}
    assert compare_final_models(records)["agree"] is True
    assert compare_final_models({"0": records["0"], "3": records["3"]})["agree"] is None


@pytest.mark.timeout(60)
def test_rank_0_records_its_models_fingerprint_and_the_step(tmp_path: Path) -> None:
    """What a group's Synchronizer writes at ``report()`` (no Manager needed): equal models
    give equal fingerprints, a model one step apart another."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    digests = []
    for k, m in enumerate([model, _copy(model), _nudged(model)]):
        sync = gs.Synchronizer.__new__(gs.Synchronizer)  # no process group needed
        sync.model, sync._step = m, 12
        sync._record_final_model(tmp_path / f"group-{k}")
        record = read_final_model(tmp_path / f"group-{k}")
        assert record is not None and record["step"] == 12
        digests.append(record["fingerprint"])
    assert len(digests[0]) == 16 and digests[0] == digests[1] != digests[2]
    # replaced whole by a later report(), no partial file left beside it
    assert sorted(p.name for p in (tmp_path / "group-0" / FINAL_MODEL_PATH).parent.iterdir()) == [
        FINAL_MODEL_PATH.name
    ]


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    twin = torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    return twin


def _nudged(model: torch.nn.Module) -> torch.nn.Module:
    other = _copy(model)
    with torch.no_grad():
        other.weight[0, 0] += 1e-3
    return other


@pytest.mark.timeout(60)
def test_a_resumed_run_forgets_each_groups_earlier_final_model(tmp_path: Path) -> None:
    """A group that fails after ``--resume`` must not be compared by the model it ended the
    last start with: the claim of its directory removes the record."""
    from gradsync.runner.replica_groups import _claim_group

    directory = tmp_path / "group-0"
    write_final_model(directory, step=STEPS, fingerprint="1111aaaa2222bbbb", restart=0)
    _claim_group(tmp_path, 0, resume=True).release()
    assert read_final_model(directory) is None


@pytest.mark.timeout(60)
def test_a_group_that_ended_its_run_is_said_to_have_finished_not_to_be_lost(
    tmp_path: Path,
) -> None:
    """Group 0 ran its 20 steps and ended; group 1 (a script whose own loop counted past the
    steps it healed over, a tester's run) went on alone to 28. Group 1 saw group 0 leave at
    step 20, where group 0's run ended: said as that, not as a loss (it said "lost group 0")."""
    for k, (me, last) in enumerate(((A, STEPS), (B, STEPS + 8))):
        log = MembershipLog(tmp_path / f"group-{k}" / MEMBERSHIP_FILE, restart=0, pid=100 + k)
        for step in range(last):
            both = step < STEPS
            log.write(
                step=step,
                time=1000.0 + step,
                quorum_s=0.01,
                quorum_id=1 if both else 2,
                participants=2 if both else 1,
                members=[A, B] if both else [me],
                committed=True,
            )
        log.close()
        write_final_model(tmp_path / f"group-{k}", step=last, fingerprint=f"{k}" * 16, restart=0)
    cfg = RunConfig(replica_groups=2, nproc=1, workload="mlp", out=str(tmp_path))
    membership = next(
        line
        for line in summarize_groups(cfg, tmp_path, [0, 0]).splitlines()
        if line.startswith("membership:")
    )
    assert "; finished before the others: group 0 at step 20 (seen by group 1);" in membership
    assert "lost" not in membership, membership
