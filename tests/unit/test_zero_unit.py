"""ZeRO stages 1 and 2 (``zero:1``, ``zero:2``) in one process: the specs, the CLI's refusals, the
layout of the shards, the exchange per backend, the scaler helpers, the bytes line, and one
rank. On ranks: tests/ranks/test_zero.py."""

from __future__ import annotations

import math

import pytest
import torch

import gradsync as gs
from gradsync import compat
from gradsync.errors import UsageError
from gradsync.runner.config import RunConfig
from gradsync.spec import STRATEGY_FORMS, StrategySpec, parse_strategy_spec
from gradsync.strategies import ZeroStage1, ZeroStage2, parse_strategy
from gradsync.strategies.zero_shards import (
    COLLECTIVE,
    POINT_TO_POINT,
    OwnerLayout,
    choose_exchange,
    pack_round,
    plan_rounds,
    unpack_round,
)
from gradsync.telemetry.cli import _format_bytes
from gradsync.workloads import make_workload
from tests.support import zero_ranks as zr

pytestmark = pytest.mark.unit

STAGES = ("zero:1", "zero:2")


# -- specs, the factory, the CLI's checks, the layout (no processes) ---------------------------


def test_the_stage_specs_parse_and_a_stage_beyond_3_is_refused() -> None:
    assert parse_strategy_spec("zero:1") == StrategySpec(kind="zero", stage=1)
    assert str(parse_strategy_spec(" ZERO: 2 ")) == "zero:2"
    assert str(parse_strategy_spec("zero:3")) == "zero:3"
    assert "zero:N" in STRATEGY_FORMS and "N 1, 2 or 3" in STRATEGY_FORMS
    with pytest.raises(UsageError, match="strategy 'zero:4': N must be 1, 2 or 3; valid: bsp"):
        parse_strategy_spec("zero:4")
    assert isinstance(parse_strategy("zero:1"), ZeroStage1)
    assert isinstance(parse_strategy("zero:2"), ZeroStage2)
    assert parse_strategy("zero:2").weights_samples and not parse_strategy("zero:2").resizable
    with pytest.raises(UsageError, match="servers=2 is for the parameter-server strategies"):
        parse_strategy("zero:2", servers=2)


def test_the_cli_refuses_what_a_stage_cannot_run_before_starting_ranks() -> None:
    with pytest.raises(UsageError, match=r"zero:2 cannot compress .* \(compression fp16\)"):
        RunConfig(strategy="zero:2", compression="fp16", out="unused")
    RunConfig(strategy="zero:1", compression="fp16", out="unused")  # BSP's exchange: accepted
    RunConfig(strategy="zero:2", balance=True, out="unused")
    with pytest.raises(UsageError, match="--servers 2 is for the parameter-server strategies"):
        RunConfig(strategy="zero:2", servers=2, out="unused")
    # The mlp has 6 tensors: an 8-rank zero:2 leaves ranks with nothing to step.
    with pytest.raises(UsageError, match=r"run zero:2 on at most 6 rank\(s\), or use bsp"):
        RunConfig(strategy="zero:2", workload="mlp", nproc=8, out="unused")


def test_the_layout_gives_whole_tensors_by_size_in_equal_padded_chunks() -> None:
    params = [torch.zeros(10), torch.zeros(7), torch.zeros(3, dtype=torch.float64), torch.zeros(4)]
    layout = OwnerLayout(params, world=2, rank=1)
    # Largest first to the least loaded: 10 | 7, then 4 to rank 1 (7 < 10), 3 to rank 0.
    assert layout.owners == [0, 1, 0, 1]
    assert layout.numel(0) == 13 and layout.numel(1) == 11
    f32, f64 = layout.groups
    # each owner's tensors from the last registered (the order backward finishes them)
    assert f32.params == (params[0], params[3], params[1])
    assert f32.chunk == 11 and f32.offsets == (0, 11, 15) and f32.loads == (10, 11)
    assert f64.chunk == 3 and f64.loads == (3, 0)  # rank 1's float64 chunk is all padding
    buf = torch.full((22,), 5.0)
    f32.zero_padding(buf, [0, 1])
    assert buf[10].item() == 0.0 and int((buf == 0).sum()) == 1
    assert layout.mine == [params[1], params[3]] and layout.others == [params[0], params[2]]


def test_the_exchange_is_chosen_by_the_backend_that_carries_the_tensors() -> None:
    assert choose_exchange("gloo", "cpu") == POINT_TO_POINT
    assert choose_exchange("nccl", "cuda") == COLLECTIVE
    assert choose_exchange("cpu:gloo,cuda:nccl", "cpu") == POINT_TO_POINT
    assert choose_exchange("cpu:gloo,cuda:nccl", "cuda") == COLLECTIVE
    assert choose_exchange("mpi", "cpu") == COLLECTIVE
    with pytest.raises(ValueError, match="exchange must be one of auto, point-to-point"):
        ZeroStage2(exchange="ring")
    assert ZeroStage1().exchange == "auto"


def test_the_scaler_helpers_read_torchs_state_and_fall_back_when_it_is_hidden() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    assert compat.scaler_unscaled(scaler, opt) is False
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    assert compat.scaler_unscaled(scaler, opt) is True
    assert [float(t) for t in compat.scaler_found_inf(scaler, opt)] == [0.0]
    assert compat.scaler_unscaled(object(), opt) is None
    assert compat.scaler_found_inf(object(), opt) == []


def test_the_bytes_line_says_more_when_a_run_sends_more_than_fp32_gradients() -> None:
    line = _format_bytes(
        {"per_rank_step": 2e6, "total": 4e6, "compression_ratio": 0.5, "fp32_per_rank_step": 1e6},
        2,
    )
    assert "2.0x more than fp32 gradients" in line
    # a short run's total is said in its size, not rounded to nothing (the front-door tester's
    # 6 steps said "0.0 MB in total")
    assert "4.0 MB in total" in line
    assert "0.036 MB in total" in _format_bytes({"per_rank_step": 3e3, "total": 3.6e4}, 2)


# -- a world of one (the test process) ---------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_on_one_rank_a_stage_is_plain_training_and_refuses_a_late_backward(
    one_rank: None, stage: str
) -> None:
    w = make_workload("mlp", seed=0, params=2000, dtype="float64")
    model, plain = w.build_model(), w.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    sync = gs.Synchronizer(model, opt, strategy=stage)
    for step in range(3):
        x, y = w.batch(step, 8, 0, 8)
        with sync.step():
            w.loss(model, x, y).backward()
        ref.zero_grad()
        w.loss(plain, x, y).backward()
        ref.step()
    assert torch.equal(zr.flat(model), zr.flat(plain))
    wrong = pytest.raises(UsageError, match=r"micro_batches=2\) but the block ran 1")
    with wrong, sync.step(micro_batches=2):
        w.loss(model, *w.batch(3, 8, 0, 8)).backward()
    late = pytest.raises(UsageError, match="a backward pass ran after s.synchronize()")
    with late, sync.step() as s:
        w.loss(model, *w.batch(4, 8, 0, 8)).backward()
        s.synchronize()
        w.loss(model, *w.batch(4, 8, 0, 8)).backward()
    sync.close()
    assert not math.isnan(float(zr.flat(model).sum()))


def test_the_rounds_carry_every_element_once_in_bucket_sized_parts() -> None:
    """Each flat group is exchanged in rounds of at most ``per_owner`` elements of each
    owner's chunk; a tensor may straddle rounds; packing every round and unpacking it again
    puts every element back where it was, padding zeroed."""
    params = [torch.arange(10.0), torch.arange(7.0) + 100, torch.arange(4.0) + 200]
    layout = OwnerLayout(params, world=2, rank=0)
    (g,) = layout.groups
    rounds = plan_rounds(g, per_owner=3)
    assert [(r.lo, r.size) for r in rounds] == [(0, 3), (3, 3), (6, 3), (9, 2)]
    seen = [0] * 21
    for rnd in rounds:
        for owner in range(2):
            for pc in rnd.pieces[owner]:
                k = next(k for k, p in enumerate(params) if p is g.params[pc.index])
                base = sum(p.numel() for p in params[:k])
                for e in range(pc.start, pc.start + pc.length):
                    seen[base + e] += 1
    assert seen == [1] * 21
    copies = [torch.full_like(p, -1.0) for p in params]
    target = OwnerLayout(copies, world=2, rank=0).groups[0]
    for rnd in rounds:
        buf = torch.full((2 * rnd.size,), float("nan"))
        pack_round(buf, g, rnd, range(2), g.params.__getitem__)
        assert not torch.isnan(buf).any()  # padding zeroed, never left to chance
        for owner in range(2):
            unpack_round(buf, target, rnd, owner)
    assert all(torch.equal(a, b) for a, b in zip(copies, params, strict=True))
