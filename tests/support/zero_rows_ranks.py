"""Rank functions for tests/ranks/test_zero_rows.py: ``zero:1``'s rows layout across world
sizes and layouts (checkpoints resharded, the whole state gathered and loaded, a script's own
``optimizer.load_state_dict``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradsync as gs
from gradsync.row_shards import rows_of
from gradsync.strategies import ZeroStage1

STEPS = 3
TIMEOUT_S = 60.0


class Model(nn.Module):
    """Rows that divide by neither 2 nor 3 ranks, a tensor of 2 rows (one rank of 3 holds
    none of it) and a 0-dim parameter (whole on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 7).double()
        self.b = nn.Linear(7, 2).double()
        self.temperature = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.temperature


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(
        4, 2, generator=g, dtype=torch.float64
    )


def _build(layout: str | None) -> tuple[nn.Module, torch.optim.Optimizer, gs.Synchronizer]:
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    strategy: Any = "bsp" if layout is None else ZeroStage1(layout=layout)
    sync = gs.Synchronizer(model, opt, strategy=strategy, timeout_s=TIMEOUT_S, check_every=1)
    return model, opt, sync


def _train(model: nn.Module, sync: gs.Synchronizer, rank: int) -> None:
    for step in range(STEPS):
        with sync.step():
            x, y = _batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()


def _layout(sync: gs.Synchronizer) -> str:
    return str(sync.strategy.shards.layout.kind)  # type: ignore[attr-defined]


def save(rank: int, world: int, root: str) -> dict[str, Any]:
    """Train bsp, zero:1 by rows and zero:1 by whole tensors alike; each zero:1 saves; the
    whole state each gathers on rank 0."""
    out: dict[str, Any] = {}
    for name, layout in (("bsp", None), ("rows", "auto"), ("whole", "whole")):
        model, opt, sync = _build(layout)
        _train(model, sync, rank)
        if layout is not None:
            sync.save(Path(root) / name)
            out[f"{name} layout"] = _layout(sync)
            out[name] = sync.full_state_dict()
        else:
            out[name] = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        sync.report()
        sync.close()
    return out


def load(rank: int, world: int, root: str) -> dict[str, Any]:
    """On another number of ranks: each saved layout loaded under each layout, then the whole
    state gathered again (before any step); and a whole state handed to the user's
    ``optimizer.load_state_dict`` under rows."""
    out: dict[str, Any] = {}
    for saved in ("rows", "whole"):
        for layout in ("auto", "whole"):
            model, opt, sync = _build(layout)
            extra = sync.load(Path(root) / saved)
            assert extra is not None
            out[f"{saved} -> {layout}"] = {
                "layout": _layout(sync),
                "state": sync.full_state_dict(),
            }
            sync.report()
            sync.close()
    model, opt, sync = _build("auto")
    whole = torch.load(Path(root) / "whole-state.pt", weights_only=True)
    sync.load_full_state_dict(whole)
    out["load_full_state_dict"] = sync.full_state_dict()
    opt.load_state_dict(whole["optimizer"])  # a DDP script's own resume, after the wrap
    out["user load"] = sync.full_state_dict()
    sync.report()
    sync.close()
    return out


def _refused(run: Any) -> str:
    try:
        run()
    except gs.UsageError as exc:
        return str(exc)
    return "not refused"


def gradient_ready(rank: int, world: int) -> dict[str, Any]:
    """``zero:2`` by rows at the gradient-ready point of the explicit form: torch's clip over
    ``model.parameters()`` and a read of ``p.grad`` are refused (each rank's rows are the
    optimizer's tensors' ``.grad``), its shape is not; ``s.clip_grad_norm_`` clips the whole
    gradient; after the block ``p.grad`` is None."""
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = gs.Synchronizer(model, opt, strategy="zero:2", timeout_s=TIMEOUT_S)
    out: dict[str, Any] = {"layout": _layout(sync)}
    for step in range(2):
        with sync.step() as s:
            x, y = _batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            s.synchronize()
            if step == 0:
                out["torch clip"] = _refused(
                    lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                )
                out["read"] = _refused(lambda: model.a.weight.grad.norm())  # type: ignore[union-attr]
                out["shape"] = tuple(model.a.weight.grad.shape)  # type: ignore[union-attr]
            out[f"norm {step}"] = float(s.clip_grad_norm_(0.1))
        # (a 0-dim parameter is a whole unit of rank 0's: its gradient stays there, as an
        # owned tensor's does with whole tensors)
        out[f"grads after {step}"] = [p.grad is None for p in model.parameters() if p.dim()]
    out["params"] = [p.detach().clone() for p in model.parameters()]
    sync.report()
    sync.close()
    return out


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _relaid(rank: int, root: str) -> dict[str, Any]:
    """A checkpoint of whole tensors resumed by rows on as many ranks, and back: each whole
    state gathered after the load is the one saved (a checkpoint from before the rows layout
    was refused at the same number of ranks: a reviewer's finding)."""
    out: dict[str, Any] = {}
    for saved, again in (("whole", "auto"), ("auto", "whole")):
        model, _, sync = _build(saved)
        _train(model, sync, rank)
        directory = Path(root) / f"relaid-{saved}"
        sync.save(directory)
        before = sync.full_state_dict()
        sync.close()
        model, _, sync = _build(again)
        sync.load(directory)
        out[f"{saved} -> {again}"] = (before, sync.full_state_dict(), _layout(sync))
        sync.close()
    return out


def _refused_step(rank: int, strategy: str, before: Any, inside: Any) -> str:
    """What a step of ``strategy`` refuses: ``before(model)`` runs after the build, ``inside(s,
    model, loss)`` after the step's backward pass."""
    model = Model()
    sync = gs.Synchronizer(model, _sgd(model), strategy=strategy, timeout_s=TIMEOUT_S)
    before(model)
    try:
        with sync.step() as s:
            x, y = _batch(0, rank)
            nn.functional.mse_loss(model(x), y).backward()
            inside(s, model, lambda: nn.functional.mse_loss(model(x), y))
    except gs.UsageError as exc:
        return str(exc)
    finally:
        sync.close()
    return "not refused"


def _late_backward(rank: int) -> str:
    def again(s: Any, model: nn.Module, loss: Any) -> None:
        s.synchronize()
        loss().backward()

    return _refused_step(rank, "zero:2", lambda model: None, again)


def _converted_after_build(rank: int) -> str:
    def convert(model: nn.Module) -> None:  # new storage, as model.to(...) gives
        model.b.weight.data = model.b.weight.data.clone()

    return _refused_step(rank, "zero:1", convert, lambda s, model, loss: None)


def _skipped_then_clipped(rank: int) -> list[float]:
    """A non-finite gradient skips the step; a clip at that step's gradient-ready point clips
    nothing (norm 0), by rows as with whole tensors."""
    model = Model()
    sync = gs.Synchronizer(model, _sgd(model), strategy="zero:2", timeout_s=TIMEOUT_S)
    norms = []
    for step in range(2):
        with sync.step() as s:
            x, y = _batch(step, rank)
            loss = nn.functional.mse_loss(model(x), y)
            (loss * (math.inf if step == 0 else 1.0)).backward()
            s.synchronize()
            norms.append(float(s.clip_grad_norm_(1.0)))
    sync.close()
    return norms


def _state_after_close(rank: int, world: int) -> bool:
    """After close() the optimizer holds the parameters again, its state keyed by them: this
    rank's rows of each (inspectable; its state_dict() works)."""
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = gs.Synchronizer(model, opt, strategy="zero:1", timeout_s=TIMEOUT_S)
    _train(model, sync, rank)
    sync.close()
    held = [p for g in opt.param_groups for p in g["params"]]
    rows = [
        opt.state[p]["exp_avg"].shape[0] == len(range(*rows_of(p.shape, world, rank)))
        for p in model.parameters()
        if p.dim()
    ]
    return held == list(model.parameters()) and all(rows) and bool(opt.state_dict()["state"])


def _failed_setup_then_retry(rank: int) -> bool:
    """A Synchronizer whose setup fails leaves the optimizer as it was: a second one on it
    saves and gathers (the first left its hooks and its pieces' state on it)."""
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    refused = _refused(
        lambda: gs.Synchronizer(model, opt, strategy="zero:1", compression="int8", bucket_mb="auto")
    )
    assert refused != "not refused", "the first Synchronizer's setup was to fail"
    sync = gs.Synchronizer(model, opt, strategy="zero:1", timeout_s=TIMEOUT_S)
    _train(model, sync, rank)
    state = sync.full_state_dict()
    sync.close()
    return rank != 0 or (state is not None and len(state["optimizer"]["state"]) == 5)


def _grad_norm_protocol(rank: int) -> list[float]:
    """``sync.strategy.grad_norm(model.parameters())`` (the protocol's call) at the
    gradient-ready point: the whole gradient's norm by rows as with whole tensors."""
    out = []
    for layout in ("auto", "whole"):
        model = Model()
        strategy = gs.ZeroStage2(layout=layout)
        sync = gs.Synchronizer(model, _sgd(model), strategy=strategy, timeout_s=TIMEOUT_S)
        with sync.step() as s:
            x, y = _batch(0, rank)
            nn.functional.mse_loss(model(x), y).backward()
            s.synchronize()
            out.append(float(sync.strategy.grad_norm(list(model.parameters()))))
        sync.close()
    return out


def _interrupted_in_window(rank: int) -> list[bool]:
    """A KeyboardInterrupt raised (and caught) between zero:2's gradient-ready point and the
    update: the optimizer holds the parameters again and no ``p.grad`` is a placeholder, so
    torch's clip over the model works on what it finds; the next step trains."""
    model = Model()
    opt = _sgd(model)
    sync = gs.Synchronizer(model, opt, strategy="zero:2", timeout_s=TIMEOUT_S)
    x, y = _batch(0, rank)
    try:
        with sync.step() as s:
            nn.functional.mse_loss(model(x), y).backward()
            s.synchronize()
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    held = [p for g in opt.param_groups for p in g["params"]]
    holds_params = len(held) == len(list(model.parameters())) and all(
        a is b for a, b in zip(held, model.parameters(), strict=False)
    )
    before = [p.detach().clone() for p in model.parameters()]
    clipped = _refused(lambda: nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    with sync.step():
        nn.functional.mse_loss(model(x), y).backward()
    moved = all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    sync.close()
    return [holds_params, clipped == "not refused", moved]


def traps(rank: int, world: int, root: str) -> dict[str, Any]:
    return {
        "relaid": _relaid(rank, root),
        "late backward": _late_backward(rank),
        "converted": _converted_after_build(rank),
        "skipped": _skipped_then_clipped(rank),
        "state after close": _state_after_close(rank, world),
        "retry": _failed_setup_then_retry(rank),
        "grad_norm": _grad_norm_protocol(rank),
        "interrupted": _interrupted_in_window(rank),
    }


def _front_door_drops_a_gradient(rank: int, strategy: Any) -> bool:
    """Through the front door, a loop that sets one parameter's ``p.grad = None`` before
    ``optimizer.step()`` leaves it where it was, as under DDP (the view put this rank's part
    back, and it was stepped: a reviewer's finding). Returns whether it stayed."""
    raw = Model()
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    model = gs.DistributedDataParallel(raw, optimizer=optimizer, strategy=strategy)
    before = raw.a.weight.detach().clone()
    optimizer.zero_grad()
    x, y = _batch(0, rank)
    nn.functional.mse_loss(model(x), y).backward()
    raw.a.weight.grad = None
    optimizer.step()
    stayed = torch.equal(raw.a.weight, before)
    moved = not torch.equal(raw.b.weight, _b_weight_at_start())
    model.close()
    return stayed and moved


def _b_weight_at_start() -> torch.Tensor:
    return Model().b.weight.detach()


def _front_door_grad_norms(rank: int, strategy: Any) -> list[float]:
    """Each parameter's gradient norm as docs/porting.md tells a front-door loop to log it
    under zero:2 (``p.grad.norm().full_tensor()`` on every rank), the 0-dim temperature's
    included."""
    raw = Model()
    optimizer = torch.optim.AdamW(raw.parameters(), lr=0.1)
    model = gs.DistributedDataParallel(raw, optimizer=optimizer, strategy=strategy)
    optimizer.zero_grad()
    x, y = _batch(0, rank)
    nn.functional.mse_loss(model(x), y).backward()
    norms = []
    for p in raw.parameters():
        norm = p.grad.norm()
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    optimizer.step()
    model.close()
    return norms


def front_door(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        name: _front_door_drops_a_gradient(rank, strategy)
        for name, strategy in (
            ("zero:2 rows", "zero:2"),
            ("zero:2 whole", gs.ZeroStage2(layout="whole")),
            ("zero:1 rows", "zero:1"),
        )
    }
    out["norms"] = {
        name: _front_door_grad_norms(rank, strategy)
        for name, strategy in (
            ("bsp", "bsp"),
            ("zero:2 rows", "zero:2"),
            ("zero:2 whole", gs.ZeroStage2(layout="whole")),
        )
    }
    return out
