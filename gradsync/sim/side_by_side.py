"""The side-by-side tables of ``gradsync simulate``: streaming DiLoCo beside plain ``diloco:H``,
and the hierarchical all-reduce beside the flat ring, each on the same compute matrix.

Both are the same simulation run twice with one thing changed, so what differs between the
rows is that thing alone (the fragments and their overlap; the all-reduce).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from gradsync.sim.config import CommModel, SimStrategy
from gradsync.sim.report import format_rows
from gradsync.sim.simulate import Overlap, SimResult, simulate, zero_comm_ms
from gradsync.sim.streaming import Layer, fragment_shares


def _steps(res: SimResult) -> dict[str, float]:
    return {
        # The simulator's one step statistic (docs/simulator.md): per H-step period here.
        "median_step_ms": float(np.median(res.period_step_ms())),
        "mean_step_ms": res.wall_ms / res.steps,
        "wall_ms": res.wall_ms,
    }


def streaming_rows(
    strategy: SimStrategy, compute: np.ndarray, comm: CommModel, layers: Sequence[Layer] | None
) -> list[dict[str, Any]]:
    """Plain ``diloco:H`` and ``strategy`` (streaming) on the same compute and link.

    Peak bytes per sync: the largest exchange, the largest fragment's bytes over the
    compressor's ratio (plain: the whole model's). ``peak_mb`` only where the comm model
    knows the message's bytes (alpha-beta); ``peak_share`` always.
    """
    plain = SimStrategy(kind="diloco", param=strategy.param)
    workers = compute.shape[1]
    rows: list[dict[str, Any]] = []
    for s in (plain, strategy):
        shares = fragment_shares(layers if s.streaming else None, s.fragments, s.split)
        res = simulate(s, compute, comm, layers=layers)
        periods = res.steps / s.param
        peak = max(shares)
        rows.append(
            {
                "strategy": s.spec,
                "exchanges_per_period": s.fragments,
                "fragment_shares": shares,
                "peak_share": peak,
                "peak_mb": peak * comm.nbytes / comm.ratio / 2**20 if comm.nbytes else None,
                "peak_exchange_ms": comm.exchange_ms(workers, peak),
                "unhidden_comm_per_period_ms": float(res.comm_ms.sum()) / periods,
                **_steps(res),
            }
        )
    base = rows[0]["median_step_ms"]
    for row in rows:
        row["speedup_vs_plain"] = base / row["median_step_ms"] if row["median_step_ms"] else 1.0
    return rows


def format_streaming(rows: list[dict[str, Any]]) -> str:
    header = ["strategy", "syncs/H", "peak_share", "peak_MiB", "peak_ms", "unhidden/H"]
    header += ["step_ms", "mean_step_ms", "vs_plain"]
    table = [
        [
            r["strategy"],
            r["exchanges_per_period"],
            r["peak_share"],
            "-" if r["peak_mb"] is None else r["peak_mb"],
            r["peak_exchange_ms"],
            r["unhidden_comm_per_period_ms"],
            r["median_step_ms"],
            r["mean_step_ms"],
            f"{r['speedup_vs_plain']:.2f}x",
        ]
        for r in rows
    ]
    shares = ", ".join(f"{x:.3f}" for x in rows[-1]["fragment_shares"])
    return "\n".join(
        [
            "beside plain DiLoCo (same compute; ms; step = median over H-step periods of the "
            "time per step; peak = the largest exchange, its share of the model's bytes; "
            "unhidden/H = exchange time no worker could hide, per H steps)",
            format_rows(header, table),
            f"fragment shares of the bytes: {shares}",
        ]
    )


def allreduce_rows(
    strategy: SimStrategy,
    compute: np.ndarray,
    comm: CommModel,
    *,
    layers: Sequence[Layer] | None = None,
    overlap: Overlap | None = None,
) -> list[dict[str, Any]]:
    """``strategy`` with the flat ring and with the hierarchical all-reduce (``comm.hosts``)."""
    assert comm.hosts is not None
    workers = compute.shape[1]
    rows: list[dict[str, Any]] = []
    for kind in ("ring", "hierarchical"):
        c = replace(comm, hosts=replace(comm.hosts, allreduce=kind))
        res = simulate(strategy, compute, c, overlap=overlap, layers=layers)
        gather = zero_comm_ms(1, c, workers)[2] if strategy.kind == "zero" else 0.0
        rows.append(
            {
                "allreduce": kind,
                "strategy": res.strategy,
                "allreduce_ms": c.exchange_ms(workers),
                "allgather_ms": gather,
                **_steps(res),
            }
        )
    ring = rows[0]["median_step_ms"]
    for row in rows:
        row["speedup_vs_ring"] = ring / row["median_step_ms"] if row["median_step_ms"] else 1.0
    return rows


def format_allreduce(rows: list[dict[str, Any]], comm: CommModel, workers: int) -> str:
    assert comm.hosts is not None
    hosts = comm.hosts.hosts
    keys = ["allreduce", "strategy", "allreduce_ms", "allgather_ms", "median_step_ms"]
    keys += ["mean_step_ms"]
    table = [[r[k] for k in keys] + [f"{r['speedup_vs_ring']:.2f}x"] for r in rows]
    header = [*keys[:4], "step_ms", "mean_step_ms", "vs_ring"]
    return "\n".join(
        [
            f"hierarchical beside flat ({hosts} hosts x {comm.hosts.per_host(workers)} ranks; "
            "same compute; ms; allreduce_ms = one all-reduce of the whole message; step = "
            "median over sync periods of the time per step)",
            format_rows(header, table),
        ]
    )


__all__ = ["allreduce_rows", "format_allreduce", "format_streaming", "streaming_rows"]
