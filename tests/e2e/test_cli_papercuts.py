"""The ``gradsync`` command's start and finish as a user meets them, each in a process of its own:
``--help`` and ``--version`` answer without importing torch (seconds of start-up otherwise), and a
reader of ``report --json`` that goes away early (``| head``) gets no traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.telemetry.records import METRICS_FILE, write_records
from gradsync.telemetry.stragglers import synthetic_records

pytestmark = pytest.mark.e2e

# A line of ``python -X importtime`` for torch itself or any of its modules.
TORCH_IMPORT = re.compile(r"\|\s+torch(\.|$)", re.MULTILINE)


def _gradsync(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gradsync", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "argv", [["--help"], ["--version"], ["simulate", "--help"], ["report", "--help"]]
)
def test_help_and_version_import_no_torch(argv: list[str]) -> None:
    proc = _gradsync(*argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not TORCH_IMPORT.search(proc.stderr), f"gradsync {' '.join(argv)} imported torch"
    if argv == ["--version"]:
        assert re.fullmatch(r"gradsync \d+\.\d+\.\d+\S*\n", proc.stdout), proc.stdout
    if argv == ["--help"]:  # every command is listed, though none of their modules is imported
        for name in ("run", "compare", "checkpoint", "simulate", "bench", "report", "cluster"):
            assert re.search(rf"^\s+{name}\b", proc.stdout, re.MULTILINE), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entry", ["gradsync.runner.cli", "gradsync.telemetry.cli"])
def test_report_json_into_a_closed_pipe_exits_quietly(tmp_path: Path, entry: str) -> None:
    """As ``gradsync report --json RUN | head -c 10`` once head has exited: the read end of
    stdout is closed before gradsync writes, so every write fails (EPIPE), deterministically.
    The same from the module's own entry point (``python -m gradsync.telemetry.cli``)."""
    run = tmp_path / "run"
    run.mkdir()
    write_records(run / METRICS_FILE, synthetic_records(30, 2, slow=[], seed=1))
    (run / "config.json").write_text(json.dumps({"strategy": "bsp"}))
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", entry, "report", str(run), "--json", "--no-plots"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=50,
            check=False,
        )
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.stderr == ""
    assert proc.returncode == 141  # 128 + SIGPIPE, as a filter killed by the signal


@pytest.mark.timeout(60)
def test_python_dash_m_gradsync_is_the_gradsync_command() -> None:
    """``python -m gradsync`` (no script on PATH) answers as ``gradsync`` does, torch-free."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gradsync", "--help"],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: gradsync "), proc.stdout[:200]
    assert re.search(r"^\s+simulate\b", proc.stdout, re.MULTILINE), proc.stdout
    assert not TORCH_IMPORT.search(proc.stderr), "python -m gradsync --help imported torch"
