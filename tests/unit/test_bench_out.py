"""``gradsync bench allreduce`` writes its calibration where ``--out`` says, else into a new
temporary directory, and prints where: never into the current directory unasked (issue 41).
The measurement is replaced by a fixed one here (the bench on two ranks:
tests/e2e/test_sim_cli_e2e.py)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from gradsync.runner.cli import main
from gradsync.sim import bench
from gradsync.sim.model import Fit

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def measured(monkeypatch: pytest.MonkeyPatch) -> None:
    row = bench.BenchRow(nbytes=4096, time_s=1e-4, algbw=0.04, busbw=0.04, samples_s=(1e-4,))
    fit = Fit(alpha=5e-5, beta=1e-9, op="allreduce", algorithm="ring", n=2, max_rel_error=0.1)
    monkeypatch.setattr(bench, "run_bench", lambda cfg: ([row], fit))


def test_the_default_out_is_a_new_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cwd, temp = tmp_path / "cwd", tmp_path / "temp"
    cwd.mkdir()
    temp.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    assert main(["bench", "allreduce"]) == 0
    assert list(cwd.iterdir()) == []
    (made,) = temp.iterdir()
    assert made.name.startswith("gradsync-bench-")
    saved = made / "allreduce_calibration.json"
    assert json.loads(saved.read_text())["alpha_s"] == 5e-5
    assert f"saved to {saved}" in capsys.readouterr().out


def test_out_is_written_there_its_directory_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "allreduce", "--out", "cal/fit.json", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["saved"] == "cal/fit.json"
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*")] == [
        Path("cal"),
        Path("cal/fit.json"),
    ]


def test_an_out_that_is_a_directory_or_below_a_file_is_refused_before_the_bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It failed with IsADirectoryError once the measurement was done."""

    def no_bench(cfg: object) -> None:
        raise AssertionError("the bench ran before --out was checked")

    monkeypatch.setattr(bench, "run_bench", no_bench)
    (tmp_path / "afile").write_text("x")
    assert main(["bench", "allreduce", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path} is a directory; give the file the fit goes to, e.g. --out " in err
    assert main(["bench", "allreduce", "--out", str(tmp_path / "afile" / "fit.json")]) == 2
    assert f"{tmp_path / 'afile'} is a file, not a directory" in capsys.readouterr().err
