"""Text and JSON renderings of simulation results (what ``gradsync simulate`` prints)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gradsync.sim.simulate import SimResult

MAX_WORKER_COLUMNS = 8


def bsp_summary(res: SimResult, mean_base_ms: float) -> dict[str, Any]:
    """Totals of a barrier run, by the definitions in docs/simulator.md."""
    comm_total = float(res.comm_ms.sum())
    compute = res.compute_ms.sum(axis=0)
    idle = res.wall_ms - mean_base_ms * res.steps - comm_total
    if abs(idle) <= 1e-9 * res.wall_ms:
        idle = 0.0  # the sums' rounding, not idle time (it printed as -0.00 ms)
    return {
        "strategy": res.strategy,
        "workers": res.workers,
        "steps": res.steps,
        "wall_ms": res.wall_ms,
        # Against perfect balance: every worker at the mean base compute, plus the comm.
        "barrier_idle_ms": idle,
        "comm_ms_total": comm_total,
        "barrier_tax": float(res.idle_ms.sum() / (res.workers * res.wall_ms))
        if res.wall_ms > 0
        else 0.0,
        # each worker's part of all the workers' compute: not the run reports' "compute
        # share" (a rank's compute over its own wall time), hence another name
        "compute_split": (compute / compute.sum()).tolist() if compute.sum() > 0 else [],
        "idle_per_worker_ms": res.idle_per_worker.tolist(),
        "throughput_steps_per_s": res.throughput,
        "efficiency": res.efficiency,
    }


def bsp_steps(res: SimResult) -> list[dict[str, Any]]:
    assert res.step_ms is not None
    return [
        {
            "step": t,
            "compute_ms": res.compute_ms[t].tolist(),
            "wait_ms": res.idle_ms[t].tolist(),
            "superstep_ms": float(res.step_ms[t]),
        }
        for t in range(res.steps)
    ]


def format_bsp(res: SimResult, summary: dict[str, Any], max_rows: int) -> str:
    assert res.step_ms is not None
    w = res.workers
    wide = w <= MAX_WORKER_COLUMNS
    if wide:
        head = [f"c{i}" for i in range(w)] + [f"wait{i}" for i in range(w)]
    else:
        head = ["c.min", "c.mean", "c.max", "wait.max", "wait.mean"]
    lines = [f"{'step':>5} " + " ".join(f"{h:>8}" for h in head) + f" {'superstep':>10}"]
    for t in range(min(res.steps, max_rows)):
        c, idle = res.compute_ms[t], res.idle_ms[t]
        if wide:
            cells = list(c) + list(idle)
        else:
            cells = [c.min(), c.mean(), c.max(), idle.max(), idle.mean()]
        lines.append(
            f"{t:>5} " + " ".join(f"{x:>8.2f}" for x in cells) + f" {res.step_ms[t]:>10.2f}"
        )
    if res.steps > max_rows:
        lines.append(f"  ... {res.steps - max_rows} more steps (--table-steps to show more)")
    lines.append("")
    lines.append(f"wall-clock              {summary['wall_ms']:.2f} ms over {res.steps} steps")
    lines.append(f"comm (total)            {summary['comm_ms_total']:.2f} ms")
    lines.append(
        f"barrier idle injected   {summary['barrier_idle_ms']:.2f} ms "
        "(wall - mean base compute x steps - comm x steps)"
    )
    lines.append(f"barrier tax             {summary['barrier_tax']:.1%} of worker-time")
    lines.append("compute split           " + _share_text(summary["compute_split"]))
    return "\n".join(lines)


def _share_text(shares: list[float]) -> str:
    if len(shares) <= 16:
        return "  ".join(f"w{i} {s:.1%}" for i, s in enumerate(shares))
    arr = np.asarray(shares)
    return f"min {arr.min():.2%} (w{arr.argmin()})  max {arr.max():.2%} (w{arr.argmax()})"


def free_summary(res: SimResult) -> dict[str, Any]:
    st = res.staleness
    return {
        "strategy": res.strategy,
        "workers": res.workers,
        "steps": res.steps,
        "wall_ms": res.wall_ms,
        "idle_per_worker_ms": res.idle_per_worker.tolist(),
        "idle_total_ms": float(res.idle_ms.sum()),
        "throughput_steps_per_s": res.throughput,
        "throughput_while_all_train_steps_per_s": res.throughput_while_all_train,
        "efficiency": res.efficiency,
        "staleness": {
            "mean": float(st.mean()),
            "p50": float(np.percentile(st, 50)),
            "p99": float(np.percentile(st, 99)),
            "max": int(st.max()),
            "histogram": {str(k): v for k, v in res.staleness_hist().items()},
        },
    }


def format_free(summary: dict[str, Any]) -> str:
    s = summary["staleness"]
    idle = np.asarray(summary["idle_per_worker_ms"])
    if len(idle) <= 16:
        idle_text = "  ".join(f"w{i} {x:.1f}" for i, x in enumerate(idle))
    else:
        idle_text = f"min {idle.min():.1f}  mean {idle.mean():.1f}  max {idle.max():.1f}"
    hist = s["histogram"]
    shown = list(hist.items())[:12]
    hist_text = "  ".join(f"{k}:{v}" for k, v in shown) + ("  ..." if len(hist) > 12 else "")
    return "\n".join(
        [
            f"strategy                {summary['strategy']}  "
            f"({summary['workers']} workers x {summary['steps']} steps)",
            f"wall-clock              {summary['wall_ms']:.2f} ms",
            f"idle per worker (ms)    {idle_text}",
            f"throughput              {summary['throughput_steps_per_s']:.1f} worker-steps/s "
            "(every worker runs --steps steps)",
            f"  while all train       "
            f"{summary['throughput_while_all_train_steps_per_s']:.1f} worker-steps/s "
            "(until the first worker finishes: a run of fixed duration)",
            f"scaling efficiency      {summary['efficiency']:.1%}",
            f"staleness (clocks)      mean {s['mean']:.2f}  p50 {s['p50']:g}  p99 {s['p99']:g}  "
            f"max {s['max']}",
            f"staleness histogram     {hist_text}",
        ]
    )


def format_overlap(o: dict[str, float]) -> str:
    return "\n".join(
        [
            f"compute per step        {o['compute_ms']:.2f} ms "
            f"(backward {o['backward_frac']:.0%} of it)",
            f"naive step              {o['naive_step_ms']:.2f} ms "
            f"= compute + comm {o['comm_ms']:.2f}",
            f"share communicating     {o['comm_share']:.1%}",
            f"best-case overlapped    {o['best_overlapped_step_ms']:.2f} ms "
            f"(residual {o['best_residual_ms']:.2f} ms cannot be hidden)",
            f"{int(o['buckets'])} buckets overlapped    {o['bucketed_step_ms']:.2f} ms "
            f"(residual {o['bucketed_residual_ms']:.2f} ms)",
        ]
    )


def format_beside(rows: list[dict[str, Any]]) -> str:
    """The per-step comm of bsp and the zero stages on the same compute, one row each."""
    header = ["strategy", "gradient", "gradient_ms", "allgather_ms", "comm_ms", "step_ms"]
    table = [[r[k] for k in header[:-1]] + [r["mean_step_ms"]] for r in rows]
    return "\n".join(
        [
            "beside bsp (same compute; per step, ms; step = wall-clock / steps)",
            format_rows(header, table),
        ]
    )


def format_rows(header: list[str], rows: list[list[Any]]) -> str:
    def cell(x: Any) -> str:
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    table = [header] + [[cell(x) for x in r] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(widths[i]) for i, c in enumerate(r)) for r in table)
