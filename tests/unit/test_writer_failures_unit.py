"""A background checkpoint writer that stalls: a stalled disk fails the thread writer's save
within its timeout, and a message to a writer process that reads nothing times out. A writer
that dies or stops: tests/ranks/test_writer_failures.py and
tests/e2e/test_writer_failures_e2e.py."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.checkpoint import CheckpointStore
from gradsync.checkpoint.store import snapshot
from gradsync.checkpoint.writer_child import send_message
from gradsync.checkpoint.writer_thread import CheckpointWriter
from tests.support.writer_failures import BOUND_S, TIMEOUT_S, in_thread

pytestmark = pytest.mark.unit


@pytest.mark.timeout(60)
def test_a_stalled_disk_fails_the_thread_writer_s_save_within_the_timeout(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path)
    disk = threading.Event()
    real_write = store.write

    def stalled_write(*args: Any, **kwargs: Any) -> Path:
        disk.wait(60)
        return real_write(*args, **kwargs)

    store.write = stalled_write  # type: ignore[method-assign]
    writer = CheckpointWriter(store, rank=1, world_size=2, save_id="x", timeout_s=TIMEOUT_S)
    try:
        for step in (1, 2, 3):  # one being written, two queued
            writer.submit(step, snapshot({"w": torch.ones(1)}))
        started = time.monotonic()
        thread, raised = in_thread(lambda: writer.submit(4, snapshot({"w": torch.ones(1)})))
        thread.join(BOUND_S)
        assert not thread.is_alive(), "the save still waits for the stalled disk"
        assert TIMEOUT_S <= time.monotonic() - started < BOUND_S
        assert len(raised) == 1 and str(raised[0]) == (
            "rank 1: no room for the checkpoint snapshot of step 4: the checkpoint writer "
            "thread wrote none of the 2 before it (steps 2, 3) in 3 s; it is still busy (a "
            "stalled disk?)"
        ), raised
    finally:
        disk.set()
        writer.close()


@pytest.mark.timeout(60)
def test_a_message_to_a_process_that_reads_nothing_times_out() -> None:
    """A stopped writer reads nothing: its socket fills after a few packets, and a send must
    fail within its timeout rather than wait for ever."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no room to send in 0.2 s"):
            for _ in range(10_000):
                send_message(ours, ("flush", 1), timeout_s=0.2)
        assert time.monotonic() - started < BOUND_S
    finally:
        ours.close()
        theirs.close()
