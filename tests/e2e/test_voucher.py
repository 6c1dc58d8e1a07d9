"""A rank's voucher (issue 43, item 5, peers on other machines): a process beside the rank that
writes into the run's store whether the rank runs, whatever the rank's GIL is doing, and that
is gone soon after its rank, SIGKILL included. On the emulated cluster, with the step gate:
tests/e2e/test_cluster_liveness.py."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import torch.distributed as dist

from gradsync.checks import liveness
from gradsync.checks.voucher import NICE

pytestmark = pytest.mark.e2e

#: the rank: two watches claim its voucher (one under a PrefixStore, as the default group's
#: store is), it says the voucher's pid for each, closes the second claim and renames the
#: first key once both are written, then waits to be killed
RANK = """
import sys, time, datetime
import torch.distributed as dist
from gradsync.checks import voucher
host, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
first = voucher.claim(dist.PrefixStore("default_pg/", store), "first", 0.1)
other = voucher.claim(store, "other", 0.5)
print(first.pid, other.pid, flush=True)
while not store.check(["first", "other"]):
    time.sleep(0.05)
other.close()  # before the rename: once "second" is written, "other" no longer is
first.rename("second")
time.sleep(120)
"""


def _until(what: Callable[[], object], limit_s: float = 60.0) -> object:
    """``what()`` once it is true, polled; fails the test after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.05)
    pytest.fail(f"not within {limit_s}s: {what}")


def _state(store: dist.TCPStore, key: str) -> str:
    return store.get(key).decode().partition("|")[2] if store.check([key]) else ""


def _nice(pid: int) -> int:
    # /proc/PID/stat: the field after the command's closing parenthesis, 17th from there
    return int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[16])


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (it no longer runs either way)."""
    start = liveness.start_of(pid)
    return start is None or liveness.state(pid, start) in ("Z", "X")


@pytest.mark.timeout(120)
def test_the_voucher_says_whether_its_rank_runs_and_dies_with_it() -> None:
    limit = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=limit)
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, "127.0.0.1", str(store.port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank.stdout is not None
        voucher, same = (int(pid) for pid in rank.stdout.readline().split())
        assert voucher == same  # one voucher per rank, however many watches
        # Written in the TCPStore itself (not under the prefix), renamed as the rank asked.
        _until(lambda: _state(store, "second") in ("R", "S"))
        # behind its rank (issue 46): niced before it imported torch (it has, to write)
        assert _nice(voucher) == NICE
        closed = store.get("other")
        time.sleep(1.0)  # two of the closed claim's beats, ten of the other's
        assert store.get("other") == closed
        os.kill(rank.pid, signal.SIGSTOP)
        _until(lambda: _state(store, "second") == "T")
        os.kill(rank.pid, signal.SIGCONT)
        _until(lambda: _state(store, "second") in ("R", "S"))
        rank.kill()  # SIGKILL: nothing of the rank's runs to close anything
        rank.wait(10)
        _until(lambda: _exited(voucher), 15.0)
        last = store.get("second")
        time.sleep(0.5)  # five of its beats
        assert store.get("second") == last  # nobody writes for the dead rank
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait(10)
