"""``gradsync run --replica-groups G`` without starting anything: the combinations it refuses
(exit 2, one line naming the bad value and why), how --kill and --slow reach each group, and
how a group's Synchronizer takes membership="torchft" from its run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.attached_run import AttachedRun
from gradsync.errors import UsageError
from gradsync.membership import torchft_missing
from gradsync.runner.cli import main
from gradsync.runner.config import RunConfig
from gradsync.runner.replica_groups import group_config, ranks_of_group

pytestmark = pytest.mark.unit

GROUPS = ["--replica-groups", "2", "--nproc", "1", "--workload", "mlp"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["bsp", "local:2", "diloco:2", "diloco:6:2:1"])
def test_groups_of_several_ranks_run_every_live_strategy(strategy: str) -> None:
    """Each rank exchanges with the same rank of the other groups, after its group's sum."""
    if torchft_missing():
        pytest.skip("torchft is not installed: pip install 'gradsync[ft]'")
    cfg = RunConfig(replica_groups=2, nproc=2, strategy=strategy, workload="mlp", out="run")
    assert (cfg.replica_groups, cfg.nproc, cfg.strategy) == (2, 2, strategy)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ["--replica-groups", "2", "--nproc", "2", "--strategy", "ssp:2"],
            "bsp, zero:1, zero:2, local:H or diloco:H only for now, got ssp:2",
        ),
        (["--replica-groups", "1", "--nproc", "1"], "must be between 2 and 256 (0: off), got 1"),
        (
            [*GROUPS, "--strategy", "zero:3"],
            "bsp, zero:1, zero:2, local:H or diloco:H only for now, got zero:3",
        ),
        (
            [*GROUPS, "--strategy", "diloco:7:2:3"],
            "DiLoCo 'diloco:7:2:3': with TAU=3",
        ),
        (
            [*GROUPS, "--strategy", "diloco:4:2:1", "--compress", "int4"],
            "membership='torchft' with streaming DiLoCo 'diloco:4:2:1' and compression 'int4'",
        ),
        ([*GROUPS, "--bucket-mb", "auto"], "with bucket_mb='auto'"),
        ([*GROUPS, "--backend", "nccl"], "exchange over torchft's gloo group on the CPU"),
        ([*GROUPS, "--min-replicas", "3"], "--min-replicas 3 is more than --replica-groups 2"),
        ([*GROUPS, "--min-replicas", "0"], "--min-replicas must be at least 1, got 0"),
        ([*GROUPS, "--lighthouse", "127.0.0.1:29510"], "must be http://HOST:PORT, got '127.0."),
        (["--lighthouse", "http://127.0.0.1:1"], "--lighthouse sets how replica groups meet"),
        (["--min-replicas", "2"], "--min-replicas sets how replica groups meet: it needs"),
        (["--heartbeat-timeout", "3"], "--heartbeat-timeout sets how replica groups meet"),
        (
            [*GROUPS, "--heartbeat-timeout", "0.1"],
            "--heartbeat-timeout must be between 0.5 and 600 seconds, got 0.1",
        ),
        (
            [*GROUPS, "--lighthouse", "http://127.0.0.1:1", "--heartbeat-timeout", "3"],
            "the one given with --lighthouse http://127.0.0.1:1 keeps its own",
        ),
        ([*GROUPS, "--hosts", "3"], "one replica group per host; use --replica-groups 2 --hosts 2"),
        (
            [*GROUPS, "--hosts", "2", "--lighthouse", "http://127.0.0.1:1"],
            "--lighthouse with --hosts 2: the run starts the lighthouse inside",
        ),
        ([*GROUPS, "--kill", "2:5"], "--kill names rank 2, but ranks are 0..1 (2 replica grou"),
        ([*GROUPS, "--slow", "2:1.5"], "--slow names rank 2, but ranks are 0..1"),
        (
            [*GROUPS, "--kill", "1:3,1:5", "--max-restarts", "1"],
            "--kill injects 2 failure(s) in one replica group but --max-restarts is 1",
        ),
    ],
)
def test_refused_before_anything_starts(
    flags: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


@pytest.mark.timeout(60)
def test_compare_refuses_replica_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", *GROUPS, "--strategies", "bsp", "--out", str(tmp_path / "c")]
    assert main(argv) == 2
    assert "--replica-groups 2 (live membership) is gradsync run's" in (capsys.readouterr().err)


@pytest.mark.timeout(60)
def test_kill_and_slow_name_the_ranks_of_every_group_and_each_group_gets_its_own() -> None:
    # One failure per group is within --max-restarts 1: each group restarts on its own.
    cfg = RunConfig(
        replica_groups=3,
        nproc=1,
        workload="mlp",
        steps=20,
        kill="0:3,2:5",
        slow="1:2@4",
        max_restarts=1,
        out="run",
    )
    assert [ranks_of_group(cfg.kill, k, 1) for k in range(3)] == ["0:3", None, "0:5"]
    assert [ranks_of_group(cfg.slow, k, 1) for k in range(3)] == [None, "0:2@4", None]
    own = group_config(cfg, Path("run"), 2, "http://127.0.0.1:9")
    assert (own.out, own.replica_group, own.kill, own.slow) == ("run/group-2", 2, "0:5", None)
    assert own.lighthouse == "http://127.0.0.1:9"
    assert not own.progress  # group 0's line alone
    assert group_config(cfg, Path("run"), 0, "http://127.0.0.1:9").progress


def _run_dir(tmp_path: Path, **settings: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(settings))
    return tmp_path


@pytest.mark.timeout(60)
def test_a_group_synchronizer_takes_torchft_membership_from_its_run_directory(
    tmp_path: Path,
) -> None:
    run = AttachedRun(_run_dir(tmp_path, replica_groups=2, min_replicas=2, given=["min_replicas"]))
    assert run.live(None, None) == ("torchft", 2)
    assert run.live("torchft", 2) == ("torchft", 2)
    with pytest.raises(UsageError, match="--min-replicas 2, but the script's gs.Synchronizer"):
        run.live(None, 1)
    with pytest.raises(UsageError, match="passes membership='other'"):
        run.live("other", None)
    # Outside --replica-groups: the script's own values (min_replicas left out: 1)
    (tmp_path / "plain").mkdir()
    plain = AttachedRun(_run_dir(tmp_path / "plain", steps=5))
    assert plain.live(None, None) == (None, 1)


@pytest.mark.timeout(60)
def test_min_replicas_not_given_on_the_command_line_leaves_the_scripts_own(
    tmp_path: Path,
) -> None:
    run = AttachedRun(_run_dir(tmp_path, replica_groups=2, given=["replica_groups"]))
    assert run.live(None, 2) == ("torchft", 2)
    assert run.live(None, None) == ("torchft", 1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("given", "timeout_ms"), [({}, 1500), ({"heartbeat_timeout": 4.0}, 4000)])
def test_the_lighthouse_gradsync_run_starts_takes_the_heartbeat_timeout(
    given: dict[str, float], timeout_ms: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--heartbeat-timeout reaches the lighthouse the run starts (the survivors' stall after a
    loss: issue 45 allows 2 s, torchft's own default is 5 s)."""
    coordination = pytest.importorskip("torchft.coordination")
    from gradsync.runner.replica_groups import _lighthouse

    started: list[dict[str, object]] = []

    class Recorder:
        def __init__(self, **options: object) -> None:
            started.append(options)

        def address(self) -> str:
            return "http://somewhere:4321"

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(coordination, "LighthouseServer", Recorder)
    cfg = RunConfig(replica_groups=2, nproc=1, **given)
    with _lighthouse(cfg) as address:
        assert address == "http://127.0.0.1:4321"
    assert [o["heartbeat_timeout_ms"] for o in started] == [timeout_ms]
    assert started[0]["bind"] == "127.0.0.1:0"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("before", "says"), [(3, "had 3 replica groups"), (0, "had no replica")])
def test_resume_refuses_a_run_of_other_groups(
    before: int, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--resume continues each group from its own checkpoints: a run of another number of
    groups (or of none) has no such checkpoints to continue."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"replica_groups": before, "nproc": 1}))
    argv = ["run", *GROUPS, "--resume", "--out", str(run)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--resume --replica-groups 2: the run in {run} {says}" in err, err


@pytest.mark.timeout(60)
def test_a_groups_config_keeps_the_heartbeat_timeout_of_the_lighthouse_the_run_started() -> None:
    """The run hands the lighthouse it started (with --heartbeat-timeout) to each group's
    config: that is no --lighthouse of the user's, so the timeout is not refused there."""
    cfg = RunConfig(replica_groups=2, nproc=1, workload="mlp", heartbeat_timeout=2.0, out="run")
    own = group_config(cfg, Path("run"), 1, "http://127.0.0.1:9")
    assert (own.lighthouse, own.heartbeat_timeout) == ("http://127.0.0.1:9", 2.0)
    with pytest.raises(UsageError, match="the one given with --lighthouse http://127.0.0.1:9"):
        RunConfig(replica_groups=2, nproc=1, heartbeat_timeout=2.0, lighthouse="http://127.0.0.1:9")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("first_step", "kept"), [(15, 15), (19, 18)], ids=["alone", "healed"])
def test_a_restarted_groups_rollback_waits_for_its_first_quorum(
    tmp_path: Path, first_step: int, kept: int
) -> None:
    """A replica group's replacement loads its checkpoint of step 15; its killed process
    recorded steps 0-17. With no live peer further (the others finished), its first step is
    15: steps 15-17 run again and their old records go. Healed forward to a peer's step 19,
    it runs none of them again: its only records of 15-17 stay."""
    from gradsync.telemetry.records import METRICS_FILE, write_records
    from gradsync.telemetry.stragglers import synthetic_records

    run = AttachedRun(_run_dir(tmp_path, replica_groups=2, steps=20))
    run.start(0, 1, 10)
    write_records(tmp_path / METRICS_FILE, synthetic_records(18, 1, seed=1))
    quorums = "".join(json.dumps({"step": s}) + "\n" for s in range(18))
    (tmp_path / "membership.jsonl").write_text(quorums)
    run.loaded(15, until_quorum=True)

    def steps(name: str) -> list[int]:
        lines = (tmp_path / name).read_text().splitlines()
        return sorted(json.loads(line)["step"] for line in lines)

    assert steps(METRICS_FILE) == list(range(18))  # nothing dropped before the quorum
    run.began(first_step)
    assert steps(METRICS_FILE) == list(range(kept))
    assert steps("membership.jsonl") == list(range(kept))
    run.began(first_step + 1)  # once: later steps drop nothing
    assert steps(METRICS_FILE) == list(range(kept))
