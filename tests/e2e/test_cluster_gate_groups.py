"""The step gate in groups (gradsync.checks.gate_groups, issue 44) across emulated hosts: a rank
on one host reaches the group store a rank on the other serves, at the address that rank
reaches the world's store by, and a rank evaluating past the timeout is waited for. Needs root
and iproute2 (the emulated cluster); skipped with the reason otherwise. On one machine:
tests/ranks/test_gate_groups.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.cluster import Cluster, cleanup_stale, launch_on_cluster, requirements_missing
from tests.support import remote_gate_groups as worker

pytestmark = pytest.mark.e2e

MISSING = requirements_missing()
PREFIX = "gsg-"  # as tests/e2e/test_cluster_e2e.py: never a user's cluster


@pytest.mark.skipif(MISSING is not None, reason=f"emulated cluster unavailable: {MISSING}")
@pytest.mark.timeout(180)
def test_a_rank_reaches_its_group_store_on_another_host(tmp_path: Path) -> None:
    cluster = Cluster(hosts=2, link="1gbit", prefix=PREFIX)
    try:
        with cluster as c:
            module = ["tests.support.remote_gate_groups"]
            rc = launch_on_cluster(c, module, 2, {worker.OUT_ENV: str(tmp_path)}, timeout_s=150)
    finally:
        cleanup_stale(PREFIX, cluster.tag)
    assert rc == 0
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [s["steps"] for s in seen] == [worker.STEPS] * 4
    assert all(s["params"] == seen[0]["params"] for s in seen)
    assert [s["group"] for s in seen] == [[0, 1, 2]] * 3 + [[3]]
    assert [s["serves"] for s in seen] == [True, False, False, False]
    # rank 2 is on the other host (its network namespace) than rank 0, which serves its store
    assert seen[2]["machine"] != seen[0]["machine"] == seen[1]["machine"]
