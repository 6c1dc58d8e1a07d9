"""The emulated cluster for real: namespaces, links and an all-reduce through a rate-limited link
(root + iproute2 only; skipped with the reason otherwise). Its config validation:
tests/unit/test_cluster.py.

Tests use the prefix ``gst-`` and a random tag per cluster, so they never touch a cluster a
user brought up with the default ``gs-`` prefix, nor one of a concurrent test run."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradsync.cluster import Cluster, cleanup_stale, launch_on_cluster
from gradsync.cluster.system import requirements_missing
from tests.support.overlap import Overlapped, overlapped
from tests.support.proctree import pids_in_netns

pytestmark = pytest.mark.e2e

PREFIX = "gst-"


# -- real namespaces -----------------------------------------------------------------------


@pytest.fixture
def needs_netns() -> None:
    missing = requirements_missing()
    if missing:
        pytest.skip(missing)


def _netns_inodes(cluster: Cluster) -> set[int]:
    return {os.stat(f"/run/netns/{ns}").st_ino for ns in cluster.namespaces()}


def _assert_gone(cluster: Cluster, inodes: set[int], marker: str | None = None) -> None:
    namespaces = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    links = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    assert cluster.base not in namespaces
    assert cluster.base not in links
    assert pids_in_netns(inodes) == []
    if marker:
        # Also by command line: a worker that escaped its namespace would still be ours.
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                except OSError:
                    continue
                assert marker.encode() not in cmdline, f"process {entry} survived"


@pytest.fixture
def cluster_2x100(needs_netns: None) -> Iterator[Cluster]:
    cluster = Cluster(hosts=2, link="100mbit", prefix=PREFIX)
    try:
        yield cluster
    finally:
        cleanup_stale(PREFIX, cluster.tag)


@pytest.mark.timeout(90)
def test_allreduce_bandwidth_matches_the_link(cluster_2x100: Cluster, tmp_path: Path) -> None:
    """8 MB all-reduce between 2 hosts with 100 Mbit/s links, each direction limited by tbf.

    With 2 ranks a ring all-reduce sends and receives the whole buffer once per rank, in both
    directions at once, so busbw (= algbw * 2(n-1)/n = algbw) should approach the link rate:
    tbf counts whole Ethernet frames, so TCP payload is at most 1448/1514 = 96% of the rate,
    less ACKs and gloo's pipeline gaps (about 85-93% measured). The band 40%-110% catches a
    missing limit (loopback runs at many Gbit/s) or a broken one, not noise on a busy machine.
    """
    out = tmp_path / "probe.json"
    module = ["gradsync.cluster.allreduce_probe", "--size-mb", "8", "--iters", "3"]
    module += ["--out", str(out)]
    with cluster_2x100 as c:
        inodes = _netns_inodes(c)
        rc = launch_on_cluster(c, module, nproc_per_host=1, env={}, timeout_s=75)
        state = c.status()
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    assert sorted(r["ifname"] for r in result["ranks"]) == [h.ifname for h in c.host_list]
    fraction = result["busbw_bps"] / c.rate_bps
    print(f"busbw {result['busbw_bps'] / 1e6:.1f} Mbit/s = {fraction:.0%} of 100mbit")
    assert 0.4 <= fraction <= 1.1, f"busbw {result['busbw_bps'] / 1e6:.1f} Mbit/s"
    # The bytes really crossed the rate-limited interfaces (4 all-reduces of 8 MB each).
    assert state is not None
    assert all((h.sent_bytes or 0) >= 4 * 8e6 for h in state.hosts), state.format()
    _assert_gone(c, inodes, marker=str(out))


@pytest.mark.timeout(60)
def test_down_removes_a_crashed_cluster(needs_netns: None, tmp_path: Path) -> None:
    """``up`` without a context manager, a process left inside, then ``gradsync cluster down``
    (what a user runs after a crash) must leave nothing."""
    from gradsync.runner.cli import main

    c = Cluster(hosts=2, link="1gbit", prefix=PREFIX).up()
    leftover = None
    try:
        inodes = _netns_inodes(c)
        marker = str(tmp_path / "leftover-marker")
        leftover = subprocess.Popen(
            ["ip", "netns", "exec", c.host(1).netns, sys.executable, "-c",
             "import time, sys; time.sleep(600)", marker],
            start_new_session=True,
        )  # fmt: skip
        state = c.status()
        assert state is not None and [h.addr for h in state.hosts] == [
            "10.213.0.1/24",
            "10.213.0.2/24",
        ]
        assert all(h.qdisc == "tbf 1Gbit" for h in state.hosts), state.format()
        assert main(["cluster", "down", "--prefix", PREFIX, "--name", c.tag]) == 0
        assert leftover.wait(timeout=10) != 0  # killed, not finished
        _assert_gone(c, inodes, marker=marker)
    finally:
        if leftover is not None and leftover.poll() is None:
            leftover.kill()
        cleanup_stale(PREFIX, c.tag)


def _failing_worker() -> None:
    """A module that does not exist: every worker exits 1 at import, the agents report it;
    nothing is left."""
    cluster = Cluster(hosts=2, link="100mbit", prefix=PREFIX)
    try:
        with cluster as c:
            inodes = _netns_inodes(c)
            rc = launch_on_cluster(c, ["gradsync.cluster.no_such_module"], 1, {}, timeout_s=45)
        assert rc != 0
        _assert_gone(c, inodes)
    finally:
        cleanup_stale(PREFIX, cluster.tag)


def _timed_out_job(tmp_path: Path) -> None:
    """A job that cannot finish in time (50 MB through 10 Mbit/s takes 40 s per all-reduce)
    is killed at the deadline, workers included, and reported as 124."""
    c = Cluster(hosts=2, link="10mbit", prefix=PREFIX)
    marker = str(tmp_path / f"never-written-{c.tag}.json")
    module = ["gradsync.cluster.allreduce_probe", "--size-mb", "50", "--iters", "1"]
    module += ["--warmup", "0", "--out", marker]
    try:
        with c:
            inodes = _netns_inodes(c)
            # Past the workers' start-up (a few seconds), inside the 40 s all-reduce.
            rc = launch_on_cluster(c, module, 1, {}, timeout_s=8)
        assert rc == 124
        _assert_gone(c, inodes, marker=marker)
    finally:
        cleanup_stale(PREFIX, c.tag)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Overlapped]:
    """The last two tests' jobs at once (tests/support/overlap.py), each on a cluster of its
    own (namespaces, switch and addresses of its own tag): the timed-out one mostly waits for
    its deadline (its all-reduce is held to 10 Mbit/s), the failing one's workers fail at
    import. Neither measures anything; the bandwidth test above runs alone. Each test takes
    its job's outcome (its assertions' error, raised by ``result``)."""
    missing = requirements_missing()
    if missing:
        pytest.skip(missing)
    launches = {
        "failing": _failing_worker,
        "timeout": functools.partial(_timed_out_job, tmp_path_factory.mktemp("timeout")),
    }
    with overlapped(launches) as started:
        yield started


@pytest.mark.timeout(60)
def test_failing_worker_returns_its_code_and_leaves_nothing(jobs: Overlapped) -> None:
    jobs.result("failing")


@pytest.mark.timeout(60)
def test_timeout_kills_the_job(jobs: Overlapped) -> None:
    """A job that cannot finish in time (50 MB through 10 Mbit/s takes 40 s per all-reduce)
    is killed at the deadline, workers included, and reported as 124."""
    jobs.result("timeout")
