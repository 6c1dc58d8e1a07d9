"""``writer_locks.writers_in_session``: the checkpoint writer processes still running in a
session, which a replica group waits for before it ends (the run then kills its session,
writers and all: ``gradsync.runner.group``). This process stands in for a writer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gradsync.checkpoint import writer_locks
from gradsync.checkpoint.writer_locks import writers_in_session

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc"),
]


def test_a_process_is_a_writer_by_its_command_line_and_of_its_own_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session = os.getsid(0)
    assert os.getpid() not in writers_in_session(session)  # not named as a writer
    named = Path("/proc/self/cmdline").read_bytes().split(b"\0")[0]
    monkeypatch.setattr(writer_locks, "_WRITER_MODULE", named)
    assert os.getpid() in writers_in_session(session)
    assert os.getpid() not in writers_in_session(session + 1)
