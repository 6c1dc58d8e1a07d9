"""What tests/*/test_writer_failures*.py share: the writers' short timeout, the bound on a
failure, and a call in a thread whose hang fails the test instead of hanging it."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from gradsync.checkpoint.writer_process import process_writer_available

needs_linux = pytest.mark.skipif(not process_writer_available(), reason="needs Linux memfd")
TIMEOUT_S = 3.0  # the writers' timeout_s: short, what is tested is that it bounds the wait
BOUND_S = 30.0  # generous: what a failure may take on a loaded 2-core machine


def in_thread(call: Any) -> tuple[threading.Thread, list[BaseException]]:
    """``call()`` in a thread (a hang must fail the test, not hang it); what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - looked at by the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised
