"""``gradsync run -- SCRIPT``'s checks before any process starts, and how a script's
gs.Synchronizer takes the command line's choices (``attached_run.AttachedRun.choose``)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from gradsync.attached_run import AttachedRun
from gradsync.errors import UsageError
from gradsync.progress import Progress
from gradsync.runner.cli import main
from gradsync.runner.config import RunConfig

pytestmark = pytest.mark.unit


def test_a_script_that_is_not_there_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"-- nope\.py: no such script"):
        RunConfig(script=["nope.py"], out=str(tmp_path))
    with pytest.raises(UsageError, match="name the module to run after -m"):
        RunConfig(script=["-m"], out=str(tmp_path))


def test_workload_flags_with_a_script_are_refused_naming_them(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(UsageError, match=r"^--steps, --lr set the built-in workloads"):
        RunConfig(script=[str(script)], steps=5, lr=0.1, out=str(tmp_path))
    one = r"^--checkpoint-every sets the built-in workloads, .* set it in .* drop it here$"
    with pytest.raises(UsageError, match=one):
        RunConfig(script=[str(script)], checkpoint_every=5, out=str(tmp_path))
    # the flags a script's Synchronizer takes are fine
    RunConfig(script=[str(script)], strategy="local:4", timeout=30.0, out=str(tmp_path))


def test_nothing_after_the_separator_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--nproc", "2", "--"]) == 2
    assert "name a script" in capsys.readouterr().err


def _attached(tmp_path: Path, **config: object) -> AttachedRun:
    (tmp_path / "config.json").write_text(json.dumps(config))
    run = AttachedRun.find(tmp_path)
    assert run is not None
    return run


def test_the_command_line_chooses_what_the_script_leaves_out(tmp_path: Path) -> None:
    run = _attached(tmp_path, strategy="local:4", timeout=30.0, given=["strategy", "timeout"])
    assert run.choose("strategy", None, "bsp") == "local:4"
    assert run.choose("timeout_s", None, 300.0) == 30.0
    assert run.choose("compression", None, None) is None  # neither says: the default
    assert run.choose("strategy", "local:4", "bsp") == "local:4"  # both say the same


def test_a_script_naming_another_value_than_a_given_flag_is_refused(tmp_path: Path) -> None:
    run = _attached(tmp_path, strategy="local:4", given=["strategy"])
    with pytest.raises(UsageError, match=r"--strategy local:4, but the script's .*'bsp'"):
        run.choose("strategy", "bsp", "bsp")
    # a flag left at its default gives way to the script's choice
    quiet = _attached(tmp_path, strategy="bsp", given=[])
    assert quiet.choose("strategy", "zero:1", "bsp") == "zero:1"
    # named as the command line spells it: --compress, not config.json's "compression"
    compressed = _attached(tmp_path, compression="fp16", given=["compression"])
    with pytest.raises(UsageError, match=r"gradsync run --compress fp16, but .*drop --compress$"):
        compressed.choose("compression", "int8", None)


def test_without_a_known_number_of_steps_the_line_shows_the_step() -> None:
    class Lines:
        text = ""

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return False

    lines = Lines()
    progress = Progress(0, stream=lines)  # type: ignore[arg-type]
    progress.update(7, 0.5, 0.0, 0.0)
    assert lines.text.startswith("step 7  loss 0.5000"), lines.text


@pytest.fixture
def fake_launch(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """The workers of a script's run, as the command sees them: one step record each."""
    import gradsync.processes.launch
    import gradsync.telemetry.cli
    from gradsync.telemetry.records import METRICS_FILE, StepRecord, write_records

    calls: list[dict[str, object]] = []

    def launch(entry: object, args: tuple[dict[str, object], ...], **kwargs: object) -> object:
        calls.append(args[0])
        record = StepRecord(0, 0, 100.0, 0.5, 0.5, 0.0, 0.0, 4, 10, loss=1.0)
        write_records(Path(str(args[0]["out"])) / METRICS_FILE, [record])
        return {0: {}}

    monkeypatch.setattr(gradsync.processes.launch, "launch", launch)
    monkeypatch.setattr(
        gradsync.telemetry.cli,
        "analyze_run",
        lambda *a, **k: types.SimpleNamespace(format=lambda: "", records=[]),
    )
    return calls


def test_config_json_records_the_script_run_not_the_built_in_workloads_defaults(
    tmp_path: Path, fake_launch: list[dict[str, object]]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    run = tmp_path / "run"
    argv = ["run", "--nproc=2", f"--out={run}", "--no-plots", "--no-progress", "--strategy=local:4"]
    assert main([*argv, "--", str(script), "--epochs", "3"]) == 0
    saved = json.loads((run / "config.json").read_text())
    assert saved["script"] == [str(script), "--epochs", "3"]
    assert saved["nproc"] == 2 and saved["strategy"] == "local:4"
    # none of the built-in workloads' fields: the script trained its own model, data and steps
    assert not saved.keys() & {"workload", "steps", "batch_size", "lr", "seed", "params"}, saved
    # a module run is recorded as run, -m and all
    module = tmp_path / "module-run"
    assert main(["run", f"--out={module}", "--no-plots", "--", "-m", "mypkg.train", "--x"]) == 0
    saved = json.loads((module / "config.json").read_text())
    assert saved["script"] == ["-m", "mypkg.train", "--x"] and "workload" not in saved
    # the workers still get the whole config (RunConfig.from_dict fills in the rest)
    assert RunConfig.from_dict(saved).script == ["-m", "mypkg.train", "--x"]
    # and the directory is still a gradsync run's: --overwrite starts over in it
    (module / "metrics.jsonl").write_text("")
    assert main(["run", f"--out={module}", "--overwrite", "--", "-m", "mypkg.train"]) == 0


def test_a_built_in_run_records_its_workload_and_steps(
    tmp_path: Path, fake_launch: list[dict[str, object]]
) -> None:
    run = tmp_path / "run"
    assert main(["run", "--nproc=1", "--steps=3", f"--out={run}", "--no-plots"]) == 0
    saved = json.loads((run / "config.json").read_text())
    assert saved["workload"] == "charlm" and saved["steps"] == 3 and saved["script"] == []


def test_a_scripts_kill_step_is_not_held_against_the_built_in_steps(tmp_path: Path) -> None:
    """--steps (200 by default) counts the built-in workloads' steps; a script's are its own."""
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = RunConfig(script=[str(script)], kill="1:250", max_restarts=1, nproc=2, out=str(tmp_path))
    assert cfg.kill == "1:250"
    with pytest.raises(UsageError, match=r"--kill 1:250 would never fire: the run has --steps"):
        RunConfig(kill="1:250", max_restarts=1, nproc=2, out=str(tmp_path))


def test_a_script_run_s_first_synchronizer_records_its_gradient_size(tmp_path: Path) -> None:
    """gradsync run cannot count a script's model before the script runs: rank 0's first
    Synchronizer adds it to config.json, for the report's bytes against fp32 gradients; a
    built-in workload's (counted by the command) and a second Synchronizer's stay as written."""
    script, workload = tmp_path / "script", tmp_path / "workload"
    for directory, config in ((script, {"script": ["train.py"]}), (workload, {"steps": 5})):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
    AttachedRun(script).start(0, 2, gradient_numel=321)
    AttachedRun(script).start(0, 2, gradient_numel=7)  # another Synchronizer of the script
    assert json.loads((script / "config.json").read_text()) == {
        "script": ["train.py"],
        "fp32_bytes_per_step": 1284,
    }
    AttachedRun(workload).start(0, 2, gradient_numel=321)
    assert json.loads((workload / "config.json").read_text()) == {"steps": 5}
    AttachedRun(tmp_path / "plain").start(0, 1, gradient_numel=321)  # no config.json: nothing
    assert not (tmp_path / "plain" / "config.json").exists()
