"""hogwild on gloo ranks: lock-free updates of parameters shared in memory by the ranks of one
host converge, a slow worker slows no other, a kill leaves a resumable run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradsync.checkpoint.store import CheckpointStore
from gradsync.testing import RankFailure, run_ranks
from tests.support import hogwild_ranks as ranks
from tests.support import rank_device

pytestmark = pytest.mark.ranks

#: hogwild shares host memory between the processes: it refuses a GPU model
#: (tests/ranks/test_gpu_ranks.py checks the refusal)
ON_CPU = rank_device.not_on_device("hogwild refuses a GPU model")


@ON_CPU
@pytest.mark.timeout(60)
def test_ranks_on_several_hosts_are_refused_on_every_rank() -> None:
    for message in run_ranks(ranks.on_two_hosts, 2, timeout_s=50):
        assert "hogwild runs on one host" in message, message
        assert "on 2 hosts (GRADSYNC_HOST=host-0, GRADSYNC_HOST=host-1)" in message
    assert ranks.leftovers() == []


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
