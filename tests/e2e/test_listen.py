"""Where a run listens: a local `gradsync run` listens on loopback only, with or without elastic
restarts, and an emulated-cluster run only on its hosts' own addresses, never on every
interface (torch.distributed has no authentication: a reachable store is an open one).

The run's process tree is sampled while it runs: every listening TCP socket any of its
processes holds (/proc/PID/net/tcp and tcp6, matched to the process's descriptors;
tests/support/proctree.py). The restarting run is here, the one tests/e2e/conftest.py makes
for test_fault_e2e and test_restart_telemetry_e2e too. The other runs are watched where they
already run, so that no launch is made for this check alone (each costs seconds of start-up):
a local run without restarts in tests/e2e/test_stopped_worker.py (the Ctrl-C test: every
listener opens before its first step), and an emulated-cluster run and its loopback twin in
tests/e2e/test_cluster_run.py."""

from __future__ import annotations

import pytest

from tests.support.proctree import assert_listens_on_loopback_only, describe_listeners
from tests.support.shared_runs import SharedRun

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_a_restarting_run_listens_on_loopback_only_in_every_round(
    killed_bsp_run: SharedRun,
) -> None:
    # The shared killed run (tests/e2e/conftest.py), watched all along: rank 1 dies at step
    # 17, and the second round's rank 0 serves a new store of its own.
    watched, stderr = killed_bsp_run.watched, killed_bsp_run.stderr
    assert watched is not None
    assert "restart: resuming at step " in stderr, stderr[-3000:]
    # Workers serve the store here (the agent shares none): the check must have seen theirs.
    # Spawned, or forked from the forkserver (which listens on no TCP socket of its own).
    in_workers = {
        entry
        for entry in watched.listeners
        if "spawn_main" in entry[2] or "multiprocessing.forkserver" in entry[2]
    }
    assert in_workers, "no worker's listener seen:\n  " + describe_listeners(watched.listeners)
    assert_listens_on_loopback_only(watched)
