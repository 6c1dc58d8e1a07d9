"""Rank functions for ``bucket_mb="auto"`` (module level, so spawned ranks can import them)."""

from __future__ import annotations

import logging
from typing import Any

import torch

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.workloads import make_workload

STEPS = 14


def train(rank: int, world: int, bucket_mb: Any) -> dict[str, Any]:
    """A 1.2 MB gradient (plans of 1 and 1.2 MB tried), ``STEPS`` steps; the final parameters,
    the strategy's summary and the plan lines bsp logged."""
    said: list[str] = []
    catch = logging.Handler(logging.INFO)
    catch.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gradsync.strategies.bsp").addHandler(catch)
    w = make_workload("mlp", seed=5, params=300_000)
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sync = gs.Synchronizer(model, opt, bucket_mb=bucket_mb, timeout_s=30)
    for step in range(STEPS):
        with sync.step():
            x, y = w.batch(step, 8 * world, 8 * rank, 8 * rank + 8)
            w.loss(model, x, y).backward()
    sync.report()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    summary = sync.strategy.summary()
    sync.close()
    logging.getLogger("gradsync.strategies.bsp").removeHandler(catch)
    plans = [line for line in said if "gradient bucket(s)" in line]
    return {"final": flat, "summary": summary, "plans": plans}


def auto_with_compression(rank: int, world: int) -> str | None:
    model = torch.nn.Linear(8, 2)
    try:
        gs.Synchronizer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), compression="fp16", bucket_mb="auto"
        )
    except UsageError as exc:
        return str(exc)
    return None
