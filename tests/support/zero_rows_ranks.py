"""Rank functions for tests/ranks/test_zero_rows.py: ``zero:1``'s rows layout across world
sizes and layouts (checkpoints resharded, the whole state gathered and loaded, a script's own
``optimizer.load_state_dict``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradsync as gs
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
