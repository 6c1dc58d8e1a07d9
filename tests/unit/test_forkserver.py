"""Workers are forked from a forkserver only while they would see the launching process's
environment as it is now (``gradsync.processes.forkserver``); otherwise they are spawned, as
before."""

from __future__ import annotations

import multiprocessing.forkserver
import os
from pathlib import Path

import pytest

from gradsync import compat
from gradsync.errors import UsageError
from gradsync.processes import forkserver

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """A process whose forkserver has not started; returns the preloads it was started with."""
    started: list[list[str]] = []
    preload: list[list[str]] = []
    monkeypatch.setattr(forkserver, "_started_with", None)
    monkeypatch.setattr(compat, "forkserver_started", lambda: bool(started))
    monkeypatch.setattr(multiprocessing, "set_forkserver_preload", preload.append)
    monkeypatch.setattr(
        multiprocessing.forkserver, "ensure_running", lambda: started.append(preload[-1])
    )
    return started


def test_the_server_is_used_while_the_environment_is_the_one_it_started_with(
    fresh: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GRADSYNC_TEST_MARK", raising=False)
    assert forkserver.start_method() == "forkserver"
    assert fresh == [forkserver.PRELOAD]
    assert forkserver.start_method() == "forkserver"
    monkeypatch.setenv("GRADSYNC_TEST_MARK", "changed")
    assert forkserver.start_method() == "spawn"
    monkeypatch.delenv("GRADSYNC_TEST_MARK")
    assert forkserver.start_method() == "forkserver"
    assert len(fresh) == 1  # started once


def test_another_output_umask_or_affinity_means_spawn(
    fresh: list[list[str]], tmp_path: Path
) -> None:
    assert forkserver.start_method() == "forkserver"
    saved = os.dup(1)
    try:
        with open(tmp_path / "out", "w") as redirected:
            os.dup2(redirected.fileno(), 1)  # `launch ... > file` from here on
            assert forkserver.start_method() == "spawn"
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert forkserver.start_method() == "forkserver"
    umask = os.umask(0o077)
    try:
        assert forkserver.start_method() == "spawn"
    finally:
        os.umask(umask)
    cpus = os.sched_getaffinity(0)
    if len(cpus) > 1:
        os.sched_setaffinity(0, {min(cpus)})
        try:
            assert forkserver.start_method() == "spawn"
        finally:
            os.sched_setaffinity(0, cpus)
    assert forkserver.start_method() == "forkserver"


def test_the_environment_can_ask_for_spawn_and_names_the_valid_values(
    fresh: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(forkserver.START_METHOD_ENV, "spawn")
    assert forkserver.start_method() == "spawn"
    assert fresh == []  # no server started for it
    monkeypatch.setenv(forkserver.START_METHOD_ENV, "fork")
    with pytest.raises(UsageError, match="'fork': valid values are 'auto' and 'spawn'"):
        forkserver.start_method()
    monkeypatch.setenv(forkserver.START_METHOD_ENV, "auto")
    assert forkserver.start_method() == "forkserver"


def test_a_server_started_by_other_code_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forkserver, "_started_with", None)
    monkeypatch.setattr(compat, "forkserver_started", lambda: True)
    assert forkserver.start_method() == "spawn"


def test_without_a_forkserver_or_off_linux_workers_are_spawned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with monkeypatch.context() as patched:
        patched.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
        assert forkserver.start_method() == "spawn"
    monkeypatch.setattr(forkserver.sys, "platform", "darwin")
    assert forkserver.available() is False
    assert forkserver.start_method() == "spawn"


def test_where_a_gpu_is_visible_workers_are_spawned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forkserver.torch.cuda, "is_available", lambda: True)
    assert forkserver.available() is False
    assert forkserver.start_method() == "spawn"
