"""The topology benchmark's rank placements (``benchmarks/topology_worker.py``), by hand: the
global rank of a node's local rank, its inverse, the flat ring's host crossings, the placement
check, and the cyclic flat ring's predicted time and bytes per host link
(``benchmarks/topology.py``)."""

from __future__ import annotations

import pytest

from benchmarks.topology import flat_ring_time, link_bytes
from benchmarks.topology_worker import (
    check_placement,
    host_of_rank,
    placement_rank,
    ring_crossings,
)
from gradsync.sim.model import AlphaBeta, collective_time, flat_allreduce_time

pytestmark = pytest.mark.unit

INTER = AlphaBeta(alpha=100e-6, beta=8 / 1e9)  # 1 Gbit/s between hosts
INTRA = AlphaBeta(alpha=20e-6, beta=0.5 / 1e9)
S = 12_000_000


@pytest.mark.parametrize(
    ("placement", "hosts", "per_host", "by_rank"),
    [
        # hosts_by_rank[r]: the node global rank r sits on
        ("contiguous", 2, 2, [0, 0, 1, 1]),
        ("cyclic", 2, 2, [0, 1, 0, 1]),
        ("contiguous", 4, 2, [0, 0, 1, 1, 2, 2, 3, 3]),
        ("cyclic", 4, 2, [0, 1, 2, 3, 0, 1, 2, 3]),
        ("cyclic", 2, 3, [0, 1, 0, 1, 0, 1]),
    ],
)
def test_placement_rank_and_its_host(
    placement: str, hosts: int, per_host: int, by_rank: list[int]
) -> None:
    ranks = {
        placement_rank(placement, node, local, hosts, per_host): node
        for node in range(hosts)
        for local in range(per_host)
    }
    assert sorted(ranks) == list(range(hosts * per_host))  # a permutation of the world
    assert [ranks[r] for r in range(hosts * per_host)] == by_rank
    assert [host_of_rank(placement, r, hosts, per_host) for r in ranks] == [ranks[r] for r in ranks]
    if placement == "cyclic":
        assert all(ranks[r] == r % hosts for r in ranks)


def test_placement_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError):
        placement_rank("block", 0, 0, 2, 2)
    with pytest.raises(ValueError):
        placement_rank("cyclic", 2, 0, 2, 2)
    with pytest.raises(ValueError):
        host_of_rank("cyclic", 4, 2, 2)


@pytest.mark.parametrize(
    ("by_rank", "expected"),
    [
        ([0, 0, 1, 1], 1),  # 1 -> 2 leaves host 0, 3 -> 0 leaves host 1
        ([0, 1, 0, 1], 2),  # every hop crosses: both of a host's ranks send across
        ([0, 0, 1, 1, 2, 2, 3, 3], 1),
        ([0, 1, 2, 3, 0, 1, 2, 3], 2),
        ([0, 0, 0, 0], 0),  # one host
        (["a", "b", "b", "a"], 1),  # any names: 0 -> 1 leaves a, 2 -> 3 leaves b
    ],
)
def test_ring_crossings(by_rank: list[object], expected: int) -> None:
    assert ring_crossings(by_rank) == expected


def _where(placement: str, hosts: int, per_host: int) -> list[dict[str, object]]:
    out = []
    for r in range(hosts * per_host):
        node = host_of_rank(placement, r, hosts, per_host)
        out.append(
            {
                "rank": r,
                "node": node,
                "hosts": hosts,
                "per_host": per_host,
                "netns": f"net:[{4026531000 + node}]",
                "cluster_host": str((node + 1) % hosts),  # the launcher may number hosts apart
            }
        )
    return out


def test_check_placement_accepts_cyclic_and_catches_a_wrong_one() -> None:
    where = _where("cyclic", 2, 2)
    assert check_placement("cyclic", where, [[0, 2], [1, 3]]) == []
    # The same processes judged as contiguous: rank 1 is on node 1, not 0.
    assert check_placement("contiguous", where, [[0, 2], [1, 3]])
    # Hierarchy grouped them by rank halves: wrong for cyclic.
    assert check_placement("cyclic", where, [[0, 1], [2, 3]])
    # Two nodes in one network namespace.
    bad = [dict(w) for w in where]
    bad[1]["netns"] = bad[0]["netns"]
    assert any("network namespace" in p for p in check_placement("cyclic", bad, [[0, 2], [1, 3]]))


def test_cyclic_flat_ring_prices_its_streams_on_the_host_link() -> None:
    # Contiguous: one stream per host link, the simulator's own model.
    assert flat_ring_time(2, 2, S, INTER, INTRA, 1) == flat_allreduce_time(2, 2, S, INTER, INTRA)
    # Cyclic 2 x 2: 2 streams share each host's port at every one of the ring's 2(N-1) steps.
    want = 2 * 3 * INTER.alpha + 2 * 3 / 4 * S * 2 * INTER.beta
    assert flat_ring_time(2, 2, S, INTER, INTRA, 2) == pytest.approx(want)
    assert flat_ring_time(4, 2, S, INTER, INTRA, 2) == pytest.approx(
        collective_time("allreduce", 8, S, INTER.alpha, 2 * INTER.beta)
    )


@pytest.mark.parametrize(
    ("n", "hosts", "crossings", "flat", "hier"),
    [
        (4, 2, 1, 1.5, 1.0),  # contiguous 2 x 2: ceiling 1.5x
        (4, 2, 2, 3.0, 1.0),  # cyclic 2 x 2: 3x
        (8, 4, 1, 1.75, 1.5),  # contiguous 4 x 2: 1.17x
        (8, 4, 2, 3.5, 1.5),  # cyclic 4 x 2: 2.33x
    ],
)
def test_link_bytes(n: int, hosts: int, crossings: int, flat: float, hier: float) -> None:
    assert link_bytes(n, hosts, crossings) == pytest.approx((flat, hier))
