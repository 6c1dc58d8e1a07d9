"""Rank functions for tests/ranks/test_rank_device.py (module level: spawned ranks import them)."""

from __future__ import annotations

from gradsync.workloads import make_workload


def devices(rank: int, world: int) -> dict[str, str]:
    """Where a workload's model and batch land inside a rank of a multi-rank group."""
    out = {}
    for name in ("mlp", "charlm"):
        w = make_workload(name, seed=1, params=2000) if name == "mlp" else make_workload(name)
        model = w.build_model()
        x, y = w.batch(0, 2 * world, rank * 2, rank * 2 + 2)
        out[name] = f"{next(model.parameters()).device.type} {x.device.type} {y.device.type}"
    return out
