"""The DDP-shaped front door on 2 gloo ranks: a DDP loop (no_sync accumulation, a GradScaler,
clipping, zero_grad) run unchanged with ``gs.DistributedDataParallel`` in place of torch's DDP
ends bit for bit where DDP's does, under bsp and zero:1; local:2, diloco:2 and a compressed bsp
end with identical replicas after model.report(); a local:2 run without it warns on every rank
that its replicas end apart."""

from __future__ import annotations

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import front_door_ranks
from tests.support.front_door_ranks import INF_STEP, STEPS

pytestmark = pytest.mark.ranks


def assert_same_state(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for key in theirs:  # parameters and BatchNorm buffers alike
        assert torch.equal(ours[key], theirs[key]), key


@pytest.fixture(scope="module")
def against_ddp() -> list[dict]:
    return run_ranks(front_door_ranks.against_ddp, 2, timeout_s=150)


def test_bsp_in_fp32_ends_bitwise_equal_to_ddp(against_ddp: list[dict]) -> None:
    for out in against_ddp:
        assert_same_state(out["bsp"]["state"], out["ddp"]["state"])
        assert out["bsp"]["steps"] == STEPS


def test_the_exchange_is_complete_when_backward_returns(against_ddp: list[dict]) -> None:
    # What the clip reads right after loss.backward(): DDP's mean gradient, on every rank.
    for out in against_ddp:
        ours, ddp = out["bsp"]["after_backward"], out["ddp"]["after_backward"]
        assert len(ours) == len(ddp) == STEPS
        for mine, theirs in zip(ours, ddp, strict=True):
            assert torch.equal(mine, theirs)


def test_bsp_and_zero1_with_an_enabled_grad_scaler_end_bitwise_equal_to_ddp(
    against_ddp: list[dict],
) -> None:
    for out in against_ddp:
        ddp = out["ddp_scaled"]
        scales = ddp["scales"]
        assert scales[INF_STEP] < scales[INF_STEP - 1]  # the infinite step was skipped
        for name in ("bsp_scaled", "zero1_scaled"):
            assert_same_state(out[name]["state"], ddp["state"])
            assert out[name]["scales"] == scales, name


@pytest.mark.timeout(120)
def test_local_diloco_gossip_and_compressed_bsp_end_identical_and_warn_without_report() -> None:
    first, second = run_ranks(front_door_ranks.other_strategies, 2, timeout_s=110)
    for name in ("local", "diloco", "gossip", "bsp_fp16"):
        # parameters: BatchNorm's running statistics stay each rank's own after the last
        # forward pass, under DDP too
        assert_same_state(first[name]["params"], second[name]["params"])
        assert first[name]["steps"] == STEPS
    # the local steps ran apart: before report() the replicas differed
    before = first["local"]["state"]["0.weight"], second["local"]["state"]["0.weight"]
    assert not torch.equal(*before)
    for rank, out in enumerate((first, second)):
        # ddp_loop's raw.state_dict() was taken mid-period, before report(): told so once;
        # report() then joined the replicas, so the wrapper's collection says nothing
        (took,) = out["local"]["warnings"]
        assert f"rank {rank} took model.state_dict() under local:2 after step 4" in took
        assert "Call model.report() on every rank" in took
        assert not out["bsp_fp16"]["warnings"]
        # a DDP script never calls report(): the replicas end apart, and every rank says so
        unreported = out["local_unreported"]
        assert not torch.equal(
            first["local_unreported"]["params"]["0.weight"],
            second["local_unreported"]["params"]["0.weight"],
        )
        took, ends = unreported["warnings"]
        assert f"rank {rank} ends under local:2 after step 4 without model.report()" in ends
        assert "Call model.report() on every rank" in ends


@pytest.mark.timeout(60)
def test_an_unsupported_strategy_is_refused_on_every_rank_naming_the_explicit_form() -> None:
    for message in run_ranks(front_door_ranks.refused_on_ranks, 2, timeout_s=50):
        assert "cannot run strategy 'hogwild'" in message
        assert "with sync.step(micro_batches=k) as s:" in message
