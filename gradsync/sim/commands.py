"""The three modes of ``gradsync simulate``: one run, sweeps, and prediction from a real run."""

from __future__ import annotations

import math
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gradsync.errors import UsageError
from gradsync.sim import report
from gradsync.sim.config import (
    CommModel,
    ComputeModel,
    SimStrategy,
    parse_sim_strategy,
    takes_hierarchy,
)
from gradsync.sim.failures import LLAMA3, format_table, goodput
from gradsync.sim.gate import REQUESTS_PER_RANK, StoreGate
from gradsync.sim.options import (
    DEFAULT_STRATEGY,
    GATED,
    SimulateOptions,
    check_gate,
    comm_model,
    compute_model,
    emit,
    failure_costs_from_args,
    layers_from_args,
    link_from_args,
    overlap_from_args,
    parse_gpus,
)
from gradsync.sim.side_by_side import (
    allreduce_rows,
    format_allreduce,
    format_streaming,
    streaming_rows,
)
from gradsync.sim.simulate import Overlap, overlap_summary, simulate, zero_comm_ms

if TYPE_CHECKING:
    from gradsync.sim.calibrate import RunProfile

#: The strategies ``simulate --strategy zero:N`` prints side by side.
BESIDE_BSP = ("bsp", "zero:1", "zero:2", "zero:3")


def beside_bsp(compute: np.ndarray, comm: CommModel) -> list[dict[str, Any]]:
    """One row per strategy of ``BESIDE_BSP`` on the same compute: its per-step comm (under the
    hierarchical all-reduce, only those that exchange through it: bsp and zero:1)."""
    workers = compute.shape[1]
    rows = []
    hierarchical = comm.hosts is not None and comm.hosts.allreduce == "hierarchical"
    for spec in BESIDE_BSP:
        strategy = parse_sim_strategy(spec)
        if hierarchical and not takes_hierarchy(strategy):
            continue
        if strategy.kind == "zero":
            op, grad_ms, gather_ms = zero_comm_ms(int(strategy.param), comm, workers)
        else:
            op, grad_ms, gather_ms = "allreduce", comm.exchange_ms(workers), 0.0
        res = simulate(strategy, compute, comm)
        rows.append(
            {
                "strategy": spec,
                "gradient": op,
                "gradient_ms": grad_ms,
                "allgather_ms": gather_ms,
                "comm_ms": grad_ms + gather_ms,
                "mean_step_ms": res.wall_ms / res.steps,
                "wall_ms": res.wall_ms,
            }
        )
    return rows


def single(args: SimulateOptions) -> int:
    model, comm = compute_model(args), comm_model(args)
    strategy = parse_sim_strategy(args.strategy or DEFAULT_STRATEGY)
    check_gate(args, [strategy], f"--strategy {strategy.spec}")
    layers = layers_from_args(args)
    if layers is not None and not strategy.streaming:
        raise UsageError(
            f"--layers sizes the fragments of streaming DiLoCo (diloco:H:F[:TAU[:ALPHA]][:SPLIT]); "
            f"{strategy.spec} has none"
        )
    compute = model.draw()
    gated = comm.gate is not None and strategy.kind in GATED
    if gated and comm.gate is not None and math.isinf(comm.gate.open_ms(model.workers)):
        # No step ever starts: the step table would be all inf and its shares nan (not JSON),
        # so the gate's line alone says why.
        ov = overlap_from_args(args) if args.overlap else None
        doc = {"strategy": strategy.spec, "workers": model.workers, "steps": model.steps}
        doc["gate"], text = _gate_cost(strategy, compute, comm, ov)
        emit(args, doc, text)
        return 0
    if args.overlap:
        doc, text = _overlapped(args, strategy, model, compute, comm)
    else:
        doc, text = _one(args, strategy, model, compute, comm, layers)
    if gated:
        ov = overlap_from_args(args) if args.overlap else None
        doc["gate"], line = _gate_cost(strategy, compute, comm, ov)
        text += "\n" + line
    if comm.hosts is not None and comm.hosts.allreduce == "hierarchical":
        ov = overlap_from_args(args) if args.overlap else None
        rows = allreduce_rows(strategy, compute, comm, layers=layers, overlap=ov)
        doc["allreduce_beside"] = rows
        text += "\n\n" + format_allreduce(rows, comm, model.workers)
    emit(args, doc, text)
    return 0


def _gate_cost(
    strategy: SimStrategy, compute: np.ndarray, comm: CommModel, ov: Overlap | None
) -> tuple[dict[str, Any], str]:
    """The step gate's share of the step: the run priced with and without it."""
    gate = comm.gate
    assert gate is not None
    workers = compute.shape[1]
    with_gate = simulate(strategy, compute, comm, overlap=ov)
    without = simulate(strategy, compute, replace(comm, gate=None), overlap=ov)
    per_step = (with_gate.wall_ms - without.wall_ms) / with_gate.steps
    share = per_step / (without.wall_ms / without.steps)
    doc = {
        "opens_ms": gate.open_ms(workers),
        "cost_ms_per_step": per_step,
        "share_of_step": share,
        "store_rate": gate.store_rate,
        "group_size": gate.size(workers),
    }
    return doc, _gate_line(gate, workers, doc)


def _gate_line(gate: StoreGate, workers: int, doc: dict[str, Any]) -> str:
    """The gate's line of ``simulate``'s output: its cost, and the form it was priced in."""
    world = gate.world_rate(workers)
    beats = f"{world:g}/s of {gate.store_rate:g}/s left by {workers} ranks' heartbeats"
    if math.isinf(doc["opens_ms"]):
        # the heartbeats alone take all the world's store serves: no step ever starts
        return (
            f"step gate              never opens: {workers} ranks' heartbeats "
            f"({workers / gate.beat_s:g} writes/s) take all of the store's "
            f"{gate.store_rate:g}/s; give more --gate-store-rate"
        )
    g = doc["group_size"]
    if g >= workers:
        how = (
            f"flat: {REQUESTS_PER_RANK} requests x {workers} ranks at the world's store, "
            f"{beats}, + 1 round trip"
        )
    else:
        how = (
            f"{gate.form(workers)}: {REQUESTS_PER_RANK} requests x {g} ranks at each group's "
            f"store, + {g} for its go, then x {gate.groups(workers)} groups at the world's "
            f"store, {beats}, + 3 round trips"
        )
    return (
        f"step gate              {doc['cost_ms_per_step']:.2f} ms a step "
        f"({doc['share_of_step']:+.1%} of the step without it): it opens "
        f"{doc['opens_ms']:.2f} ms after the ranks arrive ({how})"
    )


def _overlapped(
    args: SimulateOptions,
    strategy: SimStrategy,
    model: ComputeModel,
    compute: np.ndarray,
    comm: CommModel,
) -> tuple[dict[str, Any], str]:
    mean_base = float(model.base().mean())
    ov = overlap_from_args(args)
    summary = overlap_summary(mean_base, comm, model.workers, ov)
    plain = report.bsp_summary(simulate(strategy, compute, comm), mean_base)
    over = report.bsp_summary(simulate(strategy, compute, comm, overlap=ov), mean_base)
    name = strategy.spec
    doc: dict[str, Any] = {"overlap": summary, name: plain, f"{name}_overlap": over}
    gather = ""
    if strategy.kind == "zero":
        gather_ms = zero_comm_ms(int(strategy.param), comm, model.workers)[2]
        doc["allgather_ms"] = gather_ms
        gather = (
            f"{name} also all-gathers the parameters after the optimizer step: "
            f"{gather_ms:.2f} ms per step, never overlapped"
        )
    text = "\n".join(
        [
            report.format_overlap(summary),
            *([gather] if gather else []),
            "",
            f"simulated {model.workers} workers x {model.steps} steps: wall-clock "
            f"{plain['wall_ms']:.2f} ms without overlap, {over['wall_ms']:.2f} ms with "
            f"({1 - over['wall_ms'] / plain['wall_ms']:.1%} saved)"
            if plain["wall_ms"] > 0
            else "",
        ]
    )
    return doc, text


def _one(
    args: SimulateOptions,
    strategy: SimStrategy,
    model: ComputeModel,
    compute: np.ndarray,
    comm: CommModel,
    layers: list[float] | None,
) -> tuple[dict[str, Any], str]:
    res = simulate(strategy, compute, comm, layers=layers)
    mean_base = float(model.base().mean())
    if strategy.kind == "bsp":
        summary = report.bsp_summary(res, mean_base)
        doc = {**summary, "per_step": report.bsp_steps(res)}
        return doc, report.format_bsp(res, summary, args.table_steps)
    if strategy.kind == "zero":
        summary = report.bsp_summary(res, mean_base)
        rows = beside_bsp(compute, comm)
        doc = {**summary, "beside_bsp": rows, "per_step": report.bsp_steps(res)}
        text = report.format_bsp(res, summary, args.table_steps)
        return doc, f"{text}\n\n{report.format_beside(rows)}"
    doc = report.free_summary(res)
    text = report.format_free(doc)
    if strategy.streaming:
        # Streaming's point is what it changes against plain diloco:H: shown side by side.
        rows = streaming_rows(strategy, compute, comm, layers)
        doc["beside_plain"] = rows
        text += "\n\n" + format_streaming(rows)
    return doc, text


def _parse_staleness(text: str) -> list[float]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item == "inf":
            out.append(math.inf)
            continue
        try:
            out.append(float(int(item)))
        except ValueError:
            raise UsageError(
                f"--sweep-staleness takes integers >= 0 or inf, got {item!r}"
            ) from None
    return out


def plot_dir(args: SimulateOptions) -> Path:
    """Where the sweeps' PNGs go: ``--plot-dir`` (made if missing), else a new directory under
    the system's temporary directory, never the current one unasked. Chosen once per command:
    ``args.plot_dir`` is set to it. Called when the first PNG is written, so a usage error
    found before leaves no empty directory behind."""
    if args.plot_dir is None:
        args.plot_dir = tempfile.mkdtemp(prefix="gradsync-simulate-")
    path = Path(args.plot_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--plot-dir {args.plot_dir}: cannot make the directory: {exc}") from None
    return path


def sweeps(args: SimulateOptions) -> int:
    doc: dict[str, Any] = {}
    texts: list[str] = []
    base = compute_model(args)
    comm = comm_model(args)
    layers = layers_from_args(args)
    if layers is not None and not args.sweep_workers:
        raise UsageError(
            "--layers sizes streaming DiLoCo's fragments; the staleness sweep has none"
        )
    if args.sweep_staleness and not args.sweep_workers:
        check_gate(args, [], "--sweep-staleness (ssp:S at each S)")
    if args.sweep_staleness:
        from gradsync.sim.plots import plot_staleness

        compute = base.draw()
        rows: list[list[Any]] = []
        for bound in _parse_staleness(args.sweep_staleness):
            res = simulate(SimStrategy(kind="ssp", param=bound), compute, comm)
            label = "inf" if math.isinf(bound) else str(int(bound))
            rows.append(
                [
                    label,
                    res.wall_ms,
                    float(res.idle_ms.sum()),
                    float(res.staleness.mean()),
                    int(res.staleness.max()),
                ]
            )
        png = plot_staleness(
            [r[0] for r in rows],
            [r[1] for r in rows],
            [r[2] for r in rows],
            plot_dir(args) / "sim_staleness.png",
        )
        header = ["S", "wall_ms", "total_idle_ms", "mean_staleness", "max_staleness"]
        doc["staleness_sweep"] = [dict(zip(header, r, strict=True)) for r in rows]
        doc["staleness_plot"] = str(png)
        texts += [report.format_rows(header, rows), f"plot: {png}", ""]
    if args.sweep_workers:
        texts += _workers_sweep(args, base, comm, layers, doc)
    emit(args, doc, "\n".join(texts).rstrip())
    return 0


def _workers_sweep(
    args: SimulateOptions,
    base: ComputeModel,
    comm: CommModel,
    layers: list[float] | None,
    doc: dict[str, Any],
) -> list[str]:
    """``--sweep-workers``: every strategy at every world size; fills ``doc``, returns the text."""
    from gradsync.sim.plots import plot_scaling

    assert args.sweep_workers is not None  # called only with --sweep-workers
    try:
        counts = [int(x) for x in args.sweep_workers.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--sweep-workers takes integers, got {args.sweep_workers!r}") from None
    if not counts or min(counts) < 1:
        raise UsageError(f"--sweep-workers needs counts >= 1, got {args.sweep_workers!r}")
    strategies = [parse_sim_strategy(s) for s in args.strategies.split(",") if s.strip()]
    check_gate(args, strategies, f"--strategies {args.strategies}")
    if layers is not None and not any(s.streaming for s in strategies):
        raise UsageError(
            "--layers sizes the fragments of streaming DiLoCo (diloco:H:F[:TAU[:ALPHA]][:SPLIT]); "
            f"none of --strategies {args.strategies} has any"
        )
    eff: dict[str, list[float]] = {s.spec: [] for s in strategies}
    wall: dict[str, list[float]] = {s.spec: [] for s in strategies}
    busy: dict[str, list[float]] = {s.spec: [] for s in strategies}
    for n in counts:
        compute = base.with_workers(n).draw()
        for s in strategies:
            res = simulate(s, compute, comm, layers=layers)
            eff[s.spec].append(res.efficiency)
            wall[s.spec].append(res.wall_ms)
            busy[s.spec].append(res.throughput_while_all_train)
    png = plot_scaling(counts, eff, plot_dir(args) / "sim_scaling.png")
    rows = [[n] + [eff[s][i] for s in eff] for i, n in enumerate(counts)]
    texts = [
        "scaling efficiency (share of worker-time spent computing)",
        report.format_rows(["workers", *eff], rows),
        f"plot: {png}",
    ]
    doc["workers_sweep"] = {
        "workers": counts,
        "efficiency": eff,
        "wall_ms": wall,
        "throughput_while_all_train_steps_per_s": busy,
        "exchange_ms": [comm.exchange_ms(n) for n in counts],
        "allgather_ms": [comm.collective_ms("allgather", n) for n in counts],
    }
    doc["scaling_plot"] = str(png)
    return texts


# One statistic for every strategy, so that a what-if's delta compares like with like.
# Spelled out in docs/simulator.md: the superstep under bsp and ssp:0, the slowest worker's
# pace under ssp/async, a round / H under local/diloco.
STEP_STATISTIC = (
    "median over sync periods (1 step; H for local/diloco) of the time per step, for every strategy"
)


def from_run(args: SimulateOptions) -> int:
    from gradsync.sim.calibrate import WhatIf, load_calibration_table, load_profile, predict

    assert args.from_run is not None  # called only with --from
    profile = load_profile(args.from_run, warmup=args.warmup)
    link = link_from_args(args)
    table = load_calibration_table(args.calibration) if args.calibration else None
    opts: dict[str, Any] = {"table": table, "resample": args.resample, "seed": args.seed}
    base = predict(profile, link, **opts)
    what_if = WhatIf(
        workers=args.workers,
        strategy=args.strategy,  # None: the run's own; an explicit bsp is a what-if too
        remove_straggler=args.remove_straggler,
        compression_ratio=args.compression_ratio,
    )
    changed = what_if.describe() != "as run"
    alt = predict(profile, link, what_if, **opts) if changed else None
    doc: dict[str, Any] = {
        "run": str(args.from_run),
        "nproc": profile.nproc,
        "bytes_per_step": profile.bytes_per_step,
        "bytes_per_exchange": profile.exchange_bytes,
        "steps_per_exchange": profile.period,
        "comm_source": base.comm_source,
        "resample": args.resample,
        "measured": {
            "median_step_ms": profile.measured_step_ms,
            "barrier_tax": profile.measured_barrier_tax,
            # gradsync report's, over every recorded step (warm-up and skipped steps too)
            "report_barrier_tax": profile.report_barrier_tax,
        },
        "predicted": {
            "median_step_ms": base.step_ms,
            "mean_step_ms": base.mean_step_ms,
            "barrier_tax": base.barrier_tax,
            "comm_ms": base.comm_ms,
        },
        "step_statistic": STEP_STATISTIC,
        "slowest_rank": profile.slowest_rank(),
    }
    err = base.step_ms / profile.measured_step_ms - 1 if profile.measured_step_ms > 0 else 0.0
    sent = f"{profile.bytes_per_step / 2**20:.2f} MiB per step"
    if profile.period > 1:
        sent = (
            f"{profile.exchange_bytes / 2**20:.2f} MiB per exchange, every {profile.period} "
            f"steps ({sent})"
        )
    lines = [
        f"run {args.from_run}: {profile.nproc} ranks, {profile.strategy}, {sent}",
        f"comm from {base.comm_source}; compute resampled by {args.resample}",
        f"step = {STEP_STATISTIC}",
        f"{'':24}{'measured':>10}{'predicted':>11}",
        f"{'median step (ms)':24}{profile.measured_step_ms:>10.2f}{base.step_ms:>11.2f}"
        f"   ({err:+.1%})",
        f"{'barrier tax':24}{profile.measured_barrier_tax:>10.1%}{base.barrier_tax:>11.1%}",
    ]
    lines += _report_tax_note(profile, args.warmup)
    if alt is not None:
        doc["what_if"] = {
            "change": alt.what_if,
            "median_step_ms": alt.step_ms,
            "mean_step_ms": alt.mean_step_ms,
            "barrier_tax": alt.barrier_tax,
            "comm_ms": alt.comm_ms,
        }
        delta = alt.step_ms / base.step_ms - 1 if base.step_ms > 0 else 0.0
        lines += [
            "",
            f"what if ({alt.what_if}):",
            f"{'median step (ms)':24}{'':>10}{alt.step_ms:>11.2f}   ({delta:+.1%} vs as run)",
            f"{'barrier tax':24}{'':>10}{alt.barrier_tax:>11.1%}",
        ]
        if args.remove_straggler:
            lines.append(f"(rank {profile.slowest_rank()} had the highest median compute)")
    emit(args, doc, "\n".join(lines))
    return 0


def _report_tax_note(profile: RunProfile, warmup: int) -> list[str]:
    """Where the measured barrier tax differs from gradsync report's (as shown), why: the same
    function over the steps modelled, after the warm-up and without skipped steps, while the
    report counts every recorded step."""
    report, span = profile.report_barrier_tax, profile.measured_steps
    if report is None or span is None:
        return []
    if f"{report:.1%}" == f"{profile.measured_barrier_tax:.1%}":
        return []
    first, last, count = span
    skipped = (profile.report_steps or 0) - count - min(warmup, profile.report_steps or 0)
    without = f", without {skipped} skipped" if skipped > 0 else ""
    return [
        f"(measured over the {count} steps modelled, {first}-{last}: after --warmup {warmup}"
        f"{without}; gradsync report counts all {profile.report_steps}: {report:.1%})"
    ]


def failures(args: SimulateOptions) -> int:
    """``--failures``: both paths' goodput at every cluster size, beside the published count."""
    costs = failure_costs_from_args(args)
    rows = [goodput(n, costs) for n in parse_gpus(args.gpus)]
    doc: dict[str, Any] = {
        "costs": {
            "failure_rate_per_gpu_hour": costs.failure_rate,
            "step_s": costs.step_s,
            "checkpoint_every": costs.checkpoint_every,
            "restart_s": costs.restart_s,
            "stall_s": costs.stall_s,
            "heal_s": costs.heal_s,
            "group_gpus": costs.group_gpus,
        },
        "rows": [
            {
                "gpus": r.gpus,
                "failures_per_day": r.failures_per_day,
                "hours_between": r.hours_between,
                "goodput_restart": r.restart,
                "goodput_live": r.live,
            }
            for r in rows
        ],
        "reference": {
            "source": LLAMA3.source,
            "interruptions": LLAMA3.interruptions,
            "days": LLAMA3.days,
            "gpus": LLAMA3.gpus,
            "per_day": LLAMA3.per_day,
        },
    }
    emit(args, doc, format_table(rows, costs))
    return 0
