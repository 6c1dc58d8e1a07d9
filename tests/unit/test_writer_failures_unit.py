"""A background checkpoint writer that stalls: a message to a writer process that reads nothing
times out. A writer
that dies or stops: tests/ranks/test_writer_failures.py and
tests/e2e/test_writer_failures_e2e.py."""

from __future__ import annotations

import socket
import time

import pytest

from gradsync.checkpoint.writer_child import send_message
from tests.support.writer_failures import BOUND_S

pytestmark = pytest.mark.unit


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
