"""Rank functions for the ``zero:3`` tests (module level, so spawned ranks can import them).

One spawn per world size runs every case in one group: the exactness cases, the pre-sharded
model, the non-finite skip, the checkpoint, the refusals and the telemetry of FSDP2's
collectives."""

from __future__ import annotations

import time
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradsync as gs
from gradsync import compat
from tests.support import zero_ranks as zr

SAVE_AT = 2
NAN_STEP = 1
SLEEP_S = 0.05  # rank 1's extra compute at every step of the telemetry cases
TELEMETRY_STEPS = 6
ASYNC_STEP = 2  # where the zero:3 telemetry case gathers the first layer asynchronously


def full(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole (a collective for the sharded ones: call it on every rank)."""
    return torch.cat(
        [
            (p.full_tensor() if compat.is_dtensor(p) else p).detach().reshape(-1)
            for p in model.parameters()
        ]
    )


def _shard_as_a_user_would(model: nn.Module) -> None:
    fully_shard, _, mesh_cls = compat.fsdp2() or (None, None, None)
    assert fully_shard is not None
    mesh = mesh_cls.from_group(torch.distributed.group.WORLD, "cpu")
    for layer in model:
        if next(layer.parameters(), None) is not None:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    w = zr._workload()
    model = w.build_model()
    if case.get("presharded"):  # the user's own FSDP2 model, its optimizer over the DTensors
        _shard_as_a_user_would(model)
    opt = zr.make_optimizer(case["optimizer"], model)
    sched = zr.make_scheduler(opt)
    sync = gs.Synchronizer(model, opt, strategy="zero:3", timeout_s=zr.TIMEOUT_S)
    params, norms = [], []
    for step in range(zr.STEPS):
        norms.append(zr._step_block(sync, w, model, step, rank, case))
        sched.step()
        params.append(full(model))
    held = [p for group in opt.param_groups for p in group["params"]]
    out = {
        "params": params,
        "norms": norms,
        "lrs": [g["lr"] for g in opt.param_groups],
        # what this rank holds: its shards' elements, and its optimizer state's
        "held": sum(p.numel() for p in held),
        "state": sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim() > 0),
        "sharded": all(compat.is_dtensor(p) for p in model.parameters()),
    }
    sync.report()
    sync.close()
    return out


def exactness_cases() -> dict[str, dict[str, Any]]:
    return {
        "sgd": {"optimizer": "sgd"},
        "adamw": {"optimizer": "adamw"},
        "sgd clip handle": {"optimizer": "sgd", "clip": "handle"},
        "adamw presharded": {"optimizer": "adamw", "presharded": True},
    }


def _poison_first_row(
    model: nn.Module, sync: gs.Synchronizer, rank: int, step: int, value: float
) -> None:
    """On ``rank`` at ``step``, make the gradient of the first layer's first output row
    ``value``: under ``zero:3`` that row lies in rank 0's shard only."""

    def poison_row(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[:, 0] = value
        return grad

    def on_output(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if sync.rank == rank and sync.step_count == step:
            output.register_hook(poison_row)

    model[0].register_forward_hook(on_output)


def nonfinite_skips(rank: int, world: int) -> dict[str, Any]:
    """At NAN_STEP rank 1's gradient is NaN in the first layer's first output row only, which
    lies in rank 0's shard: rank 1's own shard stays finite, so only the ranks' agreement
    makes rank 1 skip too."""
    w = zr._workload()
    model = w.build_model()
    opt = zr.make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, strategy="zero:3", timeout_s=zr.TIMEOUT_S)
    _poison_first_row(model, sync, 1, NAN_STEP, float("nan"))
    skipped, params, finite_here = [], [], []
    for step in range(zr.STEPS):
        with sync.step() as s:
            w.loss(model, *zr._batch(w, step, rank, world)).backward()
            s.synchronize()
            finite_here.append(
                all(bool(p.grad.isfinite().all()) for p in opt.param_groups[0]["params"])
            )
        skipped.append(s.skipped)
        params.append(full(model))
    sync.report()
    sync.close()
    return {"skipped": skipped, "params": params, "finite_here": finite_here}


def scaled(rank: int, world: int, spec: str) -> dict[str, Any]:
    """A GradScaler (float32) with an infinite gradient in rank 0's shard at NAN_STEP, sent by
    rank 1: the scaler must back off and skip on every rank, as under bsp."""
    w = zr._workload("float32")
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    sync = gs.Synchronizer(model, opt, strategy=spec, scaler=scaler, timeout_s=zr.TIMEOUT_S)
    _poison_first_row(model, sync, 1, NAN_STEP, float("inf"))
    scales, skipped = [], []
    for step in range(zr.STEPS + 2):
        with sync.step() as s:
            scaler.scale(w.loss(model, *zr._batch(w, step, rank, world))).backward()
        scales.append(scaler.get_scale())
        skipped.append(s.skipped)
    out = {"params": full(model), "scales": scales, "skipped": skipped}
    sync.report()
    sync.close()
    return out


def _checkpointed(
    directory: Path,
    rank: int,
    world: int,
    resume: bool,
    stop: int = zr.STEPS,
    spec: str = "zero:3",
) -> dict[str, Any]:
    w = zr._workload()
    model = w.build_model()
    opt = zr.make_optimizer("adamw", model)
    sync = gs.Synchronizer(model, opt, strategy=spec, timeout_s=zr.TIMEOUT_S)
    start = 0
    if resume:
        extra = sync.load(directory)
        assert extra is not None
        start = int(extra["step"])
    for step in range(start, zr.STEPS if resume else stop):
        with sync.step():
            w.loss(model, *zr._batch(w, step, rank, world)).backward()
        if not resume and step + 1 == SAVE_AT:
            sync.save(directory)
    out = {"params": full(model), "start": start, "state": len(opt.state)}
    sync.report()
    sync.close()
    return out


def resized(rank: int, world: int, directory: str, resume: bool, spec: str) -> dict[str, Any]:
    """The first SAVE_AT steps on one number of ranks, saved; the rest resumed on another."""
    return _checkpointed(Path(directory), rank, world, resume=resume, stop=SAVE_AT, spec=spec)


def resized_reference(worlds: tuple[int, int]) -> torch.Tensor:
    """One process: the first SAVE_AT steps on the first world's global batch, the rest on
    the second's (each step's global batch is PER_RANK x ranks)."""
    w = zr._workload()
    model = w.build_model()
    opt = zr.make_optimizer("adamw", model)
    for step in range(zr.STEPS):
        gb = zr.PER_RANK * (worlds[0] if step < SAVE_AT else worlds[1])
        opt.zero_grad()
        w.loss(model, *w.batch(step, gb, 0, gb)).backward()
        opt.step()
    return zr.flat(model)


def refusals(rank: int, world: int) -> dict[str, str]:
    w = zr._workload()

    def build(**kw: Any) -> gs.Synchronizer:
        model = w.build_model()
        opt = zr.make_optimizer("adamw", model)
        if kw.pop("stepped", False):  # a state the shards would not match
            w.loss(model, *zr._batch(w, 0, rank, world)).backward()
            opt.step()
        return gs.Synchronizer(model, opt, timeout_s=zr.TIMEOUT_S, **kw)

    def sharded_under_bsp() -> gs.Synchronizer:
        model = w.build_model()
        _shard_as_a_user_would(model)
        return gs.Synchronizer(model, zr.make_optimizer("sgd", model), strategy="bsp")

    return {
        "compression": zr._refusal(lambda: build(strategy="zero:3", compression="fp16")),
        "stepped": zr._refusal(lambda: build(strategy="zero:3", stepped=True)),
        "balance": zr._refusal(lambda: build(strategy="zero:3", balance=True)),
        "sharded under bsp": zr._refusal(sharded_under_bsp),
    }


def released(rank: int, world: int) -> dict[str, Any]:
    """Whether last step's gradient shards are still held once the next step's block is
    entered: the optimizer's parameters' ``grad`` (views of FSDP2's gradient shards) and the
    tensors themselves (weak references), read before that step's forward. Held, they cost
    1/N of the model through the forward and backward on top of the new ones (issue 47)."""
    w = zr._workload()
    model = w.build_model()
    opt = zr.make_optimizer("adamw", model)
    sync = gs.Synchronizer(model, opt, strategy="zero:3", timeout_s=zr.TIMEOUT_S)
    held = [p for group in opt.param_groups for p in group["params"]]
    with sync.step():
        w.loss(model, *zr._batch(w, 0, rank, world)).backward()
    after = [p.grad is not None for p in held]
    last = [weakref.ref(p.grad) for p in held if p.grad is not None]
    with sync.step():
        entry = [p.grad is None for p in held]
        alive = sum(r() is not None for r in last)
        w.loss(model, *zr._batch(w, 1, rank, world)).backward()
    out = {"after": after, "entry": entry, "alive": alive, "last": len(last)}
    sync.close()
    return out


def _shard_root_heavy(model: nn.Module) -> None:
    """A user's wrapping that leaves parameters at the root: the first layer is the only unit.
    FSDP2 keeps the root's parameters gathered from its forward to its backward."""
    fully_shard, _, mesh_cls = compat.fsdp2() or (None, None, None)
    assert fully_shard is not None
    mesh = mesh_cls.from_group(torch.distributed.group.WORLD, "cpu")
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)


def telemetry(rank: int, world: int, case: str) -> dict[str, Any]:
    """Steps of MICRO micro-batches in which rank 1 computes SLEEP_S longer than the others:
    what each rank recorded (its step records and the spans of FSDP2's collectives). Cases:
    ``zero:3`` (gradsync shards the model), ``presharded`` (the user's ``_shard_root_heavy``),
    ``fallback`` (a torch without custom collectives, as ``compat.fsdp_comms`` reports it).
    At ASYNC_STEP of ``zero:3`` the first layer is gathered by an explicit asynchronous
    ``unshard``, which its forward then uses, so the step's bytes are unchanged."""
    w = zr._workload()
    model = w.build_model()
    if case == "presharded":
        _shard_root_heavy(model)
    opt = zr.make_optimizer("sgd", model)
    hidden = compat.fsdp_comms
    if case == "fallback":
        compat.fsdp_comms = lambda module: None  # type: ignore[assignment]
    try:
        sync = gs.Synchronizer(
            model, opt, strategy="zero:3", timeout_s=zr.TIMEOUT_S, record_spans=True
        )
    finally:
        compat.fsdp_comms = hidden  # type: ignore[assignment]
    part = zr.PER_RANK // zr.MICRO
    gb = zr.PER_RANK * world
    for step in range(TELEMETRY_STEPS):
        with sync.step(micro_batches=zr.MICRO):
            if rank == 1:  # compute by definition; the others wait in FSDP2's first gather
                time.sleep(SLEEP_S)
            if case == "zero:3" and step == ASYNC_STEP:  # FSDP2 then blocks in Work.wait()
                model[0].unshard(async_op=True).wait()
            for m in range(zr.MICRO):
                lo = rank * zr.PER_RANK + m * part
                w.loss(model, *w.batch(step, gb, lo, lo + part)).backward()
    report = sync.report()
    keys = ("step", "compute", "sync", "idle", "comm", "bytes")
    out = {
        "records": [{k: getattr(r, k) for k in keys} for r in report.records if r.rank == rank],
        "comm_spans": [(s.step, s.name, s.dur) for s in sync.spans if s.cat == "comm"],
    }
    sync.close()
    return out


def everything(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        name: train(rank, world, case) for name, case in exactness_cases().items()
    }
    out["nan"] = nonfinite_skips(rank, world)
    out["scaler"] = {spec: scaled(rank, world, spec) for spec in ("bsp", "zero:3")}
    directory = Path(root) / f"zero3-{world}"
    out["straight"] = _checkpointed(directory, rank, world, resume=False)
    out["resumed"] = _checkpointed(directory, rank, world, resume=True)
    out["refusals"] = refusals(rank, world)
    out["released"] = released(rank, world)
    out["telemetry"] = {c: telemetry(rank, world, c) for c in ("zero:3", "presharded", "fallback")}
    return out
