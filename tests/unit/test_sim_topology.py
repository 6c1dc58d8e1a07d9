"""The cost model's reduce and its two-level all-reduce (``gradsync.topology``), by hand.

Hierarchical = reduce over the L ranks of a host + all-reduce over the H leaders + broadcast
over the L ranks; flat = one ring all-reduce over N = H L ranks paced by the slow link
(docs/simulator.md). Every expected figure is written out here, not taken from
``gradsync.sim.model``, so a wrong formula there is caught too.
"""

from __future__ import annotations

import pytest

from gradsync.errors import UsageError
from gradsync.sim.model import (
    AlphaBeta,
    busbw,
    collective_time,
    cost_terms,
    flat_allreduce_time,
    hierarchical_allreduce_time,
)

pytestmark = pytest.mark.unit

S = 12_000_000  # bytes, the benchmark's gradient
INTER = AlphaBeta(alpha=100e-6, beta=8 / 1e9)  # 1 Gbit/s between hosts
INTRA = AlphaBeta(alpha=20e-6, beta=0.5 / 1e9)  # 16 Gbit/s inside a host


@pytest.mark.parametrize(
    ("algorithm", "n", "expected"),
    [
        # ring reduce-scatter (n-1 rounds) then a binomial gather (lg rounds), S moved twice
        ("ring", 2, (1 + 1, 2 * 1 / 2)),
        ("ring", 4, (3 + 2, 2 * 3 / 4)),
        ("ring", 8, (7 + 3, 2 * 7 / 8)),
        # binomial tree of whole messages: lg rounds
        ("tree", 2, (1, 1)),
        ("tree", 8, (3, 3)),
        # recursive halving then binomial gather
        ("rhd", 4, (2 * 2, 2 * 3 / 4)),
        ("ring", 1, (0, 0)),
    ],
)
def test_reduce_terms(algorithm: str, n: int, expected: tuple[float, float]) -> None:
    assert cost_terms("reduce", algorithm, n) == pytest.approx(expected, rel=1e-12)


def test_reduce_mirrors_broadcast_and_counts_as_busbw_one() -> None:
    for algorithm in ("ring", "tree", "rhd"):
        for n in (2, 3, 5, 8):
            assert cost_terms("reduce", algorithm, n) == cost_terms("broadcast", algorithm, n)
    assert busbw("reduce", 4, 1000, 1.0) == 1000.0  # nccl-tests: busbw = algbw for reduce


def test_binary_tree_reduce_is_refused() -> None:
    with pytest.raises(UsageError, match="binary_tree models"):
        cost_terms("reduce", "binary_tree", 4)


@pytest.mark.parametrize(("hosts", "per_host"), [(2, 2), (4, 2), (2, 4), (3, 3)])
def test_hierarchical_is_reduce_plus_leaders_allreduce_plus_broadcast(
    hosts: int, per_host: int
) -> None:
    h, L = hosts, per_host
    lg = {2: 1, 3: 2, 4: 2}[L]
    reduce = (L - 1 + lg) * INTRA.alpha + 2 * (L - 1) / L * S * INTRA.beta
    leaders = 2 * (h - 1) * INTER.alpha + 2 * (h - 1) / h * S * INTER.beta
    broadcast = (lg + L - 1) * INTRA.alpha + 2 * (L - 1) / L * S * INTRA.beta
    got = hierarchical_allreduce_time(h, L, S, INTER, INTRA)
    assert got == pytest.approx(reduce + leaders + broadcast, rel=1e-12)


@pytest.mark.parametrize(("hosts", "per_host"), [(2, 2), (4, 2), (2, 4)])
def test_flat_ring_is_paced_by_the_inter_host_link(hosts: int, per_host: int) -> None:
    n = hosts * per_host
    expected = 2 * (n - 1) * INTER.alpha + 2 * (n - 1) / n * S * INTER.beta
    assert flat_allreduce_time(hosts, per_host, S, INTER, INTRA) == pytest.approx(
        expected, rel=1e-12
    )
    # The order of the links does not matter: the slower one paces the ring.
    assert flat_allreduce_time(hosts, per_host, S, INTRA, INTER) == pytest.approx(
        expected, rel=1e-12
    )


def test_flat_ring_step_is_the_slower_link_whole_not_the_worst_of_each_parameter() -> None:
    # Slow, low-latency link between hosts; fast but high-latency path inside them (a busy
    # CPU): a step costs alpha + S/N beta on either link, and the ring waits for the slower.
    inter = AlphaBeta(alpha=10e-6, beta=8 / 1e9)
    intra = AlphaBeta(alpha=2e-3, beta=1 / 1e9)
    n = 8
    on_inter = 2 * (n - 1) * (10e-6 + S / n * 8 / 1e9)  # 14 x 12.01 ms
    on_intra = 2 * (n - 1) * (2e-3 + S / n * 1 / 1e9)  # 14 x 3.5 ms
    assert on_inter > on_intra
    got = flat_allreduce_time(4, 2, S, inter, intra)
    assert got == pytest.approx(on_inter, rel=1e-12)
    # A tiny message: now the latency-bound intra-host path paces the ring.
    small = 1000
    on_intra_small = 2 * (n - 1) * (2e-3 + small / n * 1 / 1e9)
    assert flat_allreduce_time(4, 2, small, inter, intra) == pytest.approx(on_intra_small)


def test_one_host_is_all_intra_and_one_rank_per_host_is_all_inter() -> None:
    n = 4
    intra_ring = 2 * (n - 1) * INTRA.alpha + 2 * (n - 1) / n * S * INTRA.beta
    assert flat_allreduce_time(1, n, S, INTER, INTRA) == pytest.approx(intra_ring, rel=1e-12)
    # With one host the leaders' all-reduce is free: reduce + broadcast over the host.
    lg = 2
    two_way = 2 * ((n - 1 + lg) * INTRA.alpha + 2 * (n - 1) / n * S * INTRA.beta)
    assert hierarchical_allreduce_time(1, n, S, INTER, INTRA) == pytest.approx(two_way)
    # One rank per host: no intra-host step, the leaders are everyone.
    inter_ring = 2 * (n - 1) * INTER.alpha + 2 * (n - 1) / n * S * INTER.beta
    assert hierarchical_allreduce_time(n, 1, S, INTER, INTRA) == pytest.approx(inter_ring)


def test_speedup_bound_is_the_ratio_of_bytes_per_host_link() -> None:
    # Free intra-host steps and no latency: flat / hierarchical = (2(N-1)/N) / (2(H-1)/H).
    inter, free = AlphaBeta(alpha=0.0, beta=8 / 1e9), AlphaBeta(alpha=0.0, beta=0.0)
    for h, L, bound in ((2, 2, 1.5), (4, 2, 1.75 / 1.5), (2, 8, 1.875)):
        ratio = flat_allreduce_time(h, L, S, inter, free) / hierarchical_allreduce_time(
            h, L, S, inter, free
        )
        assert ratio == pytest.approx(bound, rel=1e-12)


def test_other_algorithms_and_bad_shapes() -> None:
    tree = AlphaBeta(alpha=INTER.alpha, beta=INTER.beta, algorithm="tree")
    # binomial tree all-reduce over 4 ranks: 2 lg = 4 whole-message rounds at the slow link
    assert flat_allreduce_time(2, 2, S, tree, INTRA) == pytest.approx(
        4 * (INTER.alpha + S * INTER.beta), rel=1e-12
    )
    assert collective_time("reduce", 2, S, 0.0, 1.0) == pytest.approx(S)
    for fn in (flat_allreduce_time, hierarchical_allreduce_time):
        with pytest.raises(UsageError, match="at least 1 host"):
            fn(0, 2, S, INTER, INTRA)
        with pytest.raises(UsageError, match="at least 1 host"):
            fn(2, 0, S, INTER, INTRA)
