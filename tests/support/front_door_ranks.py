"""Rank functions for the DDP-shaped front door (``gs.DistributedDataParallel``): one DDP training
loop, written once, run with torch's DDP and with gradsync's wrapper in its place (module level,
so spawned ranks can import them)."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync as gs

STEPS = 5  # odd: local:2 / diloco:2 end mid-period, so report()'s last average is needed
MICRO = 2  # micro-batches per step: the first under no_sync()
INF_STEP = 2  # with a scaler: rank 1's gradient is infinite at this step, under both
CLIP = 0.5  # small enough that every step clips


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed((step * MICRO + micro) * 101 + rank)
    return torch.randn(6, 8, generator=g), torch.randint(4, (6,), generator=g)


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def ddp_loop(model: Any, raw: nn.Module, optimizer: Any, scaler: Any, rank: int) -> dict:
    """A DDP script's loop, unchanged whichever wrapper ``model`` is: accumulation with
    no_sync, a GradScaler, clipping, zero_grad. Records the gradient as the loss's backward
    pass leaves it (before unscaling, so under an enabled scaler it is scaled)."""
    scales, after_backward = [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            last = micro == MICRO - 1
            with nullcontext() if last else model.no_sync():
                hooks = []
                if scaler.is_enabled() and rank == 1 and step == INF_STEP and last:
                    hooks = [  # before either reducer sees the gradient
                        p.register_hook(lambda g: torch.full_like(g, math.inf))
                        for p in raw.parameters()
                    ]
                x, y = batch(step, micro, rank)
                loss = nn.functional.cross_entropy(model(x), y)
                scaler.scale(loss / MICRO).backward()
                for h in hooks:
                    h.remove()
        after_backward.append(flat_grads(raw).clone())
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
    return {
        "state": {k: v.clone() for k, v in raw.state_dict().items()},
        "scales": scales,
        "after_backward": after_backward,
    }


def _scaler(enabled: bool) -> torch.amp.GradScaler:
    # growth_interval 2: the scale also grows during the run, not only backs off
    return torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2, enabled=enabled)


def run_torch(rank: int, scaled: bool) -> dict:
    raw = small_model()
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    return ddp_loop(TorchDDP(raw), raw, optimizer, _scaler(scaled), rank)


def run_front_door(rank: int, scaled: bool, strategy: str, **options: Any) -> dict:
    raw = small_model()
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    model = gs.DistributedDataParallel(raw, optimizer=optimizer, strategy=strategy, **options)
    out = ddp_loop(model, raw, optimizer, _scaler(scaled), rank)
    model.report()  # under local:H / diloco:H: the last, unfinished period's average
    model.close()
    out["params"] = {k: p.detach().clone() for k, p in raw.named_parameters()}
    out["steps"] = model.sync.step_count
    return out


def against_ddp(rank: int, world: int) -> dict[str, Any]:
    """bsp (fp32, and with an enabled GradScaler that skips one step) and zero:1 (with the
    scaler) through the front door, each beside torch's DDP running the same loop."""
    return {
        "ddp": run_torch(rank, scaled=False),
        "ddp_scaled": run_torch(rank, scaled=True),
        "bsp": run_front_door(rank, scaled=False, strategy="bsp"),
        "bsp_scaled": run_front_door(rank, scaled=True, strategy="bsp"),
        "zero1_scaled": run_front_door(rank, scaled=True, strategy="zero:1"),
    }


def other_strategies(rank: int, world: int) -> dict[str, Any]:
    """Strategies with no DDP twin: each one's final parameters, for the replicas' agreement."""
    return {
        name: run_front_door(rank, scaled=False, strategy=strategy, **options)
        for name, strategy, options in (
            ("local", "local:2", {}),
            ("diloco", "diloco:2", {}),
            ("bsp_fp16", "bsp", {"compression": "fp16"}),
        )
    }


def refused_on_ranks(rank: int, world: int) -> str:
    """The strategy a run directory or the script names is checked on every rank alike."""
    raw = small_model()
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    try:
        gs.DistributedDataParallel(raw, optimizer=optimizer, strategy="zero:2")
    except gs.UsageError as exc:
        dist.barrier()  # both ranks got here: no collective was left half-made
        return str(exc)
    return "accepted"
