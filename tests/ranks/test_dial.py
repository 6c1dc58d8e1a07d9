"""The synchronization dial on real gloo ranks: local SGD, DiLoCo, SSP and async."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gradsync.errors import SyncTimeoutError
from gradsync.testing import RankFailure, run_ranks
from tests.support import dial_ranks
from tests.support.overlap import Overlapped, overlapped, ranks

pytestmark = pytest.mark.ranks


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


@pytest.mark.timeout(200)
def test_ssp_zero_follows_the_synchronous_trajectory_with_one_and_two_servers() -> None:
    bsp = run_ranks(dial_ranks.train, 2, "bsp", 10, timeout_s=120)
    for servers in (1, 2):
        # 2 workers + the servers (ranks 2 and up), which shard the parameters between them
        ps = run_ranks(dial_ranks.ssp_zero, 2 + servers, servers, timeout_s=120)
        stats = [ps[2 + s]["server"] for s in range(servers)]
        assert all(len(st.updates) == 2 * 10 for st in stats)  # every push reached every server
        for w in (0, 1):
            assert torch.allclose(ps[w]["params"], bsp[0]["params"], rtol=1e-10, atol=1e-12)
        assert torch.equal(ps[0]["params"], ps[1]["params"])  # final parameters agree


@pytest.mark.timeout(200)
def test_servers_keep_param_groups_and_follow_the_workers_lr_schedule() -> None:
    # Two groups (weights, biases) with different lrs, decayed by a scheduler on the workers;
    # two servers, each holding tensors of both groups. Under ssp:0 plain SGD is BSP's
    # trajectory only if every tensor is stepped with its own group's lr at that step.
    bsp = run_ranks(dial_ranks.scheduled_groups, 2, "bsp", timeout_s=120)
    ps = run_ranks(dial_ranks.scheduled_groups, 4, "ssp:0", 2, timeout_s=120)
    for w in (0, 1):
        assert torch.allclose(ps[w]["params"], bsp[0]["params"], rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(200)
def test_ssp_bound_holds_and_async_exceeds_it() -> None:
    bound = 1
    specs = [f"ssp:{bound}", "async"]
    by_rank = run_ranks(dial_ranks.staleness_each, 3, specs, timeout_s=180)
    ssp, asynchronous = ([out[spec] for out in by_rank] for spec in specs)
    stats = ssp[2]["server"]
    assert len(stats.updates) == 2 * 16  # every gradient of both workers was applied
    assert max(u.staleness for u in stats.updates) <= bound
    assert min(u.staleness for u in stats.updates) >= 0
    # the fast worker (0) was held back: that wait is its idle
    assert sum(ssp[0]["idle"]) > sum(ssp[1]["idle"])
    assert asynchronous[2]["server"].max_staleness > bound
    assert sum(asynchronous[0]["idle"]) == 0.0  # async never holds a worker back (README)


@pytest.mark.timeout(120)
def test_server_rebuilds_adamw() -> None:
    results = run_ranks(dial_ranks.adamw_on_servers, 3, timeout_s=90)
    assert len(results[2]["server"].updates) == 2 * 4
    assert torch.equal(results[0]["params"], results[1]["params"])


TIMEOUT_S = 4.0  # the workers' configured timeout in the failure tests
SLACK_S = 5.0  # what a failure may take beyond it on a loaded machine


@pytest.fixture(scope="module")
def server_failures() -> Iterator[Overlapped]:
    """The dead server's launch and the hung one's, started at once (tests/support/overlap.py):
    each mostly waits out the workers' timeout, and the waits overlap."""
    launches = {
        "dies": ranks(dial_ranks.server_dies, 3, TIMEOUT_S, timeout_s=90, allow_failures=True),
        "hangs": ranks(dial_ranks.server_hangs, 3, TIMEOUT_S, timeout_s=90),
    }
    with overlapped(launches) as out:
        yield out


@pytest.mark.timeout(120)
def test_dead_server_fails_workers_with_its_name_not_a_hang(server_failures: Overlapped) -> None:
    results = server_failures.result("dies")
    assert isinstance(results[2], RankFailure)  # the server killed itself
    for w in (0, 1):
        error, seconds = results[w]["error"], results[w]["seconds"]
        assert error is not None and error.startswith(SyncTimeoutError.__name__), error
        assert "parameter server rank 2" in error
        assert seconds < TIMEOUT_S + SLACK_S, seconds


@pytest.mark.timeout(120)
def test_hung_server_fails_workers_within_the_timeout_naming_it(
    server_failures: Overlapped,
) -> None:
    # Alive, its connections open, but it never answers: only the timeout can tell.
    results = server_failures.result("hangs")
    for w in (0, 1):
        error, seconds = results[w]["error"], results[w]["seconds"]
        assert error is not None and error.startswith(SyncTimeoutError.__name__), error
        assert "parameter server rank 2" in error
        assert TIMEOUT_S <= seconds < TIMEOUT_S + SLACK_S, seconds


@pytest.mark.timeout(60)
def test_more_servers_than_parameter_tensors_is_refused_on_every_rank() -> None:
    for message in run_ranks(dial_ranks.too_many_servers, 3, timeout_s=45):
        assert "2 parameter servers for a model with 1 trainable parameter tensor" in message
        assert "use at most 1 server" in message
