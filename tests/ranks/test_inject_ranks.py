"""The fault injectors that need other processes (``gradsync.inject``): a kill ends its process
with SIGKILL, a hang lasts until every peer released it or its limit."""

from __future__ import annotations

import multiprocessing
import signal
import time
from typing import Any

import pytest

from gradsync import inject
from gradsync.testing import run_ranks

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(60)
def test_kill_ends_the_process_with_sigkill() -> None:
    proc = multiprocessing.get_context("spawn").Process(target=inject.kill)
    proc.start()
    proc.join(timeout=50)
    assert proc.exitcode == -signal.SIGKILL


def _hangs(rank: int, world: int) -> dict[str, Any]:
    """Three hangs in one group: rank 0 released by both peers, rank 0 again released by one
    peer only (it gives up at its limit), and rank 2 released by the one peer it names."""
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    if rank == 0:
        out["released"] = inject.hang()
        out["seconds"] = time.monotonic() - t0
    else:
        time.sleep(1.0)
        inject.release_hang()
    t0 = time.monotonic()
    if rank == 0:
        out["released at the limit"] = inject.hang(name="partial", limit_s=1.0)
        out["seconds at the limit"] = time.monotonic() - t0
    elif rank == 1:
        time.sleep(1.5)
        inject.release_hang(name="named")
    else:
        inject.release_hang(name="partial")
        out["named"] = inject.hang(peers=[1], name="named", limit_s=30)
    return out


@pytest.mark.timeout(90)
def test_hang_lasts_until_every_peer_released_it_or_its_limit() -> None:
    hung, _, other = run_ranks(_hangs, 3, timeout_s=60)
    assert hung["released"] is True
    assert 1.0 <= hung["seconds"] < 10, hung
    assert hung["released at the limit"] is False
    assert 1.0 <= hung["seconds at the limit"] < 10, hung
    assert other == {"named": True}
