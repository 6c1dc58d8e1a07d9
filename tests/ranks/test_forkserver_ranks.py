"""Workers launched several times from one process are forked from a forkserver only while they
would see the launching process's environment as it is then (``gradsync.processes.forkserver``), and
each draws its own random numbers: the server's own children are reseeded, a worker's children
are not. The rules themselves: tests/unit/test_forkserver.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gradsync.processes import forkserver

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


# Run as the forkserver would: import the module, then fork a worker, which forks a child of
# its own. Each prints its first draw after seeding torch with 0 before the fork.
_FORKS = """
import os, sys, torch
import gradsync.processes.forkserver_ready

def draw_after_fork():
    torch.manual_seed(0)
    pid = os.fork()
    if pid == 0:
        print(torch.rand(1).item(), flush=True)
        return True
    os.waitpid(pid, 0)
    return False

if draw_after_fork():  # in the worker: reseeded, its draw is not the seed-0 draw
    if draw_after_fork():  # in the worker's child: inherits the worker's state
        os._exit(0)
    os._exit(0)
torch.manual_seed(0)
print(torch.rand(1).item(), flush=True)
"""


@pytest.mark.timeout(60)
def test_only_the_servers_own_children_are_reseeded() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _FORKS], capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    worker, workers_child, seeded = (float(x) for x in proc.stdout.split())
    assert worker != seeded  # the server's child drew from a fresh seed
    assert workers_child == seeded  # a worker's own child kept the state it was forked with
