"""hogwild: lock-free updates of parameters shared in memory by the ranks of one host."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import gradsync as gs
from gradsync.checkpoint.store import CheckpointStore
from gradsync.config import RunConfig
from gradsync.errors import UsageError
from gradsync.spec import STRATEGY_FORMS, parse_strategy_spec
from gradsync.strategies import Hogwild, parse_strategy
from gradsync.strategies.factory import check_compression
from gradsync.strategies.hogwild import HogwildStats
from gradsync.testing import RankFailure, run_ranks
from gradsync.workloads import make_workload
from tests import hogwild_ranks as ranks
from tests import rank_device

#: hogwild shares host memory between the processes: it refuses a GPU model
#: (tests/test_gpu.py checks the refusal)
ON_CPU = rank_device.not_on_device("hogwild refuses a GPU model")


@pytest.mark.unit
def test_the_spec_builds_hogwild_and_lists_it() -> None:
    assert str(parse_strategy_spec(" HogWild ")) == "hogwild"
    assert "hogwild" in STRATEGY_FORMS
    strategy = parse_strategy("hogwild")
    assert isinstance(strategy, Hogwild)
    assert strategy.barrier_free and not strategy.weights_samples and not strategy.resizable
    with pytest.raises(UsageError, match="hogwild takes no parameter"):
        parse_strategy_spec("hogwild:2")


@pytest.mark.unit
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


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_api_refuses_compression_too(one_rank: None) -> None:
    w = make_workload("mlp", seed=1, params=2000)
    model = w.build_model()
    opt = w.make_optimizer(model, w.default_lr)
    with pytest.raises(UsageError, match="hogwild sends nothing.*drop --compress fp16"):
        gs.Synchronizer(model, opt, strategy="hogwild", compression="fp16")
    assert ranks.leftovers() == []


@pytest.mark.ranks
@ON_CPU
@pytest.mark.timeout(60)
def test_ranks_on_several_hosts_are_refused_on_every_rank() -> None:
    for message in run_ranks(ranks.on_two_hosts, 2, timeout_s=50):
        assert "hogwild runs on one host" in message, message
        assert "on 2 hosts (GRADSYNC_HOST=host-0, GRADSYNC_HOST=host-1)" in message
    assert ranks.leftovers() == []


@pytest.mark.unit
def test_stats_describe_updates_and_staleness() -> None:
    stats = HogwildStats(updates=[3, 1], staleness_sum=[2, 4], staleness_max=[1, 4])
    assert stats.applied == 4 and stats.mean_staleness == 1.5
    text = stats.describe()
    assert "4 lock-free updates" in text and "max 4" in text
    assert "rank 1: 1 (staleness mean 4.00, max 4)" in text


@pytest.mark.unit
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


@pytest.mark.ranks
@ON_CPU
@pytest.mark.timeout(60)
@pytest.mark.parametrize("workload", ["mlp", "charlm"])
def test_training_converges_on_shared_parameters(workload: str) -> None:
    steps = 30 if workload == "mlp" else 25
    got = run_ranks(ranks.converge, 2, workload, steps, timeout_s=50)
    for out in got:
        before, after = out["held_out"]
        assert after < 0.8 * before, (workload, before, after, out["losses"])
        assert out["leftovers_while_mapped"] == []
        # every record: no barrier, no idle, nothing sent
        assert all(
            not barrier and idle == 0 and sent == 0 for *_, idle, barrier, sent in out["records"]
        )
    # one memory: the ranks end with the same parameters, and with every update counted
    assert torch.equal(got[0]["params"], got[1]["params"])
    stats = got[0]["stats"]
    assert stats == got[1]["stats"] and stats.updates == [steps, steps]
    assert ranks.leftovers() == []


@pytest.mark.ranks
@ON_CPU
@pytest.mark.timeout(60)
def test_a_worker_slowed_3x_does_not_slow_the_others() -> None:
    steps = 40
    fast, slow = run_ranks(ranks.straggler, 2, steps, timeout_s=50)
    assert fast["steps"] == steps
    # Under a barrier both would have run the same number of steps; here the slow rank got
    # through about a third of them while the fast one ran all of its own (generous margin).
    assert 1 <= slow["steps"] <= 0.75 * steps, slow["steps"]
    assert all(i == 0 for i in fast["idle"] + slow["idle"])
    # Rank 0 kept writing while rank 1 computed: rank 1's updates were stale.
    stats = fast["stats"]
    assert stats.updates == [steps, slow["steps"]]
    assert stats.staleness_max[1] >= 1 and stats.staleness_sum[1] >= slow["steps"] - 1


@pytest.mark.ranks
@ON_CPU
@pytest.mark.timeout(90)
def test_killed_mid_update_leaves_finite_parameters_and_a_resumable_run(tmp_path: Path) -> None:
    save_at, after, total = 5, 8, 20
    root = str(tmp_path / "ckpt")
    first = run_ranks(ranks.first_run, 2, root, save_at, after, timeout_s=60, allow_failures=True)
    survivor, killed = first
    assert isinstance(killed, RankFailure) and "exit code -9" in str(killed), killed
    assert not isinstance(survivor, RankFailure), survivor
    # rank 0 trained on alone, saw rank 1 gone, and trained on what it left half-written
    assert survivor["gone"] and survivor["finite"]
    assert all(torch.isfinite(torch.tensor(survivor["losses"])))
    assert survivor["stats"].updates[0] == save_at + after + 3
    assert survivor["stats"].updates[1] == save_at  # the killed update was never counted
    assert ranks.leftovers() == []
    second = run_ranks(ranks.resumed_run, 2, root, total, timeout_s=60)
    store = CheckpointStore(root)
    info = store.latest()
    assert info is not None and info.step == save_at
    saved = torch.cat([t.reshape(-1) for t in store.load(info, 0)["model"].values()])
    for rank, out in enumerate(second):
        assert out["start"] == save_at
        # rank 0's saved parameters are what both ranks read once the load returned
        assert torch.equal(out["restored"], saved)
        # each rank's counters came back (the other rank may have gone on already)
        assert out["counters_at_start"].updates[rank] == save_at
        assert min(out["counters_at_start"].updates) >= save_at
        assert len(out["losses"]) == total - save_at
        assert all(torch.isfinite(torch.tensor(out["losses"])))
        assert out["stats"].updates == [total, total]
    assert torch.equal(second[0]["params"], second[1]["params"])
    assert ranks.leftovers() == []


@pytest.mark.unit
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


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_gradsync_run_reports_the_updates_applied_and_their_staleness(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gradsync.cli", "run", "--strategy", "hogwild", "--nproc", "2",
           "--workload", "mlp", "--steps", "12", "--out", str(out), "--no-plots",
           "--no-progress", "--timeout", "60"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "report.json").read_text())["strategy_summary"]
    assert summary["updates_applied"] == 24 and summary["updates_per_rank"] == [12, 12]
    assert 0 <= summary["staleness_mean"] <= summary["staleness_max"]
    assert ranks.leftovers() == []
