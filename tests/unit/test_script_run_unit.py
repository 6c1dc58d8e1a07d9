"""``gradsync run -- SCRIPT``'s checks before any process starts, and how a script's
gs.Synchronizer takes the command line's choices (``attached_run.AttachedRun.choose``)."""

from __future__ import annotations

import json
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
