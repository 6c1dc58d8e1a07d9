"""A checkpoint writer process that is still writing when its rank lets it go is reaped when
it ends, not left a zombie of a long-lived process (``writer_process._stop_child``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from gradsync.checkpoint.writer_process import _stop_child

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(60)]


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie), None once it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_writer_that_ends_after_it_was_let_go_is_reaped() -> None:
    ours, theirs = socket.socketpair()
    # Ends 1 s after it is let go (its socket shut down), far past the 0.05 s waited for it.
    waits = (
        "import socket, sys, time; socket.socket(fileno=int(sys.argv[1])).recv(1); time.sleep(1)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", waits, str(theirs.fileno())], pass_fds=(theirs.fileno(),)
    )
    theirs.close()
    _stop_child(child, ours, os.getpid())
    deadline = time.monotonic() + 30
    while _state(child.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(child.pid) is None, f"writer {child.pid} left as {_state(child.pid)}"
    assert child.returncode == 0
