"""Where a run listens: a local `gradsync run` listens on loopback only, with or without elastic
restarts, and an emulated-cluster run only on its hosts' own addresses, never on every
interface (torch.distributed has no authentication: a reachable store is an open one).

The run's process tree is sampled while it runs: every listening TCP socket any of its
processes holds (/proc/PID/net/tcp and tcp6, matched to the process's descriptors;
tests/support/proctree.py). The restarting run is here. The other runs are watched where they
already run, so that no launch is made for this check alone (each costs seconds of start-up):
a local run without restarts in tests/e2e/test_stopped_worker.py (the Ctrl-C test: every
listener opens before its first step), and an emulated-cluster run and its loopback twin in
tests/e2e/test_cluster_run.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.proctree import assert_listens_on_loopback_only, describe_listeners, watched_run

pytestmark = pytest.mark.e2e

COMMON = ["--nproc", "2", "--workload", "mlp", "--no-plots", "--no-progress"]


@pytest.mark.timeout(300)
def test_a_restarting_run_listens_on_loopback_only_in_every_round(tmp_path: Path) -> None:
    # Rank 1 dies at step 17: the second round's rank 0 serves a new store of its own.
    watched, stderr = watched_run(
        *COMMON,
        *("--out", str(tmp_path / "run"), "--steps", "30", "--checkpoint-every", "10"),
        *("--max-restarts", "1", "--kill", "1:17"),
    )
    assert "restart: resuming at step 10" in stderr, stderr[-3000:]
    # Workers serve the store here (the agent shares none): the check must have seen theirs.
    # Spawned, or forked from the forkserver (which listens on no TCP socket of its own).
    in_workers = {
        entry
        for entry in watched.listeners
        if "spawn_main" in entry[2] or "multiprocessing.forkserver" in entry[2]
    }
    assert in_workers, "no worker's listener seen:\n  " + describe_listeners(watched.listeners)
    assert_listens_on_loopback_only(watched)
