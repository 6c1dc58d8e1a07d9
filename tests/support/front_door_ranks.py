"""Rank functions for the DDP-shaped front door (``gs.DistributedDataParallel``): one DDP training
loop, written once, run with torch's DDP and with gradsync's wrapper in its place (module level,
so spawned ranks can import them)."""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync as gs

STEPS = 5  # odd: local:2 / diloco:2 end mid-period, so report()'s last average is needed
MICRO = 2  # micro-batches per step: the first under no_sync()
INF_STEP = 2  # with a scaler: rank 1's gradient is infinite at this step, under both
CLIP = 0.5  # small enough that every step clips


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


class _OneInfinite(torch.autograd.Function):
    """The identity, whose backward makes one element of the gradient infinite."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[-1, -1] = math.inf
        return grad


class InjectingLinear(nn.Linear):
    """A Linear that, while ``inject`` is set, makes its weight's last element's gradient
    infinite as the weight enters the forward pass: under FSDP2 too (the gathered weight),
    where hooks on the module's (sharded) parameters never see a gradient. Under zero:2 and
    zero:3 only one rank holds that element after the exchange (its owner, the rank of its
    rows), where DDP leaves it on every rank."""

    inject = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _OneInfinite.apply(self.weight) if self.inject else self.weight
        return nn.functional.linear(x, weight, self.bias)


class Temperature(nn.Module):
    """One learnt factor: a 0-dim parameter (zero:2 shows its gradient as a Partial DTensor)
    or, where FSDP2 refuses 0-dim ones (zero:3), a 1-element one."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.full((1,) * dims, 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.t


def sharded_model(scalar: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        InjectingLinear(16, 4),
        Temperature(0 if scalar else 1),
    )


def one_gradient_infinite(raw: nn.Module) -> Callable[[], None]:
    """``InjectingLinear`` on for this backward pass; returns its removal."""
    layer = raw[3]
    layer.inject = True
    return lambda: setattr(layer, "inject", False)


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed((step * MICRO + micro) * 101 + rank)
    return torch.randn(6, 8, generator=g), torch.randint(4, (6,), generator=g)


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def every_gradient_infinite(raw: nn.Module) -> Callable[[], None]:
    """Hooks that make every gradient of ``raw``'s backward pass infinite (before either
    reducer sees it); returns their removal."""
    hooks = [p.register_hook(lambda g: torch.full_like(g, math.inf)) for p in raw.parameters()]

    def undo() -> None:
        for h in hooks:
            h.remove()

    return undo


def ddp_loop(
    model: Any,
    raw: nn.Module,
    optimizer: Any,
    scaler: Any,
    rank: int,
    make_infinite: Callable[[nn.Module], Callable[[], None]] = every_gradient_infinite,
    record_gradients: bool = True,
) -> dict:
    """A DDP script's loop, unchanged whichever wrapper ``model`` is: accumulation with
    no_sync, a GradScaler, clipping, zero_grad. Records the gradient as the loss's backward
    pass leaves it (before unscaling, so under an enabled scaler it is scaled), unless told
    not to (zero:2 / zero:3 leave each rank a shard of it), and the clip's total norm."""
    scales, after_backward, norms = [], [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            last = micro == MICRO - 1
            with nullcontext() if last else model.no_sync():
                undo = None
                if scaler.is_enabled() and rank == 1 and step == INF_STEP and last:
                    undo = make_infinite(raw)
                x, y = batch(step, micro, rank)
                loss = nn.functional.cross_entropy(model(x), y)
                scaler.scale(loss / MICRO).backward()
                if undo is not None:
                    undo()
        if record_gradients:
            after_backward.append(flat_grads(raw).clone())
        scaler.unscale_(optimizer)
        norms.append(whole(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)).item())
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
    return {
        "state": {k: whole(v).clone() for k, v in raw.state_dict().items()},
        "scales": scales,
        "after_backward": after_backward,
        "norms": norms,
    }


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the whole tensor of a DTensor (zero:3's parameters and norms: a collective)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _scaler(enabled: bool) -> torch.amp.GradScaler:
    # growth_interval 2: the scale also grows during the run, not only backs off
    return torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2, enabled=enabled)


def _model(strategy: str, sharded: bool) -> nn.Module:
    if not sharded:
        return small_model()
    return sharded_model(scalar=strategy != "zero:3")


def run_torch(rank: int, scaled: bool, sharded: bool = False, twin: str = "") -> dict:
    """torch's DDP, on the model the front door's run of ``twin`` (a strategy) takes."""
    raw = _model(twin, sharded)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    return ddp_loop(TorchDDP(raw), raw, optimizer, _scaler(scaled), rank, **_loop_options(sharded))


def _loop_options(sharded: bool) -> dict[str, Any]:
    if not sharded:
        return {}
    return {"make_infinite": one_gradient_infinite, "record_gradients": False}


def run_front_door(
    rank: int,
    scaled: bool,
    strategy: str,
    sharded: bool = False,
    report: bool = True,
    **options: Any,
) -> dict:
    """The DDP loop through the front door; ``warnings``: what it warned, the wrapper's
    collection included (where a script that ends without ``model.report()`` is told)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        raw = _model(strategy, sharded)
        optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
        model = gs.DistributedDataParallel(raw, optimizer=optimizer, strategy=strategy, **options)
        out = ddp_loop(model, raw, optimizer, _scaler(scaled), rank, **_loop_options(sharded))
        if report:
            model.report()  # under local:H / diloco:H: the last, unfinished period's average
        model.close()
        out["params"] = {k: whole(p).detach().clone() for k, p in raw.named_parameters()}
        out["steps"] = model.sync.step_count
        del model
        gc.collect()
    out["warnings"] = [str(w.message) for w in caught if "gradsync" in str(w.message)]
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
            ("gossip", "gossip:2", {}),
            ("bsp_fp16", "bsp", {"compression": "fp16"}),
            ("local_unreported", "local:2", {"report": False}),
        )
    }


def sharded_against_ddp(rank: int, world: int) -> dict[str, Any]:
    """zero:2 and zero:3 through the front door, in fp32 and with an enabled GradScaler that
    skips the step where one gradient element of rank 1 is infinite, beside torch's DDP."""
    out = {}
    for name, strategy in (("zero2", "zero:2"), ("zero3", "zero:3")):
        for suffix, scaled in (("", False), ("_scaled", True)):
            out[f"{name}_ddp{suffix}"] = run_torch(rank, scaled, sharded=True, twin=strategy)
            out[f"{name}{suffix}"] = run_front_door(rank, scaled, strategy, sharded=True)
    return out


def refused_on_ranks(rank: int, world: int) -> str:
    """The strategy a run directory or the script names is checked on every rank alike."""
    raw = small_model()
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    try:
        gs.DistributedDataParallel(raw, optimizer=optimizer, strategy="hogwild")
    except gs.UsageError as exc:
        dist.barrier()  # both ranks got here: no collective was left half-made
        return str(exc)
    return "accepted"
