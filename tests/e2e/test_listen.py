"""Where a run listens: a local `gradsync run` listens on loopback only, with or without elastic
restarts, and an emulated-cluster run only on its hosts' own addresses, never on every
interface (torch.distributed has no authentication: a reachable store is an open one).

The run's process tree is sampled while it runs: every listening TCP socket any of its
processes holds (/proc/PID/net/tcp and tcp6, matched to the process's descriptors)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from gradsync.cluster import requirements_missing
from gradsync.cluster.netns import SUBNET
from tests.support.proctree import Watched, is_loopback, start_run, watch_until_exit

pytestmark = pytest.mark.e2e

COMMON = ["--nproc", "2", "--workload", "mlp", "--no-plots", "--no-progress"]


def _watched_run(out: Path, *extra: str, timeout_s: float = 200) -> tuple[Watched, str]:
    proc = start_run(*COMMON, "--out", str(out), *extra)
    watched = Watched()
    try:
        rc = watch_until_exit(proc, watched, timeout_s)
    finally:
        watched.kill_all()
        proc.kill()
        _, stderr = proc.communicate(timeout=30)
    assert rc == 0, stderr[-3000:]
    return watched, stderr


def _describe(listeners: set[tuple[str, int, str]]) -> str:
    return "\n  ".join(f"{addr} (pid {pid}: {cmd})" for addr, pid, cmd in sorted(listeners))


@pytest.mark.timeout(240)
def test_a_local_run_listens_on_loopback_only(tmp_path: Path) -> None:
    watched, _ = _watched_run(tmp_path / "run", "--steps", "40")
    assert watched.listeners, (
        f"no listener seen in {watched.samples} samples: the check saw nothing"
    )
    outside = {entry for entry in watched.listeners if not is_loopback(entry[0])}
    assert not outside, "listening beyond loopback:\n  " + _describe(outside)


@pytest.mark.timeout(300)
def test_a_restarting_run_listens_on_loopback_only_in_every_round(tmp_path: Path) -> None:
    # Rank 1 dies at step 17: the second round's rank 0 serves a new store of its own.
    watched, stderr = _watched_run(
        tmp_path / "run",
        *("--steps", "30", "--checkpoint-every", "10", "--max-restarts", "1", "--kill", "1:17"),
    )
    assert "restart: resuming at step 10" in stderr, stderr[-3000:]
    # Workers serve the store here (the agent shares none): the check must have seen theirs.
    # Spawned, or forked from the forkserver (which listens on no TCP socket of its own).
    in_workers = {
        entry
        for entry in watched.listeners
        if "spawn_main" in entry[2] or "multiprocessing.forkserver" in entry[2]
    }
    assert in_workers, "no worker's listener seen:\n  " + _describe(watched.listeners)
    outside = {entry for entry in watched.listeners if not is_loopback(entry[0])}
    assert not outside, "listening beyond loopback:\n  " + _describe(outside)


MISSING = requirements_missing()


@pytest.mark.skipif(MISSING is not None, reason=f"emulated cluster unavailable: {MISSING}")
@pytest.mark.timeout(300)
def test_a_cluster_run_listens_on_its_hosts_addresses_only(tmp_path: Path) -> None:
    watched, _ = _watched_run(tmp_path / "run", "--steps", "12", "--hosts", "2")
    assert watched.listeners, (
        f"no listener seen in {watched.samples} samples: the check saw nothing"
    )
    # Loopback inside a host's namespace is that host's own; else only the emulated hosts'
    # addresses (their namespaces hold nothing else: a wildcard socket is what this catches).
    hosts = ipaddress.ip_network(f"{SUBNET}.0/24")
    outside = {
        entry
        for entry in watched.listeners
        if not is_loopback(entry[0])
        and ipaddress.ip_address(entry[0].rpartition(":")[0]) not in hosts
    }
    assert not outside, "listening beyond the hosts' addresses:\n  " + _describe(outside)
