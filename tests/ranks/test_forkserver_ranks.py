"""Workers launched several times from one process are forked from a forkserver only while they
would see the launching process's environment as it is then (``gradsync.forkserver``), and
each draws its own random numbers. The rules themselves: tests/unit/test_forkserver.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gradsync import forkserver

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(180)
def test_each_launch_gives_its_workers_the_environment_of_that_moment() -> None:
    """Four launches from one process, the second with another thread count, the fourth with
    another variable: forked but for the second and fourth, each seeing its own settings, and
    each worker drawing its own random numbers."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.forkserver_ranks"],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rounds = json.loads(proc.stdout)
    # Where a GPU is visible the launcher spawns every round (forkserver.available).
    fork = forkserver.available()
    expected = [("1", "a", fork), ("2", "a", False), ("1", "a", fork), ("1", "b", False)]
    for workers, want in zip(rounds, expected, strict=True):
        assert [(w["threads"], w["mark"], w["forked"]) for w in workers] == [want, want]
        # unseeded torch, numpy and Python generators differ between ranks, as when spawned
        first, second = (w["draws"] for w in workers)
        assert all(a != b for a, b in zip(first, second, strict=True)), workers
