"""Rank functions for the host-read tests on two gloo ranks (tests/ranks/test_host_reads_ranks.py):
a fused optimizer, so the non-finite verdict stays on the device (issue 44)."""

from __future__ import annotations

from typing import Any

import torch

import gradsync as gs
from gradsync import inject
from gradsync.workloads import make_workload
from tests.support.host_reads import host_reads
from tests.support.ranks import flat_params

#: the strategies whose update is the user's optimizer, the verdict on the device
STRATEGIES = ("bsp", "zero:1", "local:2", "diloco:2")
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


def _train(rank: int, world: int, strategy: str) -> dict[str, Any]:
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sync = gs.Synchronizer(model, opt, strategy=strategy, telemetry_every=EVERY, check_every=EVERY)
    inject.nan_gradient(sync, rank=1, step=NAN_AT)
    handles, moved = [], []
    with host_reads() as reads:
        for step in range(STEPS):
            before = flat_params(model)
            reads.step = step if step >= WARMUP else None
            try:
                with sync.step() as s:
                    if rank == 1 and step == RAISE_AT:
                        raise Boom("bad batch")
                    x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
                    w.loss(model, x, y).backward()
            except Boom:
                pass
            reads.step = None
            handles.append(s)
            moved.append(not torch.equal(before, flat_params(model)))
    report = sync.report()
    sync.close()
    return {
        "reads": [(r.step, r.name, r.where) for r in reads.reads],
        "skipped": [h.step for h in handles if h.skipped],
        "reasons": [h.skip_reason for h in handles if h.skipped],
        "report_skipped": sorted({r.step for r in report.records if r.skipped}),
        "moved": moved,
        "params": flat_params(model),
    }
