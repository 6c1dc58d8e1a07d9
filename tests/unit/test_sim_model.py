"""Alpha-beta collective costs, nccl-tests bandwidths and the alpha/beta fit, by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradsync.errors import UsageError
from gradsync.sim import AlphaBeta, algbw, busbw, collective_time, cost_terms, fit_alpha_beta

pytestmark = pytest.mark.unit

A, B, S = 1e-5, 1e-9, 1_000_000  # 10 us per message, 1 ns per byte (1 GB/s), 1 MB


@pytest.mark.parametrize(
    ("op", "algorithm", "n", "expected"),
    [
        # ring: 2(n-1) messages, each rank moves 2(n-1)/n of the buffer
        ("allreduce", "ring", 4, 6 * A + 1.5 * S * B),
        ("reducescatter", "ring", 4, 3 * A + 0.75 * S * B),
        ("allgather", "ring", 4, 3 * A + 0.75 * S * B),
        ("broadcast", "ring", 4, (2 + 3) * A + 1.5 * S * B),
        # binomial tree, whole messages: lg n rounds each way
        ("allreduce", "tree", 8, 6 * (A + S * B)),
        ("broadcast", "tree", 8, 3 * (A + S * B)),
        ("reducescatter", "tree", 8, 3 * (A + S * B) + 3 * A + 7 / 8 * S * B),
        ("allgather", "tree", 8, 3 * A + 7 / 8 * S * B + 3 * (A + S * B)),
        # binary tree in heap order, single-port, whole messages. n=7 (full): a parent
        # receives from its 2 children one after the other, 2 levels: 4 rounds up, 4 down.
        ("allreduce", "binary_tree", 7, 8 * (A + S * B)),
        ("broadcast", "binary_tree", 7, 4 * (A + S * B)),
        # n=2: one edge, 1 round each way; n=3: the root's 2 children, 2 rounds each way
        ("allreduce", "binary_tree", 2, 2 * (A + S * B)),
        ("allreduce", "binary_tree", 3, 4 * (A + S * B)),
        # n=4: 0->{1,2}, 1->{3}. Up: 3->1 and 2->0 in round 1, 1->0 in round 2. Down: 0->1,
        # then 0->2 and 1->3 together: 2 rounds.
        ("allreduce", "binary_tree", 4, 4 * (A + S * B)),
        # n=5: 0->{1,2}, 1->{3,4}. Up: 1 gets 3 then 4 (round 2), 0 gets 2 (round 1) then 1
        # (round 3). Down: 0->1, then 0->2 and 1->3, then 1->4: 3 rounds.
        ("allreduce", "binary_tree", 5, 6 * (A + S * B)),
        ("broadcast", "binary_tree", 5, 3 * (A + S * B)),
        # recursive halving-doubling (Rabenseifner)
        ("allreduce", "rhd", 8, 6 * A + 1.75 * S * B),
        ("reducescatter", "rhd", 8, 3 * A + 7 / 8 * S * B),
        ("allgather", "rhd", 8, 3 * A + 7 / 8 * S * B),
        ("broadcast", "rhd", 8, 6 * A + 1.75 * S * B),
    ],
)
def test_costs_match_hand_computed(op: str, algorithm: str, n: int, expected: float) -> None:
    assert collective_time(op, n, S, A, B, algorithm) == pytest.approx(expected, rel=1e-12)


def test_one_rank_costs_nothing() -> None:
    for algorithm in ("ring", "tree", "binary_tree", "rhd"):
        assert collective_time("allreduce", 1, S, A, B, algorithm) == 0.0


def test_binary_tree_is_the_binomial_trees_slower_cousin_without_pipelining() -> None:
    # Whole messages, one at a time: a binary tree pays two rounds per level where the
    # binomial tree pays one per doubling, so 4(log2(n+1) - 1) rounds against 2 log2 n.
    for k in (2, 3, 5, 10):
        n = 2**k - 1
        assert cost_terms("allreduce", "binary_tree", n) == (4.0 * (k - 1), 4.0 * (k - 1))
    assert collective_time("allreduce", 64, S, A, B, "binary_tree") > collective_time(
        "allreduce", 64, S, A, B, "tree"
    )
    with pytest.raises(UsageError, match="binary_tree models allreduce and broadcast only"):
        cost_terms("reducescatter", "binary_tree", 4)


def test_ring_beats_tree_on_bandwidth_and_tree_beats_ring_on_latency() -> None:
    big, small = 1 << 30, 8
    assert collective_time("allreduce", 64, big, A, B, "ring") < collective_time(
        "allreduce", 64, big, A, B, "tree"
    )
    assert collective_time("allreduce", 64, small, A, B, "tree") < collective_time(
        "allreduce", 64, small, A, B, "ring"
    )


def test_bandwidths_follow_nccl_tests() -> None:
    t = 2e-3
    assert algbw(S, t) == pytest.approx(5e8)
    assert busbw("allreduce", 8, S, t) == pytest.approx(5e8 * 2 * 7 / 8)
    assert busbw("reducescatter", 4, S, t) == pytest.approx(5e8 * 3 / 4)
    assert busbw("allgather", 4, S, t) == pytest.approx(5e8 * 3 / 4)
    assert busbw("broadcast", 4, S, t) == pytest.approx(5e8)


def test_ring_allreduce_busbw_equals_link_bandwidth_for_large_messages() -> None:
    # The point of busbw: it reads the link's speed whatever the rank count.
    for n in (2, 8, 64):
        t = collective_time("allreduce", n, 1 << 34, 0.0, B, "ring")
        assert busbw("allreduce", n, 1 << 34, t) == pytest.approx(1 / B)


def test_fit_recovers_exact_parameters() -> None:
    sizes = [4096 * 4**i for i in range(8)]
    for algorithm, n in (("ring", 4), ("tree", 8), ("binary_tree", 6), ("rhd", 16)):
        a, b = cost_terms("allreduce", algorithm, n)
        times = [a * 50e-6 + b * s * 2e-9 for s in sizes]
        fit = fit_alpha_beta(sizes, times, n=n, algorithm=algorithm)
        assert fit.alpha == pytest.approx(50e-6, rel=1e-9)
        assert fit.beta == pytest.approx(2e-9, rel=1e-9)
        assert fit.max_rel_error < 1e-9


def test_fit_recovers_parameters_through_noise() -> None:
    rng = np.random.default_rng(0)
    sizes = np.repeat([4096 * 4**i for i in range(8)], 5)
    true = 6 * 30e-6 + 1.5 * sizes * 1e-9
    noisy = true * (1 + rng.uniform(-0.03, 0.03, size=true.shape))
    fit = fit_alpha_beta(sizes.tolist(), noisy.tolist(), n=4)
    assert fit.alpha == pytest.approx(30e-6, rel=0.05)
    assert fit.beta == pytest.approx(1e-9, rel=0.05)
    assert fit.model().time("allreduce", 4, 1 << 20) == pytest.approx(
        6 * 30e-6 + 1.5 * (1 << 20) * 1e-9, rel=0.05
    )


def test_fit_rejects_degenerate_input() -> None:
    with pytest.raises(UsageError, match="two distinct"):
        fit_alpha_beta([1024, 1024], [1e-3, 1.1e-3], n=4)
    with pytest.raises(UsageError, match="positive"):
        fit_alpha_beta([1024, 4096], [1e-3, 0.0], n=4)
    with pytest.raises(UsageError, match="same length"):
        fit_alpha_beta([1024, 4096], [1e-3], n=4)


def test_bad_names_list_the_valid_ones() -> None:
    with pytest.raises(UsageError, match="ring, tree, binary_tree, rhd"):
        collective_time("allreduce", 4, S, A, B, "butterfly")
    with pytest.raises(UsageError, match="allreduce, reducescatter, allgather, broadcast"):
        cost_terms("alltoall", "ring", 4)
    with pytest.raises(UsageError, match="at least 1"):
        cost_terms("allreduce", "ring", 0)


def test_link_is_validated() -> None:
    with pytest.raises(UsageError, match="alpha"):
        AlphaBeta(alpha=-1.0, beta=1e-9)
    with pytest.raises(UsageError, match="beta"):
        AlphaBeta(alpha=0.0, beta=math.nan)
    assert AlphaBeta(alpha=0.0, beta=1e-9).bandwidth == pytest.approx(1e9)
