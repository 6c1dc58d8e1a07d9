"""Runs that tests in several e2e files read, made once a session (tests/support/shared_runs.py
has the commands): each ``gradsync run`` costs seconds of start-up on 2 cores."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import gradsync
from tests.support.overlap import Overlapped, overlapped
from tests.support.proctree import watched_run
from tests.support.shared_runs import (
    CLEAN_BSP,
    KILLED_BSP,
    ONE_RANK,
    TRACKERS_INSTALLED,
    USER_SCRIPT_COMMAND,
    USER_SCRIPT_SLOWED,
    SharedRun,
)


@pytest.fixture(scope="session")
def killed_bsp_run(tmp_path_factory: pytest.TempPathFactory) -> SharedRun:
    """``gradsync run`` with KILLED_BSP's flags (rank 1 killed at step 17, one restart from a
    checkpoint written every step), its tree watched all along. Read by test_fault_e2e (the
    final model bitwise an uninterrupted run's; then resumed on 3 ranks, from a copy),
    test_restart_telemetry_e2e (every step once in the telemetry and report) and test_listen
    (loopback only, in both rounds)."""
    out = tmp_path_factory.mktemp("killed-bsp") / "run"
    watched, stderr = watched_run(*KILLED_BSP, "--out", str(out), timeout_s=240)
    return SharedRun(out, stderr, watched)


def _clean_bsp(out: Path) -> SharedRun:
    trackers = ["--tracker", ",".join(TRACKERS_INSTALLED)] if TRACKERS_INSTALLED else []
    proc = gradsync("run", *CLEAN_BSP, *trackers, "--out", str(out), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return SharedRun(out, proc.stderr)


def _one_rank(out: Path) -> SharedRun:
    proc = gradsync("run", *ONE_RANK, "--out", str(out), timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return SharedRun(out, proc.stderr)


@pytest.fixture(scope="session")
def uninterrupted_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Overlapped]:
    """CLEAN_BSP's and ONE_RANK's runs, started at once the first time either is asked for
    (tests/support/overlap.py; test_fault_e2e reads both): each is its own ``gradsync run``,
    with its own ports and directory, and neither is timed, killed or waits on a timeout;
    one leaves a core idle much of its time on 2 cores. KILLED_BSP's run is left alone: its
    resume step depends on how far its background writer got at the kill."""
    runs = {
        "clean-bsp": functools.partial(_clean_bsp, tmp_path_factory.mktemp("clean-bsp") / "run"),
        "one-rank": functools.partial(_one_rank, tmp_path_factory.mktemp("one-rank") / "run"),
    }
    with overlapped(runs) as started:
        started.wait()  # both ended before KILLED_BSP's run, which follows them, starts
        yield started


@pytest.fixture(scope="session")
def clean_bsp_run(uninterrupted_runs: Overlapped) -> SharedRun:
    """``gradsync run`` with CLEAN_BSP's flags (KILLED_BSP's run, uninterrupted): the
    reference of test_fault_e2e's every-step test (bitwise) and of test_zero3_e2e (zero:3
    killed and resumed ends where bsp ends). With ``--tracker`` for every tracker installed
    (TRACKERS_INSTALLED), whose files test_trackers_run reads: the sinks change no number."""
    return uninterrupted_runs.result("clean-bsp")


@pytest.fixture(scope="session")
def one_rank_run(uninterrupted_runs: Overlapped) -> SharedRun:
    """``gradsync run`` with ONE_RANK's flags (checkpoints of steps 5 and 10): what
    test_fault_e2e (the newest checkpoint left unfinished) and test_restart_telemetry_e2e (the
    metrics file's last line torn) each change in a copy, then resume."""
    return uninterrupted_runs.result("one-rank")


@pytest.fixture(scope="session")
def user_script_run(tmp_path_factory: pytest.TempPathFactory) -> SharedRun:
    """``gradsync run`` of the user's script (tests/support/user_script.py) with
    USER_SCRIPT_SLOWED's flags, uninterrupted, its tree watched all along. Read by
    test_script_run (the run directory a script gets; the reference a killed and restarted run
    ends bitwise equal to) and test_cluster_run (the loopback reference the same script on two
    emulated hosts ends equal to; loopback only)."""
    out = tmp_path_factory.mktemp("user-script") / "run"
    watched, stderr = watched_run(
        *USER_SCRIPT_SLOWED, "--out", str(out), *USER_SCRIPT_COMMAND, timeout_s=200
    )
    return SharedRun(out, stderr, watched)
