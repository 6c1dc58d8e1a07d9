"""PNG plots of a run: where each rank's time went, idle per rank per step, step time over steps."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: runs on training nodes without a display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from gradsync.telemetry.records import StepRecord, read_records  # noqa: E402
from gradsync.telemetry.report import RunReport  # noqa: E402
from gradsync.telemetry.stragglers import Finding, StepMatrix, find_stragglers  # noqa: E402

__all__ = ["PLOT_FILES", "write_plots"]

PLOT_FILES = ("time_breakdown.png", "idle_heatmap.png", "step_time.png")
_COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "idle": "#C44E52"}


def write_plots(
    run_dir_or_records: str | Path | Iterable[StepRecord],
    out_dir: str | Path,
    findings: Sequence[Finding] | None = None,
) -> list[Path]:
    """Write the three PNGs into ``out_dir``; ``findings=None`` runs the default detector."""
    if isinstance(run_dir_or_records, str | Path):
        records = read_records(run_dir_or_records)
    else:
        records = list(run_dir_or_records)
    if findings is None:
        findings = find_stragglers(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    m = StepMatrix.from_records(records)
    paths = [out / name for name in PLOT_FILES]
    _breakdown(RunReport.from_records(records), findings, paths[0])
    _idle_heatmap(m, paths[1])
    _step_time(m, findings, paths[2])
    return paths


def _unit(seconds: float) -> tuple[str, float]:
    return ("ms", 1e3) if seconds < 1.0 else ("s", 1.0)


def _breakdown(report: RunReport, findings: Sequence[Finding], path: Path) -> None:
    slow = {f.rank for f in findings if f.kind == "straggler"}
    steps = np.array([max(t.steps, 1) for t in report.ranks])
    parts = {k: np.array([getattr(t, k) for t in report.ranks]) / steps for k in _COLORS}
    unit, scale = _unit(float(sum(parts.values()).max(initial=0.0)))
    x = np.arange(len(report.ranks))
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 0.5 * len(x) + 3)), 4.5))
    bottom = np.zeros(len(x))
    for name, values in parts.items():
        ax.bar(x, values * scale, bottom=bottom, color=_COLORS[name], label=name)
        bottom += values * scale
    many = len(x) > 16  # past that, per-bar labels collide: label every k-th and the flagged
    every = max(1, len(x) // 16)
    for i, t in enumerate(report.ranks):
        if not many:
            ax.annotate(
                f"{t.share('idle'):.0%} idle",
                (x[i], bottom[i]),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
    near_flag = {r + d for r in slow if r is not None for d in (-1, 1)} if many else set()
    labels = [
        f"{t.rank}*"
        if t.rank in slow
        else (str(t.rank) if i % every == 0 and t.rank not in near_flag else "")
        for i, t in enumerate(report.ranks)
    ]
    ax.set_xticks(x, labels)
    for label, t in zip(ax.get_xticklabels(), report.ranks, strict=True):
        if t.rank in slow:
            label.set_color(_COLORS["idle"])
    ax.set_xlabel("rank (* flagged as a straggler)" if slow else "rank")
    ax.set_ylabel(f"mean time per step ({unit})")
    ax.set_ylim(0, bottom.max(initial=0.0) * 1.15 or 1.0)
    ax.set_title(f"Where each rank's time went (barrier tax {report.barrier_tax:.1%})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)


def _idle_heatmap(m: StepMatrix, path: Path) -> None:
    unit, scale = _unit(float(np.nanmax(m.idle, initial=0.0)))
    fig, ax = plt.subplots(figsize=(10, min(8.0, max(3.0, 0.35 * len(m.ranks) + 2))))
    if m.steps.size:
        extent = (m.steps[0] - 0.5, m.steps[-1] + 0.5, len(m.ranks) - 0.5, -0.5)
        img = ax.imshow(
            m.idle.T * scale, aspect="auto", cmap="magma_r", extent=extent, interpolation="nearest"
        )
        fig.colorbar(img, ax=ax, label=f"idle at the barrier ({unit})")
        step = max(1, len(m.ranks) // 16)
        ax.set_yticks(range(0, len(m.ranks), step), [str(r) for r in m.ranks[::step]])
    ax.set_xlabel("step")
    ax.set_ylabel("rank")
    ax.set_title("Idle per rank per step (waiting for the slowest rank)")
    _save(fig, path)


def _step_time(m: StepMatrix, findings: Sequence[Finding], path: Path) -> None:
    with np.errstate(all="ignore"):
        step_time = np.nanmax(np.where(np.isnan(m.wall), -np.inf, m.wall), axis=1, initial=0.0)
        fastest = np.nanmin(np.where(np.isnan(m.compute), np.inf, m.compute), axis=1)
    unit, scale = _unit(float(np.median(step_time)) if step_time.size else 0.0)
    fig, ax = plt.subplots(figsize=(10, 5.5))
    ax.plot(m.steps, step_time * scale, color="black", lw=1, label="step time (compute + sync)")
    ax.plot(
        m.steps, fastest * scale, color=_COLORS["compute"], lw=1, label="fastest rank's compute"
    )
    palette = plt.get_cmap("tab10")
    for i, f in enumerate(findings[:10]):
        who = "all ranks slowed" if f.rank is None else f"rank {f.rank} straggling"
        ax.axvspan(
            f.first_step - 0.5,
            f.last_step + 0.5,
            color=palette(i % 10),
            alpha=0.2,
            label=f"{who} ({f.slowdown:.1f}x), steps {f.first_step}-{f.last_step}",
        )
    ax.set_xlabel("step")
    ax.set_ylabel(f"time ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_title("Step time over the run, flagged intervals shaded")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)
    _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
