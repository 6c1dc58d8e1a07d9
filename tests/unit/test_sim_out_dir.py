"""``gradsync simulate``'s sweeps write their PNGs where the user says (--plot-dir), else into a
new temporary directory, and print where: never into the current directory unasked."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from gradsync.runner.cli import main

pytestmark = pytest.mark.unit

SWEEP = ["simulate", "--workers", "2", "--steps", "5", "--sweep-staleness", "0,inf"]


def _plots(out: str) -> list[Path]:
    return [
        Path(line.removeprefix("plot: ")) for line in out.splitlines() if line.startswith("plot: ")
    ]


def test_a_sweep_in_an_empty_directory_leaves_it_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cwd, temp = tmp_path / "cwd", tmp_path / "temp"
    cwd.mkdir()
    temp.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    assert main([*SWEEP, "--sweep-workers", "2,4", "--strategies", "bsp"]) == 0
    assert list(cwd.iterdir()) == []
    plots = _plots(capsys.readouterr().out)
    assert [p.name for p in plots] == ["sim_staleness.png", "sim_scaling.png"]
    (made,) = temp.iterdir()  # one new directory for both
    assert made.name.startswith("gradsync-simulate-")
    assert all(p.parent == made and p.stat().st_size > 0 for p in plots)


def test_plot_dir_is_made_if_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([*SWEEP, "--plot-dir", "out/plots", "--json"]) == 0
    assert '"staleness_plot": "out/plots/sim_staleness.png"' in capsys.readouterr().out
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["sim_staleness.png"]


def test_a_usage_error_makes_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main([*SWEEP, "--layers", "1,2"]) == 2
    assert "--layers" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
