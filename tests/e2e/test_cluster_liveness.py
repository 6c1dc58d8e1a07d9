"""Issue 43, item 5, for a peer on another machine: a rank holding the GIL between steps on
another (emulated) host is waited for, through its voucher (``gradsync.checks.voucher``), while
a rank stopped there is still blamed after the timeout. Needs root and iproute2 (the emulated
cluster); skipped with the reason otherwise. The voucher on its own, without root:
tests/e2e/test_voucher.py; the same on one machine: tests/ranks/test_gate_hardening.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gradsync.cluster import Cluster, cleanup_stale, launch_on_cluster, requirements_missing
from tests.support import remote_liveness as worker
from tests.support.proctree import pids_in_netns

pytestmark = pytest.mark.e2e

MISSING = requirements_missing()
PREFIX = "gst-"  # as tests/e2e/test_cluster_e2e.py: never a user's cluster


@pytest.mark.skipif(MISSING is not None, reason=f"emulated cluster unavailable: {MISSING}")
@pytest.mark.timeout(180)
def test_a_rank_on_another_host_holding_the_gil_is_waited_for_and_a_stopped_one_blamed(
    tmp_path: Path,
) -> None:
    cluster = Cluster(hosts=2, link="1gbit", prefix=PREFIX)
    try:
        with cluster as c:
            inodes = {os.stat(f"/run/netns/{ns}").st_ino for ns in c.namespaces()}
            module = ["tests.support.remote_liveness"]
            rc = launch_on_cluster(c, module, 1, {worker.OUT_ENV: str(tmp_path)}, timeout_s=150)
            # Every rank has exited: its voucher goes with it, no one kills it here.
            deadline = time.monotonic() + 10
            while pids_in_netns(inodes) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = pids_in_netns(inodes)
    finally:
        cleanup_stale(PREFIX, cluster.tag)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r1["vouching"], "rank 1's voucher never wrote"
    # Before: "Rank 1 has not been heard from" (or "stopped responding") after 5 s.
    assert r0["error"] is None, r0["error"]
    assert r1["error"] is None, r1["error"]
    assert r0["params"] == r1["params"]
    assert r0["longest_step"] > worker.HOLD_S - 1, r0  # it did wait across the held GIL
    # The stopped rank: blamed after the timeout, not waited for as one in its own code.
    assert "Rank 1 stopped responding" in r0["stopped"], r0["stopped"]
    assert rc == 0
    assert left == [], f"processes left in the cluster's namespaces: {left}"
