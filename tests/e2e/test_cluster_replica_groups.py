"""``gradsync run --replica-groups 2 --hosts 2``: two replica groups, each on its own emulated
host (network namespaces, 1 Gbit/s links), the lighthouse inside host 0. Group 1's worker is
SIGKILLed mid-run and restarted by its own agent on its host; the replacement heals from group 0
across the emulated link; both end bitwise equal; and every listener of the run is on an
emulated host's own address (each group's on its host's) or a namespace's loopback, none on
every interface. The run itself is ``tests/e2e/test_replica_groups.py``'s kill/heal run, on
loopback there."""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradsync.cluster import cleanup_stale, requirements_missing
from gradsync.cluster.netns import DEFAULT_PREFIX, SUBNET
from tests.e2e.test_replica_groups import (
    KILL_AT,
    STEPS,
    _group0_unbroken_group1_restarted_once,
    _stop,
)
from tests.support.proctree import (
    Watched,
    assert_listens_on_hosts_only,
    describe_listeners,
    reaped_within,
    watch_until_exit,
)

pytestmark = pytest.mark.e2e

MISSING = requirements_missing()
CLUSTER_RE = re.compile(r"emulated cluster (\S+) of 2 hosts")


def _run_on_two_hosts(out: Path) -> tuple[str, Watched, list[str]]:
    """The kill/heal run of tests/e2e/test_replica_groups.py on two emulated hosts: its exit
    status checked, nothing left running, and its cluster removed whatever happened (a run
    killed by the test's timeout cannot remove it). Its stderr, what was seen of its tree,
    and its cluster's name. A short --timeout: a group that cannot reach a peer fails in
    seconds, not at the test's timeout."""
    log = out.parent / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gradsync", "run", "--hosts", "2", "--link", "1gbit"]
            + ["--replica-groups", "2", "--nproc", "1", "--min-replicas", "2"]
            + ["--workload", "mlp", "--params", "5000", "--steps", str(STEPS)]
            + ["--max-restarts", "1", "--kill", f"1:{KILL_AT}", "--timeout", "30"]
            + ["--no-plots", "--no-progress", "--out", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    watched, left_over = Watched(), []
    try:
        rc = watch_until_exit(proc, watched, timeout_s=100)
        left = [pid for pid in watched.survivors() if not reaped_within(pid, 10)]
    finally:
        _stop(proc, watched)
        found = CLUSTER_RE.search(log.read_text())
        if found:
            left_over = cleanup_stale(DEFAULT_PREFIX, found[1].removeprefix(DEFAULT_PREFIX))
    stderr = log.read_text()
    assert found, stderr[-4000:]
    assert rc == 0, stderr[-4000:]
    assert not left, f"still running after the run: {left}"
    return stderr, watched, left_over


@pytest.mark.skipif(MISSING is not None, reason=f"emulated cluster unavailable: {MISSING}")
@pytest.mark.timeout(150)
def test_replica_groups_on_two_emulated_hosts_heal_across_the_link(tmp_path: Path) -> None:
    out = tmp_path / "run"
    stderr, watched, left_over = _run_on_two_hosts(out)
    healed = _group0_unbroken_group1_restarted_once(out)
    assert [h["step"] for h in healed] == [KILL_AT], healed
    assert f"replica group 1 healed from a live peer: at step {KILL_AT}" in stderr, stderr[-4000:]
    a, b = (
        torch.load(out / g / "final_model.pt", weights_only=True) for g in ("group-0", "group-1")
    )
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key

    # The run removed the cluster it named: the test's own cleanup found nothing of it.
    assert not left_over, f"the run left its cluster behind: {left_over}"
    # Where things listened: the lighthouse on host 0's address, each group's torchft store
    # and Manager server on its host's (its peers on the other host dial them), the rest on a
    # namespace's loopback (each group's agent and ranks' own stores); nothing on a wildcard.
    host0, host1 = f"{SUBNET}.1", f"{SUBNET}.2"
    hosts = ipaddress.ip_network(f"{SUBNET}.0/24")
    seen = describe_listeners(watched.listeners)
    addresses = {entry[0].rpartition(":")[0] for entry in watched.listeners}
    assert_listens_on_hosts_only(watched.listeners, hosts)
    lighthouse = {e[0] for e in watched.listeners if "gradsync.membership.lighthouse" in e[2]}
    assert lighthouse and all(a.startswith(f"{host0}:") for a in lighthouse), seen
    assert host1 in addresses, "nothing listened on host 1's address:\n  " + seen
