"""Rank functions for the host-read tests on two gloo ranks (tests/ranks/test_host_reads_ranks.py):
a fused optimizer, so the non-finite verdict stays on the device (issue 44)."""

from __future__ import annotations

import math
from typing import Any

import torch

import gradsync as gs
from gradsync import inject
from gradsync.workloads import make_workload
from tests.support.host_reads import host_reads

#: the strategies whose update is the user's optimizer, the verdict on the device (zero:2 and
#: zero:3: the all-reduced flag, each rank stepping its own shard)
STRATEGIES = ("bsp", "zero:1", "zero:2", "zero:3", "local:2", "diloco:2")
#: the strategies whose block may raise with the peers carrying on: under zero:3 the forward
#: gathers parameters (FSDP2), so a block raising before it would leave the peers waiting
RAISES = tuple(s for s in STRATEGIES if s != "zero:3")
WARMUP, STEPS, EVERY = 2, 10, 4
NAN_AT, RAISE_AT = 4, 7  # NAN_AT: a local step with no average after it (local:2)


class Boom(Exception):
    pass


def steady_and_skipped(rank: int, world: int) -> dict[str, Any]:
    """Every strategy in turn: rank 1's gradient turns NaN at ``NAN_AT`` and its block raises
    at ``RAISE_AT`` (before its backward pass: under bsp its buckets go out as NaN). Returns,
    per strategy, the host reads after warm-up, the steps each handle said were skipped (and
    why), the report's skipped steps and whether the parameters moved at each step."""
    return {strategy: _train(rank, world, strategy) for strategy in STRATEGIES}


#: (strategy, compression, with a GradScaler): a lossy exchange whose error-feedback residuals
#: are scrubbed on the device, and GradScalers whose found_inf is the verdict
SCALED_AND_COMPRESSED = (("bsp", "int4", False), ("bsp", "none", True), ("zero:2", "none", True))


def scaled_and_compressed(rank: int, world: int) -> dict[str, Any]:
    """``steady_and_skipped`` for ``SCALED_AND_COMPRESSED``, keyed by 'strategy compression
    scaler'; each result also holds the scaler's final scale (None without one)."""
    return {
        f"{strategy} {compression} {scaled}": _train(rank, world, strategy, compression, scaled)
        for strategy, compression, scaled in SCALED_AND_COMPRESSED
    }


def _train(
    rank: int, world: int, strategy: str, compression: str = "none", scaled: bool = False
) -> dict[str, Any]:
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000) if scaled else None
    )
    sync = gs.Synchronizer(
        model,
        opt,
        strategy=strategy,
        compression=compression,
        scaler=scaler,
        telemetry_every=EVERY,
        check_every=EVERY,
    )
    # One tensor's gradient, or under zero:3 one row of it: it reaches one rank's shard only
    # (zero:2, zero:3), whose peer skips through the all-reduced flag alone.
    if strategy == "zero:3":
        if rank == 1:
            _poison_first_row(model, sync)
    else:
        inject.nan_gradient(sync, rank=1, step=NAN_AT, param="0.weight")
    handles, moved = [], []
    with host_reads() as reads:
        for step in range(STEPS):
            before = _flat(model)
            reads.step = step if step >= WARMUP else None
            try:
                with sync.step() as s:
                    if rank == 1 and step == RAISE_AT and strategy in RAISES:
                        raise Boom("bad batch")
                    x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
                    loss = w.loss(model, x, y)
                    (loss if scaler is None else scaler.scale(loss)).backward()
            except Boom:
                pass
            reads.step = None
            handles.append(s)
            moved.append(not torch.equal(before, _flat(model)))
    report = sync.report()
    sync.close()
    return {
        "reads": [(r.step, r.name, r.where) for r in reads.reads],
        "skipped": [h.step for h in handles if h.skipped],
        "reasons": [h.skip_reason for h in handles if h.skipped],
        "report_skipped": sorted({r.step for r in report.records if r.skipped}),
        "moved": moved,
        "params": _flat(model),
        "scale": None if scaler is None else scaler.get_scale(),
    }


def _flat(model: torch.nn.Module) -> torch.Tensor:
    """This rank's parameters as one tensor: under zero:3 its own rows (no collective)."""
    local = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in local])


def _poison_first_row(model: torch.nn.Module, sync: gs.Synchronizer) -> None:
    """Under zero:3, row 0 of the first layer's weight gradient NaN at ``NAN_AT``: FSDP2's
    reduce-scatter takes it to rank 0's rows only. inject's hooks are on FSDP2's sharded
    parameters, which the gradient bypasses, so the hook goes on the gathered weight, which
    the layer holds during its forward (FSDP2's pre-forward hook runs before this one)."""
    first = model[0]

    def poison(grad: torch.Tensor) -> torch.Tensor | None:
        if sync.step_count != NAN_AT:
            return None
        return grad.index_fill(0, torch.tensor([0]), math.nan)

    def before(module: torch.nn.Module, _: Any) -> None:
        if sync.step_count == NAN_AT and module.weight.requires_grad:
            module.weight.register_hook(poison)

    first.register_forward_pre_hook(before)
