"""Each user error of ``gradsync run`` gets one clear message naming the bad value and what is
valid, and exit status 2, before any process starts: checked in this process through the
command's ``main``. That the installed command exits 2 without a traceback, as a process:
tests/e2e/test_errors_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync.runner.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--strategy", "bogus"], "unknown strategy 'bogus'; valid: bsp, zero:N, local:H"),
        (["--strategy", "local:0"], "H must be an integer >= 1"),
        (["--strategy", "ssp:-1"], "S must be an integer >= 0 or inf"),
        (["--strategy", "ssp:1", "--servers", "0"], "--servers must be at least 1, got 0"),
        (["--batch-size", "6", "--micro-batches", "4"], "does not split into --micro-batches 4"),
        (["--nproc", "0"], "--nproc must be at least 1, got 0"),
        (["--bucket-mb", "0"], "--bucket-mb must be a finite number > 0 or 'auto', got 0.0"),
        (["--bucket-mb", "inf"], "--bucket-mb must be a finite number > 0 or 'auto', got inf"),
        (["--bucket-mb", "nan"], "--bucket-mb must be a finite number > 0 or 'auto', got nan"),
        # refused before launch: bsp's workers would refuse it, leaving a run directory behind
        (
            ["--nproc", "2", "--bucket-mb", "auto", "--compress", "fp16"],
            "--bucket-mb auto with --compress fp16: auto tunes the plain ring all-reduce's",
        ),
        (
            ["--nproc", "2", "--bucket-mb", "auto", "--allreduce", "hierarchical"],
            "--bucket-mb auto with --allreduce hierarchical: auto tunes",
        ),
        (["--micro-batches", "0"], "--micro-batches must be at least 1, got 0"),
        (
            ["--data", "/nonexistent/corpus.txt"],
            "--data file '/nonexistent/corpus.txt' does not exist or is not a file; pass an "
            "existing text file of at least 1024 bytes, or omit --data to train on the "
            "standard-library sample",
        ),
        (["--workload", "resnet"], "unknown workload 'resnet'; valid: charlm, mlp"),
        (["--slow", "1x3"], "bad --slow value '1x3'"),
        (["--nproc", "2", "--slow", "5:2"], "names rank 5, but ranks are 0..1"),
        (["--link", "100mbit"], "--link 100mbit sets the emulated cluster's links: it needs"),
        # the default's value given again: it shapes no link either (was taken silently)
        (["--link", "1gbit"], "--link 1gbit sets the emulated cluster's links: it needs"),
    ],
)
def test_cli_usage_errors(
    args: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--out", str(tmp_path / "r"), *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err


def test_data_file_too_small_names_size_and_what_is_valid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = tmp_path / "small.txt"
    small.write_text("tiny corpus")
    assert main(["run", "--out", str(tmp_path / "r"), "--data", str(small)]) == 2
    err = capsys.readouterr().err
    assert f"--data file '{small}' holds 11 bytes; pass an existing text file of at least " in err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--hosts", "3", "--nproc", "2"], "do not split evenly over --hosts 3"),
        (["--hosts", "2", "--link", "fast", "--nproc", "2"], "bad link rate 'fast'"),
    ],
)
def test_emulated_cluster_flags_are_checked_before_any_host_is_made(
    args: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--out", str(tmp_path / "r"), *args]) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "compare"])
def test_params_with_a_workload_of_a_fixed_size_is_refused_not_ignored(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """charlm's model has a fixed size: --params with it would silently do nothing."""
    for workload in ([], ["--workload", "charlm"]):
        code = main([command, "--out", str(tmp_path / "r"), *workload, "--params", "5000000"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        assert (
            "--params 5000000 does not apply to workload charlm, whose model has a fixed size: "
            "--params sizes the model of workload mlp only; drop --params, or use --workload mlp"
        ) in err
    assert not (tmp_path / "r").exists()  # refused before the run directory is made


def test_params_sizes_mlp_and_a_script_hears_it_is_a_workload_flag(tmp_path: Path) -> None:
    from gradsync.errors import UsageError
    from gradsync.runner.config import RunConfig

    assert RunConfig(workload="mlp", params=5000, out=str(tmp_path)).params == 5000
    script = tmp_path / "train.py"
    script.write_text("")
    # the script's message, not charlm's (the default --workload the script never chose)
    with pytest.raises(UsageError, match=r"^--params sets the built-in workloads"):
        RunConfig(script=[str(script)], params=5000, out=str(tmp_path))


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--workload", "charlm"], "--workload sets"),  # the default workload, given
        (["--steps", "200", "--seed", "0"], "--steps, --seed set"),  # defaults, given
        (["--batch-size=32"], "--batch-size sets"),
    ],
)
def test_a_workload_flag_beside_a_script_is_refused_even_at_its_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    """RunConfig refuses only values other than the defaults; ``--workload charlm -- train.py``
    ran the script as if the flag were not there (a tester's finding)."""
    script = tmp_path / "train.py"
    script.write_text("")
    out = tmp_path / "r"
    assert main(["run", *flags, f"--out={out}", "--", str(script)]) == 2
    assert f"{named} the built-in workloads, not a script's training" in capsys.readouterr().err
    assert not out.exists()  # refused before the run directory is made


def test_a_rank_that_exited_with_a_status_and_no_exception_is_said_so() -> None:
    """A script's sys.exit(3) on one rank left no message: the summary pointed at "the worker
    output above", which held nothing (a tester's finding)."""
    from types import SimpleNamespace

    from gradsync.runner.cli import _describe_child_failure

    failure = SimpleNamespace(message="", exitcode=3)
    said = _describe_child_failure(SimpleNamespace(failures={1: failure}))
    assert said == (
        "worker failure\n  rank 1 failed (exit code 3): it exited with status 3 and no "
        "exception (a sys.exit(3) in the script, or an os._exit)"
    )


def test_a_script_with_a_syntax_error_is_refused_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by the workers, it failed every rank once per restart and left a config.json that
    made the fixed script's rerun need --overwrite (a tester's finding)."""
    script = tmp_path / "train.py"
    script.write_text("import os\nx = (\n")
    out = tmp_path / "r"
    assert main(["run", f"--out={out}", "--", str(script)]) == 2
    err = capsys.readouterr().err
    assert f"gradsync run -- {script}: '(' was never closed (line 2, column 5)" in err, err
    assert not out.exists()
    from gradsync.errors import UsageError
    from gradsync.runner.config import RunConfig

    # a null byte: refused for the whole file, no line to name
    script.write_bytes(b"x = 1\0\n")
    with pytest.raises(UsageError, match=r"null bytes$"):
        RunConfig(script=[str(script)], out=str(tmp_path / "n"))
    # compiled bytecode is runpy's to run, not a syntax error
    import py_compile

    script.write_text("x = 1\n")
    compiled = py_compile.compile(str(script), cfile=str(tmp_path / "train.pyc"))
    RunConfig(script=[compiled], out=str(tmp_path / "c"))


def test_an_unknown_flag_is_refused_with_the_commands_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It printed gradsync's own usage (``gradsync [-h] [--version] COMMAND``), not the
    command's (a tester's finding)."""
    with pytest.raises(SystemExit) as exited:
        main(["run", "--frobnicate"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: gradsync run "), err
    assert "gradsync run: error: unrecognized arguments: --frobnicate" in err
