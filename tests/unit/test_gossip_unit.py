"""Who gossips with whom (``gradsync.strategies.gossip.partner``), and what gossip refuses."""

from __future__ import annotations

import numpy as np
import pytest

from gradsync.errors import UsageError
from gradsync.pairing import partner
from gradsync.sim.config import CommModel
from gradsync.sim.simulate import SimResult, simulate
from gradsync.spec import parse_strategy_spec
from gradsync.strategies import parse_strategy
from gradsync.strategies.factory import check_compression
from gradsync.strategies.gossip import Gossip, NoLoCo

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 8, 16])
def test_each_round_is_a_matching_every_rank_computes_alike(world: int) -> None:
    for round_ in range(12):
        peers = [partner(r, world, round_) for r in range(world)]
        for rank, peer in enumerate(peers):
            if peer is not None:
                assert peer != rank and peers[peer] == rank  # symmetric
        assert peers.count(None) == world % 2  # one sits out only when the world is odd


def test_a_power_of_two_world_walks_the_hypercube() -> None:
    assert [partner(5, 8, r) for r in range(4)] == [4, 7, 1, 4]
    assert partner(0, 1, 0) is None


def test_the_spec_parses_and_refuses_alike() -> None:
    assert parse_strategy_spec("gossip:4").period == 4
    strategy = parse_strategy("gossip:4")
    assert isinstance(strategy, Gossip) and strategy.barrier_free
    with pytest.raises(UsageError, match=r"strategy 'gossip:0'.*H must be an integer >= 1"):
        parse_strategy("gossip:0")
    for quantizer in ("fp16", "bf16", "int8", "int4"):
        check_compression("gossip:4", quantizer)  # the codecs that approximate every element
    for other in ("topk:0.01", "randomk:0.01", "sign", "powersgd:2", "sparseloco"):
        with pytest.raises(
            UsageError,
            match=rf"gossip:4 exchanges the parameters themselves .* compresses them with "
            rf"fp16, bf16, int8, int4 only \(got {other}\).*or {other} with local:H or diloco:H",
        ):
            check_compression("gossip:4", other)


def _simulate(strategy: str, compute: np.ndarray, comm_ms: float) -> SimResult:
    return simulate(strategy, compute, CommModel(comm_ms=comm_ms))


def test_the_simulator_charges_a_pair_exchange_per_round_and_one_average_at_the_end() -> None:
    result = _simulate("gossip:4", np.full((8, 4), 100.0), 10.0)
    # 8 steps of 100 ms, 2 rounds of a 10 ms pair exchange, one 10 ms all-reduce at the end
    assert result.wall_ms == pytest.approx(800 + 2 * 10 + 10)
    assert result.idle_ms.sum() == 0.0


def test_a_slow_worker_holds_back_its_partners_not_the_whole_group() -> None:
    compute = np.full((8, 8), 100.0)
    compute[3, 0] = 400.0  # worker 0 slow once, in the first round
    gossip = _simulate("gossip:4", compute, 10.0)
    local = _simulate("local:4", compute, 10.0)
    # local:4 makes all 8 workers wait at the first average; gossip only worker 0's partner
    # (worker 1 in the hypercube's first round), the rest later and by less
    first_round = gossip.idle_ms[3]
    assert first_round[1] == pytest.approx(300.0) and first_round[2:].sum() == 0.0
    assert local.idle_ms[3][1:].sum() == pytest.approx(7 * 300.0)
    # with slowdowns now here, now there, the waits do not add up as the group's do
    rng = np.random.default_rng(0)
    noisy = 100.0 * np.where(rng.random((64, 16)) < 0.05, 3.0, 1.0)
    assert _simulate("gossip:4", noisy, 10.0).wall_ms < _simulate("local:4", noisy, 10.0).wall_ms


def test_on_hosts_a_pair_exchange_shares_its_hosts_link() -> None:
    # 8 workers on 4 hosts (issue 46's gossip question): each round a host's two ranks each
    # send a model through the host's link at once; it ran (priced no pair) before
    from gradsync.sim.config import Hosts
    from gradsync.sim.model import AlphaBeta

    link, nbytes = AlphaBeta(alpha=0.0, beta=8e-8), 4e6  # 100 Mbit/s, 4 MB
    comm = CommModel(link=link, nbytes=nbytes, hosts=Hosts(hosts=4, intra=link))
    assert comm.pair_ms(8) == pytest.approx(1000 * link.time("broadcast", 2, 2 * nbytes))
    assert CommModel(link=link, nbytes=nbytes).pair_ms(8) == pytest.approx(
        1000 * link.time("broadcast", 2, nbytes)
    )
    result = simulate("gossip:4", np.full((8, 8), 13.0), comm)
    assert result.wall_ms > 8 * 13.0 + 2 * comm.pair_ms(8)


def test_the_simulator_refuses_what_it_does_not_price_for_gossip() -> None:
    with pytest.raises(UsageError, match="gossip:4 exchanges whole parameters between pairs"):
        simulate("gossip:4", np.full((4, 2), 1.0), CommModel(comm_ms=1.0), comm_steps=np.ones(4))


def test_the_simulator_prices_a_compressed_pair_exchange_and_an_exact_final_average() -> None:
    """A compression ratio shrinks the pair exchange's bytes; the average at the end, which the
    runtime makes uncompressed, keeps the whole model's."""
    from gradsync.sim.config import Hosts
    from gradsync.sim.model import AlphaBeta

    link, nbytes = AlphaBeta(alpha=0.0, beta=8e-8), 4e6  # 100 Mbit/s, 4 MB
    plain = CommModel(link=link, nbytes=nbytes, hosts=Hosts(hosts=4, intra=link))
    int8 = CommModel(link=link, nbytes=nbytes, hosts=Hosts(hosts=4, intra=link), ratio=4.0)
    assert int8.pair_ms(8) == pytest.approx(plain.pair_ms(8) / 4)
    assert CommModel(comm_ms=10.0, ratio=2.0).pair_ms(2) == pytest.approx(5.0)
    compute = np.full((8, 8), 13.0)
    cheap, dear = simulate("gossip:4", compute, int8), simulate("gossip:4", compute, plain)
    # two rounds, each three quarters cheaper; the same final all-reduce in both
    assert dear.wall_ms - cheap.wall_ms == pytest.approx(2 * (plain.pair_ms(8) - int8.pair_ms(8)))


def test_noloco_parses_with_the_outer_options_and_refuses_the_rest() -> None:
    assert str(parse_strategy_spec("noloco:4")) == "noloco:4"
    assert str(parse_strategy_spec("noloco:4:outer_momentum=0.5")) == "noloco:4:outer_momentum=0.5"
    strategy = parse_strategy("noloco:4:outer_lr=0.5")
    assert isinstance(strategy, NoLoCo) and strategy.barrier_free and strategy.period == 4
    assert (strategy.outer.outer_lr, strategy.outer.outer_momentum) == (0.5, 0.9)
    with pytest.raises(UsageError, match=r"noloco takes H and the outer options only"):
        parse_strategy("noloco:4:2")
    with pytest.raises(UsageError, match=r"outer_momentum=1 must be a number from 0 to below 1"):
        parse_strategy("noloco:4:outer_momentum=1")
    check_compression("noloco:4", "int8")
    with pytest.raises(UsageError, match=r"noloco:4 exchanges the parameters themselves"):
        check_compression("noloco:4", "topk:0.1")


def test_noloco_outer_step_is_momentum_on_the_slow_weights() -> None:
    """m <- b m + a (mean - phi), phi <- phi + m, parameters <- phi, round after round; a rank
    sitting a round out takes its own parameters for the mean."""
    import torch

    a, b = 0.5, 0.8
    strategy = NoLoCo(2, outer_lr=a, outer_momentum=b)
    param = torch.zeros(3, dtype=torch.float64)
    strategy._params = [param]
    strategy._slow = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    strategy._momentum = torch.zeros(3, dtype=torch.float64)
    phi, m = strategy._slow.clone(), torch.zeros(3, dtype=torch.float64)
    for mean in ([2.0, 2.0, 2.0], [0.0, 1.0, -1.0]):
        mean_t = torch.tensor(mean, dtype=torch.float64)
        m = b * m + a * (mean_t - phi)
        phi = phi + m
        strategy._apply_round(mean_t.clone())
        assert torch.allclose(param, phi, rtol=0, atol=1e-15)
        assert torch.allclose(strategy._slow, phi, rtol=0, atol=1e-15)
    param.add_(1.0)  # local steps, then a round without a partner
    m = b * m + a * (param - phi)
    phi = phi + m
    strategy._sat_out()
    assert torch.allclose(param, phi, rtol=0, atol=1e-15)


def test_a_compressor_without_a_codec_is_refused_by_name(one_rank: None) -> None:
    """A user's Compressor named like a pair codec but built without ``codec=``: refused at
    the Synchronizer, not an assertion at the first round."""
    import dataclasses

    import torch

    import gradsync as gs
    from gradsync.compression.spec import parse_compression

    hook_only = dataclasses.replace(parse_compression("int8"), codec=None)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match=r"gossip:2 encodes .* built without one .*fp16, bf16"):
        gs.Synchronizer(model, opt, strategy="gossip:2", compression=hook_only)
