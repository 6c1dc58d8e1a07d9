"""The synchronization dial on real gloo ranks: local SGD, DiLoCo, SSP and async."""

from __future__ import annotations

import time

import pytest
import torch

from gradsync.errors import SyncTimeoutError
from gradsync.testing import RankFailure, run_ranks
from tests import dial_ranks


@pytest.mark.timeout(150)
def test_periodic_strategies_reduce_to_bsp_and_local_sgd_and_send_one_hth() -> None:
    results = run_ranks(dial_ranks.equivalences, 2, timeout_s=120)
    r0, r1 = results
    # local:1 with plain SGD is BSP (averaging parameters after one step = averaging gradients)
    assert torch.allclose(r0["local:1"]["params"], r0["bsp"]["params"], rtol=0, atol=1e-12)
    # DiLoCo with outer lr 1 and no momentum lands on the average: local SGD
    assert torch.allclose(
        r0["diloco:4 plain"]["params"], r0["local:4"]["params"], rtol=0, atol=1e-12
    )
    # ...while the default outer Nesterov step really is different
    assert not torch.allclose(r0["diloco:4"]["params"], r0["local:4"]["params"])
    for name in ("bsp", "local:1", "local:4", "diloco:4"):
        assert torch.equal(r0[name]["params"], r1[name]["params"]), name
    # bytes: exactly 1/H of BSP's per step, and only at the synchronizing steps
    bsp_bytes = sum(r0["bsp"]["bytes"])
    for name in ("local:4", "diloco:4"):
        assert sum(r0[name]["bytes"]) * 4 == bsp_bytes, name
        assert [b > 0 for b in r0[name]["bytes"]] == [s % 4 == 3 for s in range(8)]
        assert r0[name]["barrier"] == [s % 4 == 3 for s in range(8)]
        assert all(
            i == 0 for i, b in zip(r0[name]["idle"], r0[name]["barrier"], strict=True) if not b
        )


@pytest.mark.timeout(150)
def test_ssp_zero_follows_the_synchronous_trajectory() -> None:
    ps = run_ranks(dial_ranks.ssp_zero, 3, timeout_s=120)  # 2 workers + 1 server (rank 2)
    bsp = run_ranks(dial_ranks.train, 2, "bsp", 10, timeout_s=120)
    assert "server" in ps[2]
    for w in (0, 1):
        assert torch.allclose(ps[w]["params"], bsp[0]["params"], rtol=1e-10, atol=1e-12)
    assert torch.equal(ps[0]["params"], ps[1]["params"])  # final parameters agree


@pytest.mark.timeout(200)
def test_ssp_bound_holds_and_async_exceeds_it() -> None:
    bound = 1
    ssp = run_ranks(dial_ranks.staleness, 3, f"ssp:{bound}", timeout_s=150)
    stats = ssp[2]["server"]
    assert len(stats.updates) == 2 * 16  # every gradient of both workers was applied
    assert max(u.staleness for u in stats.updates) <= bound
    assert min(u.staleness for u in stats.updates) >= 0
    # the fast worker (0) was held back: that wait is its idle
    assert sum(ssp[0]["idle"]) > sum(ssp[1]["idle"])
    asynchronous = run_ranks(dial_ranks.staleness, 3, "async", timeout_s=150)
    assert asynchronous[2]["server"].max_staleness > bound
    assert sum(asynchronous[0]["idle"]) < 0.05  # async never holds a worker back


@pytest.mark.timeout(120)
def test_server_rebuilds_adamw() -> None:
    results = run_ranks(dial_ranks.adamw_on_servers, 3, timeout_s=90)
    assert len(results[2]["server"].updates) == 2 * 4
    assert torch.equal(results[0]["params"], results[1]["params"])


@pytest.mark.timeout(120)
def test_dead_server_fails_workers_with_its_name_not_a_hang() -> None:
    t0 = time.monotonic()
    results = run_ranks(
        dial_ranks.server_dies, 3, timeout_s=90, collective_timeout_s=15, allow_failures=True
    )
    assert time.monotonic() - t0 < 60
    for w in (0, 1):
        assert isinstance(results[w], RankFailure)
        assert "parameter server rank 2" in str(results[w])
        assert SyncTimeoutError.__name__ in str(results[w])
