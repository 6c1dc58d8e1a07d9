"""`gradsync run --hosts`: the training workers on an emulated cluster, end to end, and where
they listen (tests/e2e/test_listen.py says why that is checked)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
from pathlib import Path

import pytest

from gradsync.cluster import requirements_missing
from gradsync.cluster.netns import SUBNET
from tests.support.proctree import (
    assert_listens_on_hosts_only,
    assert_listens_on_loopback_only,
    watched_run,
)
from tests.support.shared_runs import USER_SCRIPT_COMMAND, USER_SCRIPT_STEPS, SharedRun

pytestmark = pytest.mark.e2e

MISSING = requirements_missing()


@pytest.mark.skipif(MISSING is not None, reason=f"emulated cluster unavailable: {MISSING}")
@pytest.mark.timeout(300)
def test_a_script_on_two_emulated_hosts_matches_loopback_and_cleans_up(
    tmp_path: Path, user_script_run: SharedRun
) -> None:
    """A user's script (the built-in workloads are one too, started the same way) on two
    emulated hosts ends where the same script on loopback ends, with host 1's rank killed at
    step 6 and every host's agent restarting its workers from the script's checkpoint
    (--max-restarts across hosts); each run listens only where it should: the cluster run on
    its hosts' addresses, the loopback run on loopback. The loopback run is the session's
    (tests/e2e/conftest.py, which test_script_run reads too: its slowed rank changes no
    number)."""
    args = ["--nproc", "2", "--no-plots", "--no-progress"]
    on_hosts, _ = watched_run(
        "--hosts", "2", "--link", "200mbit", "--out", str(tmp_path / "h"),
        "--kill", "1:6", "--max-restarts", "1", *args, *USER_SCRIPT_COMMAND,
    )  # fmt: skip
    assert user_script_run.watched is not None
    local = user_script_run.watched
    a = json.loads((tmp_path / "h" / "report.json").read_text())
    b = json.loads((user_script_run.out / "report.json").read_text())
    assert a["final_loss"] == b["final_loss"]  # same math, only the network differs
    assert (tmp_path / "h" / "faults" / "kill-rank1-step6.json").exists()  # it did fire
    assert a["steps"] == USER_SCRIPT_STEPS and len(a["ranks"]) == 2
    assert (tmp_path / "h" / "final.pt").exists()  # the script's own output, in its run dir
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "gs-" not in netns

    assert on_hosts.listeners, f"no listener seen in {on_hosts.samples} samples"
    # Loopback inside a host's namespace is that host's own; else only the emulated hosts'
    # addresses (their namespaces hold nothing else: a wildcard socket is what this catches).
    hosts = ipaddress.ip_network(f"{SUBNET}.0/24")
    assert_listens_on_hosts_only(on_hosts.listeners, hosts)
    assert_listens_on_loopback_only(local)
