"""Each user error of the CLI gets one clear message naming the bad value and what is valid, and
the CLI exits non-zero without a traceback."""

from __future__ import annotations

import pytest

from tests.support.cli import gradsync

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--strategy", "bogus"], "unknown strategy 'bogus'; valid: bsp, zero:N, local:H"),
        (["--strategy", "local:0"], "H must be an integer >= 1"),
        (["--strategy", "ssp:-1"], "S must be an integer >= 0 or inf"),
        (["--strategy", "ssp:1", "--servers", "0"], "--servers must be at least 1, got 0"),
        (["--batch-size", "6", "--micro-batches", "4"], "does not split into --micro-batches 4"),
        (["--nproc", "0"], "--nproc must be at least 1, got 0"),
        (["--bucket-mb", "0"], "--bucket-mb must be > 0, got 0.0"),
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
    ],
)
@pytest.mark.timeout(60)
def test_cli_usage_errors(args: list[str], expected: str, tmp_path) -> None:
    proc = gradsync("run", "--out", str(tmp_path / "r"), *args, timeout=60)
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
def test_data_file_too_small_names_size_and_what_is_valid(tmp_path) -> None:
    small = tmp_path / "small.txt"
    small.write_text("tiny corpus")
    proc = gradsync("run", "--out", str(tmp_path / "r"), "--data", str(small), timeout=60)
    assert proc.returncode == 2
    assert f"--data file '{small}' holds 11 bytes; pass an existing text file of at least " in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr
