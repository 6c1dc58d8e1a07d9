"""Rank functions for the multi-process tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

import gradsync as gs
from gradsync.workloads import make_workload


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def train_reference(
    optimizer_name: str, steps: int, global_batch: int, micro: int = 1
) -> torch.Tensor:
    """One process on the whole global batch: what BSP must reproduce."""
    w = make_workload("mlp", seed=3, params=5000, dtype="float64")
    model = w.build_model()
    opt = make_optimizer(optimizer_name, model)
    for step in range(steps):
        opt.zero_grad()
        x, y = w.batch(step, global_batch, 0, global_batch)
        w.loss(model, x, y).backward()
        opt.step()
    return flat_params(model)


def train_bsp(
    rank: int, world: int, optimizer_name: str, steps: int, per_rank: int, bucket_mb: float
) -> torch.Tensor:
    w = make_workload("mlp", seed=3, params=5000, dtype="float64")
    model = w.build_model()
    opt = make_optimizer(optimizer_name, model)
    sync = gs.Synchronizer(model, opt, strategy="bsp", bucket_mb=bucket_mb)
    gb = per_rank * world
    for step in range(steps):
        with sync.step() as s:
            x, y = w.batch(step, gb, rank * per_rank, (rank + 1) * per_rank)
            loss = w.loss(model, x, y)
            loss.backward()
            s.loss = loss
    return flat_params(model)


def exactness(rank: int, world: int) -> dict[str, torch.Tensor]:
    # Small buckets so several collectives are in flight per step.
    return {
        name: train_bsp(rank, world, name, steps=10, per_rank=6, bucket_mb=0.01)
        for name in ("sgd", "adamw")
    }


def micro_batches(rank: int, world: int, micro: int, per_rank: int) -> dict[str, Any]:
    """Train with ``micro`` backward passes per step and time every gradient and every bucket
    launch, to show when communication starts relative to the backward passes."""
    w = make_workload("mlp", seed=3, params=5000, dtype="float64")
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    params = list(model.parameters())
    # Registered before the Synchronizer exists, so on each parameter this hook runs before
    # the Synchronizer's: the time of a gradient's arrival is taken before any launch it
    # triggers. A hook registered after it would time a launch made from the very last
    # gradient's hook as "before the backward pass ended", and overlap would go unchecked.
    arrivals: list[tuple[int, float]] = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(
            lambda _, i=i: arrivals.append((i, time.perf_counter()))
        )
    # 6 buckets, one or two tensors each. The step gate off: this times the reducer's own
    # launches, and a bucket ready before the gate opens is held back until it has (on a model
    # this small the gate's round trips can outlast the backward pass: tests/ranks/
    # test_gate_ahead.py checks that path).
    sync = gs.Synchronizer(model, opt, bucket_mb=0.005, between_steps_timeout_s=None)
    reducer = sync.strategy.reducer  # type: ignore[attr-defined]
    index = {id(p): i for i, p in enumerate(params)}
    last_bucket = [index[id(p)] for p in reducer.buckets[-1].parameters()]
    gb = per_rank * world
    timelines = []
    for step in range(5):
        arrivals.clear()
        with sync.step(micro_batches=micro):
            lo = rank * per_rank
            for i in range(micro):
                a, b = lo + per_rank * i // micro, lo + per_rank * (i + 1) // micro
                x, y = w.batch(step, gb, a, b)
                w.loss(model, x, y).backward()
        # Split the arrivals into backward passes: every parameter gets one gradient per pass.
        per_pass = [arrivals[k * len(params) : (k + 1) * len(params)] for k in range(micro)]
        assert sum(map(len, per_pass)) == len(arrivals) == micro * len(params)
        final = dict(per_pass[-1])
        timelines.append(
            {
                "launches": sorted(t for _, t, _ in reducer.launch_log),
                # the end of the previous backward pass (or the step's start)
                "final_pass_start": max(t for _, t in per_pass[-2]) if micro > 1 else 0.0,
                "last_bucket_first_grad": min(final[i] for i in last_bucket),
                "backward_end": max(final.values()),
            }
        )
    return {
        "params": flat_params(model),
        "timelines": timelines,
        "buckets": len(reducer.buckets),
    }


class PartlyUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)  # used only on some steps, and only by some ranks
        self.c = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.c(h)


def unused_parameter(rank: int, world: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = PartlyUsed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = gs.Synchronizer(model, opt, bucket_mb=0.0001)
    g = torch.Generator().manual_seed(rank)
    for step in range(6):
        with sync.step():
            x = torch.randn(8, 4, generator=g)
            # Steps 0-1: b unused everywhere; 2-3: used by rank 0 only; 4-5: used everywhere.
            use_b = step >= 4 or (step >= 2 and rank == 0)
            model(x, use_b).pow(2).mean().backward()
    return flat_params(model)


def slowed_step_times(rank: int, world: int) -> list[float]:
    return []
