"""zero:2 and zero:3 through the DDP-shaped front door on 2 gloo ranks: the DDP loop of
``test_front_door`` (no_sync accumulation, a GradScaler, torch's clip_grad_norm_ over
model.parameters(), zero_grad) run unchanged, ending where torch's DDP ends. The clip takes the
whole gradient's norm though each rank holds a part of it (zero:2 shows its part as DTensors,
zero:3's are FSDP2's), and the GradScaler skips a step on every rank when one element of one
rank's part is infinite."""

from __future__ import annotations

import pytest

from gradsync.testing import run_ranks
from tests.support import front_door_ranks
from tests.support.front_door_ranks import INF_STEP, STEPS

pytestmark = pytest.mark.ranks

#: the goal of issue 42 (fp32, 2 ranks); they measured 0.0 (bitwise) when written
TOLERANCE = 1e-6
#: with the GradScaler: on an AVX-512 machine (2026-11-30) zero:2 and torch's own FSDP2 (zero:3)
#: both ended 4.6e-4 from DDP, identically, all of it in one element of the first layer's bias
#: (every other tensor within 3e-8): a gradient near zero there, which AdamW divides by its
#: root mean square, turns a last-bit difference between the reduce-scatter's arithmetic and
#: DDP's all-reduce into a few percent of a step (lr 1e-2). Bitwise on the machines before
#: (CI passed at df4f60b; they computed about 1.7x slower, their CPUs' features not recorded).
#: A wrong skip or a lost update moves every tensor by about lr: far above this.
TOLERANCE_SCALED = 1e-3


@pytest.fixture(scope="module")
def sharded() -> list[dict]:
    return run_ranks(front_door_ranks.sharded_against_ddp, 2, timeout_s=110)


def max_difference(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys()
    return max(  # parameters and BatchNorm buffers alike
        (ours[k].double() - theirs[k].double()).abs().max().item() for k in theirs
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_sharded_strategies_end_where_ddp_ends_clipping_by_the_whole_norm(
    sharded: list[dict], name: str
) -> None:
    for out in sharded:
        ours, ddp = out[name], out[f"{name}_ddp"]
        assert max_difference(ours["state"], ddp["state"]) <= TOLERANCE
        # torch's clip returned the whole gradient's norm on every rank, and every step clipped
        assert ours["norms"] == pytest.approx(ddp["norms"], abs=TOLERANCE)
        assert min(ddp["norms"]) > front_door_ranks.CLIP
        assert ours["steps"] == STEPS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_a_grad_scaler_skips_on_every_rank_when_one_rank_holds_the_infinity(
    sharded: list[dict], name: str
) -> None:
    for out in sharded:
        ours, ddp = out[f"{name}_scaled"], out[f"{name}_ddp_scaled"]
        assert ddp["scales"][INF_STEP] < ddp["scales"][INF_STEP - 1]  # DDP skipped that step
        assert ours["scales"] == ddp["scales"]
        assert max_difference(ours["state"], ddp["state"]) <= TOLERANCE_SCALED
