"""Rank functions for the ZeRO tests (module level, so spawned ranks can import them).

Each function runs several cases in one group, so one spawn of ranks checks many things."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradsync as gs
from gradsync import inject
from gradsync.balance import ShardBalancer
from gradsync.errors import UsageError
from gradsync.strategies import ZeroStage1, ZeroStage2
from gradsync.strategies.base import clip_grad_norm
from gradsync.strategies.zero_rows import RowLayout
from gradsync.workloads import make_workload

PER_RANK = 6  # samples per rank and step, in MICRO micro-batches
MICRO = 2
STEPS = 4
MAX_NORM = 0.05  # below the mean gradient's norm at every step, so the clip cuts
SHARES = [1.0, 3.0, 2.0]  # fixed uneven shards for the balanced case
TIMEOUT_S = 30.0  # a rank left waiting by a bug fails the test in seconds, not minutes
BUCKET_MB = 0.01  # far below the model's size: several buckets and exchange rounds
EDIT_STEP = 2  # the "edit" cases change every parameter in place before this step


def _workload(dtype: str = "float64") -> Any:
    return make_workload("mlp", seed=3, params=5000, dtype=dtype)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """Two param groups with their own hyper-parameters, as a user's optimizer may have."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if name == "sgd":
        return torch.optim.SGD(
            [{"params": weights}, {"params": biases, "lr": 0.02}], lr=0.05, momentum=0.9
        )
    return torch.optim.AdamW(
        [{"params": weights}, {"params": biases, "lr": 3e-3, "weight_decay": 0.0}],
        lr=1e-3,
        weight_decay=0.01,
    )


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    # A different lr at every step, in every group: a shard step that ignored the user's
    # scheduler would leave the reference's trajectory at the second step.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))


def edit(model: nn.Module) -> None:
    """What a user may do to the parameters between steps (a manual rescale, a partial
    reload): every tensor changed in place, alike on every rank. A stage that kept stale
    copies in its reused buffers would bring the old values back."""
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.mul_(0.5 + 0.1 * k)


def reference(
    optimizer: str, world: int, clip: bool = False, edited: bool = False
) -> list[torch.Tensor]:
    """One process on the whole global batch, with the same groups and schedule: what every
    stage must reproduce. The parameters after every step."""
    w = _workload()
    model = w.build_model()
    opt = make_optimizer(optimizer, model)
    sched = make_scheduler(opt)
    gb = PER_RANK * world
    out = []
    for step in range(STEPS):
        if edited and step == EDIT_STEP:
            edit(model)
        opt.zero_grad()
        w.loss(model, *w.batch(step, gb, 0, gb)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        out.append(flat(model))
    return out


def _step_block(
    sync: gs.Synchronizer, w: Any, model: nn.Module, step: int, rank: int, case: dict[str, Any]
) -> float | None:
    """One step of ``case``: micro-batches of this rank's slice, or a balanced shard."""
    world = sync.world_size
    gb = PER_RANK * world
    norm = None
    if case.get("balanced"):
        sizes = sync.shard_sizes(gb)
        lo = sum(sizes[:rank])
        with sync.step():
            w.loss(model, *w.batch(step, gb, lo, lo + sizes[rank])).backward()
        return None
    part = PER_RANK // MICRO
    with sync.step(micro_batches=MICRO) as s:
        for m in range(MICRO):
            lo = rank * PER_RANK + m * part
            w.loss(model, *w.batch(step, gb, lo, lo + part)).backward()
        if case.get("clip") == "handle":
            norm = float(s.clip_grad_norm_(MAX_NORM))
        elif case.get("clip") == "strategy":
            s.synchronize()
            params = [p for p in model.parameters() if p.requires_grad]
            norm = float(clip_grad_norm(sync.strategy, params, MAX_NORM))
    return norm


def train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    w = _workload()
    model = w.build_model()
    opt = make_optimizer(case["optimizer"], model)
    sched = make_scheduler(opt)
    balance = (
        ShardBalancer(world, shares=SHARES[:world], adapt=False) if case.get("balanced") else False
    )
    strategy: Any = case["strategy"]
    if "exchange" in case:  # the stage object itself, with its way of exchanging forced
        stage = ZeroStage1 if strategy == "zero:1" else ZeroStage2
        strategy = stage(exchange=case["exchange"])
    if "layout" in case:  # the stage with its layout forced
        stage = ZeroStage1 if strategy == "zero:1" else ZeroStage2
        strategy = stage(layout=case["layout"])
    sync = gs.Synchronizer(
        model,
        opt,
        strategy=strategy,
        compression=case.get("compression"),
        bucket_mb=BUCKET_MB,  # several buckets under zero:1, as under bsp; several rounds
        check_every=1,  # the divergence check after every step, besides the test's own
        balance=balance,
        timeout_s=TIMEOUT_S,
    )
    params, norms, buffers = [], [], []
    for step in range(STEPS):
        if case.get("edit") and step == EDIT_STEP:
            edit(model)
        norms.append(_step_block(sync, w, model, step, rank, case))
        sched.step()
        params.append(flat(model))
        buffers.append(_buffers(sync, model))
    index = _state_index(sync, model, rank)
    out = {
        "params": params,
        "norms": norms,
        # which tensors have optimizer state here (and of how many of their elements), and
        # which a gradient after the last block
        "state": sorted(index[id(p)] for p in opt.state),
        "state_numel": {index[id(p)]: _per_element(st) for p, st in opt.state.items()},
        "layout": getattr(getattr(sync.strategy, "_shards", None), "layout", None),
        "grads": sorted(i for i, p in enumerate(model.parameters()) if p.grad is not None),
        "lrs": [g["lr"] for g in opt.param_groups],
        "buffers": buffers,
    }
    out["layout"] = getattr(out["layout"], "kind", None)
    sync.report()
    sync.close()
    return out


def _state_index(sync: gs.Synchronizer, model: nn.Module, rank: int) -> dict[int, int]:
    """The model's index of each tensor the optimizer may hold state for: its parameters,
    and under zero:1's rows layout this rank's pieces of them."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    layout = getattr(getattr(sync.strategy, "_shards", None), "layout", None)
    if isinstance(layout, RowLayout):
        for p, pieces in zip(layout.cut, layout.pieces, strict=True):
            index[id(pieces[rank])] = index[id(p)]
    return index


def _per_element(state: dict[str, Any]) -> int:
    """Elements of one per-element entry of a tensor's optimizer state (a moment)."""
    sizes = [t.numel() for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return sizes[0] if sizes else 0


def _buffers(sync: gs.Synchronizer, model: nn.Module) -> dict[str, Any] | None:
    """A stage's kept buffers after a step: their addresses (the same every step when they
    are reused), their sizes beside the bucket's and the model's, how the stage exchanges,
    and whether a parameter or a gradient shares storage with one (a parameter must not: the
    next step overwrites the buffer)."""
    strategy = sync.strategy
    if not isinstance(strategy, ZeroStage1 | ZeroStage2):
        return None
    shards = strategy.shards
    kept_buffers = [t for pair in shards.buffers for t in pair]
    kept = {t.untyped_storage().data_ptr() for t in kept_buffers}
    tensors = list(model.parameters())
    grads = [p.grad for p in tensors if p.grad is not None]
    return {
        "ptrs": [t.data_ptr() for t in kept_buffers],
        "sizes": [t.untyped_storage().nbytes() for t in kept_buffers],
        "bucket_bytes": BUCKET_MB * 1e6,
        "model_bytes": sum(p.numel() * p.element_size() for p in tensors),
        "exchange": shards.exchange,
        "params_alias": any(p.untyped_storage().data_ptr() in kept for p in tensors),
        "grads_alias": any(g.untyped_storage().data_ptr() in kept for g in grads),
    }


def exactness_cases(world: int) -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    for stage in ("zero:1", "zero:2"):
        for optimizer in ("sgd", "adamw"):
            cases[f"{stage} {optimizer}"] = {"strategy": stage, "optimizer": optimizer}
    # Both stages shard by rows for these optimizers by default; whole tensors, forced, must
    # end bitwise where the rows do
    for stage in ("zero:1", "zero:2"):
        for optimizer in ("sgd", "adamw"):
            case = {"strategy": stage, "optimizer": optimizer, "layout": "whole"}
            cases[f"{stage} {optimizer} whole"] = case
    cases["zero:2 clip handle whole"] = {
        "strategy": "zero:2",
        "optimizer": "sgd",
        "clip": "handle",
        "layout": "whole",
    }
    cases["bsp sgd"] = {"strategy": "bsp", "optimizer": "sgd"}
    cases["zero:1 clip handle"] = {"strategy": "zero:1", "optimizer": "sgd", "clip": "handle"}
    cases["zero:2 clip strategy"] = {"strategy": "zero:2", "optimizer": "sgd", "clip": "strategy"}
    cases["zero:2 clip handle"] = {"strategy": "zero:2", "optimizer": "sgd", "clip": "handle"}
    cases["zero:2 balanced"] = {"strategy": "zero:2", "optimizer": "adamw", "balanced": True}
    # NCCL's way (the flat all-gather and reduce-scatter), forced here on gloo, and gloo's
    # own chosen explicitly: both must give the same trajectory
    for stage in ("zero:1", "zero:2"):
        for exchange in ("collective", "point-to-point"):
            case = {"strategy": stage, "optimizer": "adamw", "exchange": exchange}
            cases[f"{stage} adamw {exchange}"] = case
        cases[f"{stage} sgd edited"] = {"strategy": stage, "optimizer": "sgd", "edit": True}
    for spec in ("bsp", "zero:1"):
        cases[f"{spec} topk"] = {"strategy": spec, "optimizer": "sgd", "compression": "topk:0.1"}
    return cases


def exactness(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {name: train(rank, world, case) for name, case in exactness_cases(world).items()}


# -- skips, the GradScaler, checkpoints, refusals (2 ranks) ------------------------------------

NAN_STEP = 1
INF_STEP = 2


def _sync(spec: Any, optimizer: str = "sgd", dtype: str = "float64", **kw: Any) -> Any:
    w = _workload(dtype)
    model = w.build_model()
    opt = make_optimizer(optimizer, model)
    sync = gs.Synchronizer(model, opt, strategy=spec, check_every=1, timeout_s=TIMEOUT_S, **kw)
    return w, model, opt, sync


def _batch(w: Any, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return w.batch(step, PER_RANK * world, rank * PER_RANK, (rank + 1) * PER_RANK)


#: the largest tensor, which rank 0 owns on 2 ranks: a non-finite gradient there is in rank 0's
#: shard only, so under zero:2 rank 1 learns of it only through the ranks' agreement
POISONED = "0.weight"


def nonfinite_skips(rank: int, world: int, spec: str) -> dict[str, Any]:
    """Rank 1's gradient of POISONED is NaN at NAN_STEP, and its block raises at NAN_STEP + 1:
    both steps are skipped on every rank, and training goes on in step."""
    w, model, _, sync = _sync(spec)
    inject.nan_gradient(sync, rank=1, step=NAN_STEP, param=POISONED)
    inject.raise_in_block(sync, rank=1, step=NAN_STEP + 1, during="backward")
    skipped, params = [], []
    for step in range(STEPS):
        try:
            with sync.step() as s:
                w.loss(model, *_batch(w, step, rank, world)).backward()
        except inject.InjectedError:
            pass
        skipped.append(s.skipped)
        params.append(flat(model))
    sync.report()
    sync.close()
    return {"skipped": skipped, "params": params}


def _scaled(rank: int, world: int, spec: str, unscale: bool) -> dict[str, Any]:
    w = _workload("float32")
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # growth_interval 2: the scale grows during the run too, not only backs off
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    sync = gs.Synchronizer(
        model, opt, strategy=spec, scaler=scaler, check_every=1, timeout_s=TIMEOUT_S
    )
    inject.nan_gradient(sync, rank=1, step=INF_STEP, param=POISONED, value=math.inf)
    scales, skipped = [], []
    for step in range(STEPS + 2):
        with sync.step() as s:
            scaler.scale(w.loss(model, *_batch(w, step, rank, world))).backward()
            if unscale:  # at the gradient-ready point, as a script that clips would
                s.synchronize()
                scaler.unscale_(opt)
        scales.append(scaler.get_scale())
        skipped.append(s.skipped)
    sync.report()
    sync.close()
    return {"params": flat(model), "scales": scales, "skipped": skipped}


def grad_scaler(rank: int, world: int) -> dict[str, Any]:
    return {
        f"{spec} unscale={unscale}": _scaled(rank, world, spec, unscale)
        for spec in ("bsp", "zero:1", "zero:2")
        for unscale in (False, True)
    }


SAVE_AT = 2


def _checkpointed(spec: Any, directory: Path, rank: int, world: int, resume: bool) -> Any:
    w, model, opt, sync = _sync(spec, optimizer="adamw")
    start = 0
    if resume:
        extra = sync.load(directory)
        assert extra is not None
        start = int(extra["step"])
    for step in range(start, STEPS):
        with sync.step():
            w.loss(model, *_batch(w, step, rank, world)).backward()
        if not resume and step + 1 == SAVE_AT:
            sync.save(directory)
    sync.report()
    sync.close()
    state = {i: _per_element(st) for i, st in enumerate(opt.state.values())}
    return {"params": flat(model), "start": start, "state": len(opt.state), "numel": state}


def checkpoints(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {}
    stages: dict[str, Any] = {
        "zero:1": lambda: "zero:1",
        "zero:2": lambda: "zero:2",
        "zero:2 whole": lambda: ZeroStage2(layout="whole"),
    }
    for name, stage in stages.items():
        directory = Path(root) / name.replace(":", "").replace(" ", "-")
        straight = _checkpointed(stage(), directory, rank, world, resume=False)
        resumed = _checkpointed(stage(), directory, rank, world, resume=True)
        out[name] = {"straight": straight, "resumed": resumed}
    return out


def _refusal(build: Any) -> str:
    try:
        sync = build()
    except UsageError as exc:
        return str(exc)
    sync.close()
    return "accepted"


def refusals(rank: int, world: int) -> dict[str, str]:
    """What a stage refuses at construction, on every rank alike."""
    w = _workload()

    def with_compression() -> gs.Synchronizer:
        model = w.build_model()
        return gs.Synchronizer(
            model, make_optimizer("sgd", model), strategy="zero:2", compression="fp16"
        )

    def one_tensor(spec: Any) -> gs.Synchronizer:
        model = nn.Linear(4, 1, bias=False).double()
        return gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=spec)

    return {
        "zero:2 fp16": _refusal(with_compression),
        "zero:1 one tensor": _refusal(lambda: one_tensor(ZeroStage1(layout="whole"))),
        "zero:1 one tensor, rows": _refusal(lambda: one_tensor("zero:1")),
        "zero:2 one tensor": _refusal(lambda: one_tensor(ZeroStage2(layout="whole"))),
        "zero:2 one tensor, rows": _refusal(lambda: one_tensor("zero:2")),
    }


def scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    return {
        "nan zero:1": nonfinite_skips(rank, world, "zero:1"),
        "nan zero:2": nonfinite_skips(rank, world, "zero:2"),
        "scaler": grad_scaler(rank, world),
        "checkpoints": checkpoints(rank, world, root),
        "refusals": refusals(rank, world),
    }
