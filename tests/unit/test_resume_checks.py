"""``gradsync run --resume`` held against the run it continues (``gradsync.runner.resume``),
before any worker starts: another workload, model size, strategy spec or replica groups than
the saved run's config.json is refused naming both values and the flags to pass (not torch's
``Unexpected key(s) in state_dict`` from every worker), and config.json is left as it was;
--steps below the checkpoint's step is refused (not a run that trains nothing and exits 0); a
changed --seed or --batch-size is warned about; the summary's header names this attempt's
ranks, not every rank in the run's records. The checkpoints' own refusals:
test_resume_refusals.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import gradsync.processes.launch
from gradsync.checkpoint import CheckpointStore
from gradsync.compression import parse_compression
from gradsync.runner.cli import main
from gradsync.runner.config import RunConfig
from gradsync.telemetry.records import METRICS_FILE, StepRecord, write_records

pytestmark = pytest.mark.unit

FLAGS = ["--no-plots", "--no-progress"]


def _saved_run(run: Path, step: int = 12, **flags: Any) -> RunConfig:
    """What a finished ``gradsync run`` of ``flags`` leaves: its config.json, and a checkpoint
    of ``step`` (one rank's, as the stores of the other tests write them)."""
    cfg = RunConfig(**{"workload": "mlp", "nproc": 2, "steps": step, "out": str(run), **flags})
    run.mkdir(parents=True, exist_ok=True)
    cfg.save(run, given=cfg.changed_fields())
    store = CheckpointStore(run / "checkpoints")
    strategy = cfg.strategy.split(":")[0]
    compression = parse_compression(cfg.compression).spec
    store.save(step, 0, 1, {"strategy": strategy, "compression": compression, "extra": {}})
    store.commit(step, 1)
    return cfg


class FakeLaunch:
    """The workers, as far as the command sees them: rank 0's step records of the steps from
    the resumed one to --steps, written as a resumed run would."""

    def __init__(self, resumed_at: int = 12) -> None:
        self.calls: list[dict[str, Any]] = []
        self.resumed_at = resumed_at

    def __call__(self, entry: Any, args: tuple[Any, ...], **kwargs: Any) -> dict[int, Any]:
        cfg = args[0]
        self.calls.append({**cfg, **kwargs})
        ranks = range(cfg["nproc"])
        steps = range(self.resumed_at, cfg["steps"])
        records = [_record(r, s) for s in steps for r in ranks]
        write_records(Path(cfg["out"]) / METRICS_FILE, records)
        return {0: {"run_dir": cfg["out"]}}


def _record(rank: int, step: int) -> StepRecord:
    return StepRecord(rank, step, 100.0 + step, 0.5, 0.5, 0.0, 0.0, 4, 10, loss=1.0 / (step + 1))


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch) -> FakeLaunch:
    fake = FakeLaunch()
    monkeypatch.setattr(gradsync.processes.launch, "launch", fake)
    return fake


@pytest.mark.parametrize(
    ("saved", "given", "was", "now"),
    [
        ({}, ["--workload=charlm"], "--workload mlp", "--workload charlm"),
        ({}, ["--params=50000"], "--params 100000", "--params 50000"),
        # the whole spec, not the name the checkpoint records ('bsp', 'local')
        ({}, ["--strategy=local:2"], "--strategy bsp", "--strategy local:2"),
        (
            {"strategy": "local:4"},
            ["--strategy=local:8"],
            "--strategy local:4",
            "--strategy local:8",
        ),
        (
            {"params": 20000},
            ["--workload=charlm"],
            "--workload mlp",  # charlm has no --params: only the workload is named
            "--workload charlm",
        ),
        # given: not given, the saved run's is taken (test_flags_not_given_are_the_saved_runs)
        (
            {"replica_groups": 2},
            ["--replica-groups=0"],
            "--replica-groups 2",
            "no --replica-groups",
        ),
    ],
)
def test_a_flag_that_shapes_the_checkpoints_is_refused_before_any_worker(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    launch: FakeLaunch,
    saved: dict[str, Any],
    given: list[str],
    was: str,
    now: str,
) -> None:
    run = tmp_path / "run"
    flags = {"nproc": 1, **saved} if "replica_groups" in saved else saved
    _saved_run(run, **flags)
    before = (run / "config.json").read_bytes()
    argv = ["run", "--workload=mlp", f"--nproc={flags.get('nproc', 2)}", "--steps=20"]
    code = main([*argv, *given, "--resume", f"--out={run}", *FLAGS])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and not launch.calls, err
    assert len(err) == 1, err
    assert err[0].startswith(
        f"gradsync: error: --resume: the run in {run} was trained with {was} (its config.json), "
        f"this run asks for {now}: "
    ), err
    assert f"Rerun with {was}, or pass a new --out" in err[0], err
    assert (run / "config.json").read_bytes() == before  # the saved run's, not this attempt's


def test_a_resume_without_the_flags_continues_the_saved_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch
) -> None:
    """``gradsync run --resume --out RUN`` alone: the saved run's workload, model size, steps,
    strategy, compressor and ranks (not charlm, bsp and 200 steps, refused as another run)."""
    run = tmp_path / "run"
    _saved_run(run, steps=20, strategy="zero:1", params=20000, compression="fp16")
    assert main(["run", "--resume", f"--out={run}", *FLAGS]) == 0, capsys.readouterr().err
    call = launch.calls[-1]
    taken = {k: call[k] for k in ("workload", "params", "steps", "strategy", "compression")}
    assert taken == {
        "workload": "mlp",
        "params": 20000,
        "steps": 20,
        "strategy": "zero:1",
        "compression": "fp16",
    }
    assert call["nproc"] == 2
    err = capsys.readouterr().err
    assert "gradsync run: mlp, strategy zero:1, compression fp16, 2 workers, 20 steps" in err
    # a given --steps is taken (more than the checkpoint's step), a given other flag refused
    assert main(["run", "--resume", "--steps=30", f"--out={run}", *FLAGS]) == 0
    assert launch.calls[-1]["steps"] == 30 and launch.calls[-1]["strategy"] == "zero:1"
    assert main(["run", "--resume", "--strategy=bsp", f"--out={run}", *FLAGS]) == 2
    assert "trained with --strategy zero:1 (its config.json)" in capsys.readouterr().err
    assert len(launch.calls) == 2


def test_flags_not_given_are_the_saved_runs(tmp_path: Path) -> None:
    """Under --resume each of run's flags that shape the run takes config.json's value where
    not given, --replica-groups among them; a given one is kept (held against the saved run's
    after); without --resume, or without a config.json, the defaults."""
    from gradsync.runner.cli import RESUMED_FLAGS, _take_saved_flags, build_parser

    run = tmp_path / "run"
    saved = {
        "workload": "mlp",
        "params": 20000,
        "steps": 40,
        "strategy": "local:2",
        "compression": "int8",
        "replica_groups": 2,
        "nproc": 3,
        # how it checkpoints and restarts: a resume that dropped them checkpointed no more
        "checkpoint_every": 5,
        "keep_checkpoints": 3,
        "max_restarts": 2,
        # the quorum the groups need: a resume that dropped --min-replicas 2 let one go alone
        "min_replicas": 2,
        "heartbeat_timeout": 5.0,
        # a parameter servers' run: its checkpoints need as many servers (a tester's finding)
        "servers": 2,
    }
    run.mkdir()
    (run / "config.json").write_text(json.dumps(saved))
    assert set(RESUMED_FLAGS) == set(saved)

    def parsed(*argv: str) -> tuple[dict[str, Any], int | None]:
        args = build_parser(full={"run"}).parse_args(["run", f"--out={run}", *argv])
        before = _take_saved_flags(args)
        return {name: getattr(args, name) for name in RESUMED_FLAGS}, before

    assert parsed("--resume") == (saved, 3)
    given = ("--workload=charlm", "--steps=50", "--replica-groups=0", "--compress=fp16")
    flags, before = parsed(
        "--resume", *given, "--checkpoint-every=0", "--max-restarts=0", "--min-replicas=1"
    )
    assert before == 3 and flags == {
        **saved,
        "workload": "charlm",
        "params": RunConfig().params,  # sizes mlp's model only: charlm's is its own
        "steps": 50,
        "replica_groups": 0,
        "compression": "fp16",
        "checkpoint_every": 0,  # given: 0 (off) is a setting, not a missing one
        "max_restarts": 0,
        "min_replicas": 1,  # given: the default value, said, is a setting
    }
    defaults = RunConfig()
    fresh = {name: getattr(defaults, name) for name in RESUMED_FLAGS}
    assert parsed() == (fresh, None)  # no --resume: the defaults, config.json or not
    (run / "config.json").write_text("{torn")
    assert parsed("--resume") == (fresh, None)
    # a script's run records no --workload, --params or --steps: theirs are the defaults
    (run / "config.json").write_text(json.dumps({"strategy": "diloco:4", "nproc": 2}))
    flags, before = parsed("--resume")
    assert before == 2 and flags == {**fresh, "strategy": "diloco:4", "nproc": 2}


def test_several_flags_are_named_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch
) -> None:
    run = tmp_path / "run"
    _saved_run(run, strategy="diloco:8", params=20000)
    argv = ["run", "--workload=mlp", "--nproc=2", "--params=30000", "--strategy=diloco:4"]
    assert main([*argv, "--resume", f"--out={run}", *FLAGS]) == 2
    err = capsys.readouterr().err
    assert "trained with --params 20000 --strategy diloco:8 (its config.json)" in err, err
    assert "asks for --params 30000 --strategy diloco:4" in err, err
    assert "Rerun with --params 20000 --strategy diloco:8, or" in err, err


@pytest.mark.parametrize(
    ("saved", "given"),
    [
        ({"strategy": "diloco:8"}, ["--strategy=diloco:8:1"]),  # one spec, spelled two ways
        # charlm's size is its own (--params with it is refused, test_cli_usage_errors.py)
        ({"workload": "charlm"}, ["--workload=charlm"]),
    ],
)
def test_the_same_model_and_strategy_resume(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    launch: FakeLaunch,
    saved: dict[str, Any],
    given: list[str],
) -> None:
    run = tmp_path / "run"
    _saved_run(run, **saved)
    argv = ["run", "--workload=mlp", "--nproc=2", "--steps=14", *given]
    assert main([*argv, "--resume", f"--out={run}", *FLAGS]) == 0, capsys.readouterr().err
    assert len(launch.calls) == 1


def test_a_scripts_run_is_not_resumed_as_a_built_in_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch
) -> None:
    run = tmp_path / "run"
    _saved_run(run)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "script": ["train.py", "--x"]}))
    assert main(["run", "--workload=mlp", "--resume", f"--out={run}", *FLAGS]) == 2
    err = capsys.readouterr().err
    assert "the run in" in err and "trained a script (train.py --x" in err, err
    assert f"gradsync run --resume --out {run} -- train.py --x" in err and not launch.calls


def test_steps_below_the_checkpoints_step_are_refused_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch
) -> None:
    run = tmp_path / "run"
    _saved_run(run, step=12)
    before = (run / "config.json").read_bytes()
    argv = ["run", "--workload=mlp", "--nproc=2", "--steps=8", "--resume", f"--out={run}"]
    assert main([*argv, *FLAGS]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("gradsync: error: --resume --steps 8: "), err
    assert "from its checkpoint of step 12, past --steps 8: it would train nothing" in err[0]
    assert "pass more than 12" in err[0]
    assert not launch.calls and (run / "config.json").read_bytes() == before


def test_steps_at_the_checkpoints_step_finish_the_run_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch
) -> None:
    run = tmp_path / "run"
    _saved_run(run, step=12)
    write_records(run / METRICS_FILE, [_record(r, s) for s in range(12) for r in (0, 1)])
    argv = ["run", "--workload=mlp", "--nproc=2", "--steps=12", "--resume", f"--out={run}"]
    assert main([*argv, *FLAGS]) == 0
    err = capsys.readouterr().err
    assert "the checkpoint of step 12 is the run's last (--steps 12): no step left" in err, err
    assert len(launch.calls) == 1


def test_another_seed_or_batch_size_is_warned_about_in_a_line_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch
) -> None:
    run = tmp_path / "run"
    _saved_run(run, seed=0, batch_size=16)
    argv = ["run", "--workload=mlp", "--nproc=2", "--steps=14", "--seed=3", "--batch-size=8"]
    assert main([*argv, "--resume", f"--out={run}", *FLAGS]) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if x.startswith("gradsync: warn")]
    assert warned == [
        "gradsync: warning: --resume with --seed 3 where the saved run had --seed 0: the data "
        "order from the resumed step on differs from the saved run's; mlp's targets too (its "
        "teacher is drawn from the seed)",
        "gradsync: warning: --resume with --batch-size 8 where the saved run had --batch-size "
        "16: the data order from the resumed step on differs from the saved run's",
    ]
    assert len(launch.calls) == 1
    # the same flags again: nothing to warn about
    assert main([*argv, "--resume", f"--out={run}", *FLAGS]) == 0
    assert "warning" not in capsys.readouterr().err


def test_the_headers_ranks_are_this_attempts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch
) -> None:
    """A 2-rank bsp run resumed on 1 rank: the records hold both ranks' steps before the
    resume; the header says 1 rank (and the saved run's 2), the table still shows both."""
    run = tmp_path / "run"
    _saved_run(run, step=12)
    write_records(run / METRICS_FILE, [_record(r, s) for s in range(12) for r in (0, 1)])
    saved = (run / "config.json").read_bytes()
    argv = ["run", "--workload=mlp", "--nproc=1", "--steps=20", "--resume", f"--out={run}"]
    assert main([*argv, *FLAGS]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"run: {run} (20 steps, 1 rank; 2 before the resume)", out[:3]
    # the same world as the saved run's: the header as every run has it
    (run / "config.json").write_bytes(saved)
    assert main([*argv, "--nproc=2", *FLAGS]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"run: {run} (20 steps, 2 ranks)", out[:3]


def test_checkpoints_without_a_config_are_said_before_the_defaults_refuse_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run directory whose config.json is gone: --resume takes every flag not given from the
    defaults (charlm on 4 ranks), whose refusal named the model, not why; it is said first."""
    from gradsync.runner.resume import saved_config

    (tmp_path / "checkpoints").mkdir()
    assert saved_config(tmp_path) is None
    err = capsys.readouterr().err
    assert f"--resume: {tmp_path} has checkpoints but no config.json" in err, err
    assert saved_config(tmp_path, warn=False) is None and not capsys.readouterr().err
    assert saved_config(tmp_path / "absent") is None and not capsys.readouterr().err


def test_a_scripts_resume_into_a_directory_without_a_run_says_it_starts_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch
) -> None:
    """Where a built-in workload says "starting over (no checkpoint)", a script's run started
    anew silently (a tester's finding): said once, and the run goes on."""
    script = tmp_path / "train.py"
    script.write_text("")
    for run in (tmp_path / "missing", tmp_path / "empty"):
        if run.name == "empty":
            run.mkdir()
        assert main(["run", "--resume", f"--out={run}", *FLAGS, "--", str(script)]) == 0
        err = capsys.readouterr().err
        assert f"--resume: {run} holds no run yet (no config.json)" in err, err
    assert len(launch.calls) == 2
    # a run there now: its resume says nothing of the kind
    assert main(["run", "--resume", f"--out={tmp_path / 'empty'}", *FLAGS, "--", str(script)]) == 0
    assert "holds no run yet" not in capsys.readouterr().err


def _script_run(tmp_path: Path, launch: FakeLaunch, *flags: str) -> tuple[Path, Path]:
    """A script's run of ``flags`` as ``gradsync run`` leaves it (its config.json)."""
    script = tmp_path / "train.py"
    script.write_text("")
    run = tmp_path / "run"
    assert main(["run", *flags, f"--out={run}", *FLAGS, "--", str(script)]) == 0
    return run, script


@pytest.mark.parametrize(
    ("first", "again", "refusal"),
    [
        # the whole spec, held as a built-in workload's
        (["--strategy=local:4"], ["--strategy=local:8"], "was trained with --strategy local:4"),
        (["--strategy=ssp:1", "--servers=2"], ["--servers=1"], "with --servers 2"),
        # a checkpoint of local:4 does not resize
        (["--strategy=local:4", "--nproc=2"], ["--nproc=3"], "--resume with --nproc 3"),
    ],
)
def test_a_scripts_resume_is_held_against_its_saved_run_before_config_json_changes(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    launch: FakeLaunch,
    first: list[str],
    again: list[str],
    refusal: str,
) -> None:
    """A refused --resume of a script's run was found by its workers, after config.json had
    been rewritten with the refused flags, so a plain --resume after it failed too (a
    tester's finding)."""
    run, script = _script_run(tmp_path, launch, *first)
    before = (run / "config.json").read_bytes()
    argv = ["run", "--resume", *again, f"--out={run}", *FLAGS, "--", str(script)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert refusal in err, err
    assert len(launch.calls) == 1 and (run / "config.json").read_bytes() == before


def test_a_resume_keeps_the_saved_runs_servers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launch: FakeLaunch
) -> None:
    """--servers is the saved run's when not given (a resume without it launched 1 server for
    a run of 2, whose workers then failed, and config.json said 1 after: a tester's finding)."""
    run, script = _script_run(tmp_path, launch, "--strategy=ssp:1", "--servers=2")
    argv = ["run", "--resume", f"--out={run}", *FLAGS, "--", str(script)]
    assert main(argv) == 0, capsys.readouterr().err
    assert launch.calls[-1]["servers"] == 2
    assert json.loads((run / "config.json").read_text())["servers"] == 2


def test_a_flag_given_at_its_default_is_recorded_as_given(
    tmp_path: Path, launch: FakeLaunch
) -> None:
    """config.json's ``given`` names every flag the command line gave, at its default value
    too, so that a script naming another value is refused (``--strategy bsp`` beside a
    script asking for local:4 ran local:4, ``--timeout 300`` beside timeout_s=60 ran 60)."""
    run, _ = _script_run(tmp_path, launch, "--strategy=bsp", "--timeout=300")
    given = json.loads((run / "config.json").read_text())["given"]
    assert "strategy" in given and "timeout" in given
    (tmp_path / "other").mkdir()
    other, _ = _script_run(tmp_path / "other", launch)
    assert "strategy" not in json.loads((other / "config.json").read_text())["given"]
