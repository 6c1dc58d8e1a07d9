"""hogwild: lock-free updates of parameters shared in memory by the ranks of one host. Here, in
one process: the spec, its refusals, the stats, one rank, the simulator. On ranks:
tests/ranks/test_hogwild_ranks.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.runner.config import RunConfig
from gradsync.spec import STRATEGY_FORMS, parse_strategy_spec
from gradsync.strategies import Hogwild, parse_strategy
from gradsync.strategies.factory import check_compression
from gradsync.strategies.hogwild import HogwildStats
from gradsync.workloads import make_workload
from tests.support import hogwild_ranks as ranks

pytestmark = pytest.mark.unit


def test_the_spec_builds_hogwild_and_lists_it() -> None:
    assert str(parse_strategy_spec(" HogWild ")) == "hogwild"
    assert "hogwild" in STRATEGY_FORMS
    strategy = parse_strategy("hogwild")
    assert isinstance(strategy, Hogwild)
    assert strategy.barrier_free and not strategy.weights_samples and not strategy.resizable
    with pytest.raises(UsageError, match="hogwild takes no parameter"):
        parse_strategy_spec("hogwild:2")


def test_barrier_bound_options_are_refused_with_one_message_each() -> None:
    with pytest.raises(UsageError, match="drop --compress fp16"):
        check_compression("hogwild", "fp16")
    check_compression("hogwild", "none")
    common = RunConfig(strategy="hogwild", workload="mlp", params=2000, nproc=2)
    with pytest.raises(UsageError, match="--balance needs --strategy bsp, zero:1 or zero:2"):
        replace(common, balance=True)
    with pytest.raises(UsageError, match="hogwild runs on one host.*drop --hosts 2"):
        replace(common, hosts=2)
    with pytest.raises(UsageError, match="hogwild sends nothing"):
        replace(common, compression="topk:0.01")
    with pytest.raises(UsageError, match="servers=2 is for the parameter-server strategies"):
        parse_strategy("hogwild", servers=2)


@pytest.mark.timeout(30)
def test_the_api_refuses_compression_too(one_rank: None) -> None:
    w = make_workload("mlp", seed=1, params=2000)
    model = w.build_model()
    opt = w.make_optimizer(model, w.default_lr)
    with pytest.raises(UsageError, match="hogwild sends nothing.*drop --compress fp16"):
        gs.Synchronizer(model, opt, strategy="hogwild", compression="fp16")
    assert ranks.leftovers() == []


def test_stats_describe_updates_and_staleness() -> None:
    stats = HogwildStats(updates=[3, 1], staleness_sum=[2, 4], staleness_max=[1, 4])
    assert stats.applied == 4 and stats.mean_staleness == 1.5
    text = stats.describe()
    assert "4 lock-free updates" in text and "max 4" in text
    assert "rank 1: 1 (staleness mean 4.00, max 4)" in text


@pytest.mark.timeout(30)
def test_one_rank_trains_through_the_mapping_and_leaves_nothing(one_rank: None) -> None:
    w = make_workload("mlp", seed=1, params=2000)
    model = w.build_model()
    opt = w.make_optimizer(model, w.default_lr)
    sync = gs.Synchronizer(model, opt, strategy="hogwild")
    weight = next(model.parameters())
    assert ranks.leftovers() == []  # unlinked at setup, mapped all the same
    assert weight.untyped_storage().nbytes() > weight.numel() * weight.element_size()
    before = weight.detach().clone()
    for step in range(3):
        with sync.step():
            x, y = w.batch(step, 8, 0, 8)
            w.loss(model, x, y).backward()
    assert not torch.equal(before, weight)
    stats = sync.strategy.stats()  # type: ignore[attr-defined]
    assert stats.updates == [3] and stats.staleness_max == [0]
    sync.report()
    sync.close()
    # close() gives the parameters private memory again: the model goes on working
    assert weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()


def test_the_simulator_runs_hogwild_free_with_nothing_to_exchange() -> None:
    from gradsync.sim.config import CommModel, ComputeModel
    from gradsync.sim.simulate import simulate

    compute = ComputeModel(workers=3, steps=20, base_ms=(10.0,), stragglers=((1, 3.0),)).draw()
    comm = CommModel(comm_ms=5.0)
    hog, free = simulate("hogwild", compute, comm), simulate("async", compute, comm)
    assert hog.wall_ms == 20 * 30.0  # the straggler's own 20 steps, nothing else
    assert float(hog.comm_ms.sum()) == 0.0 and free.wall_ms == 20 * 35.0
    assert (hog.idle_ms[:-1] == 0).all()  # nobody waits until a worker has run out of steps
    assert hog.staleness.max() > 0
