"""PNG plots for the sweeps. Agg backend: the simulator runs on machines with no display."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

from gradsync.errors import UsageError

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)))
MARKERS = ("o", "s", "^", "D", "v", "x", "P")


def plot_staleness(
    labels: Sequence[str], wall_ms: Sequence[float], idle_ms: Sequence[float], path: str | Path
) -> Path:
    """Wall-clock and total idle against the staleness bound S (``inf`` last)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    x = range(len(labels))
    ax.plot(x, [w / 1000 for w in wall_ms], marker="o", label="wall-clock")
    ax.plot(x, [i / 1000 for i in idle_ms], marker="s", label="total idle (all workers)")
    ax.set_xticks(list(x), list(labels))
    ax.set_xlabel("staleness bound S")
    ax.set_ylabel("seconds")
    ax.set_title("SSP: wall-clock and idle against staleness")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_scaling(
    workers: Sequence[int], efficiency: Mapping[str, Sequence[float]], path: str | Path
) -> Path:
    """Scaling efficiency against the number of workers, one line per strategy."""
    fig, ax = plt.subplots(figsize=(6, 4))
    # Strategies can give the same line (ssp:S and async with a persistent straggler): each
    # gets its own dash pattern and hollow marker, drawn thinner and smaller than the one
    # before, so a line on top of another leaves the one below visible around it.
    drawn: dict[str, Sequence[float]] = {}
    for i, (strategy, values) in enumerate(efficiency.items()):
        same = [k for k, v in drawn.items() if _same_line(v, values)]
        drawn[strategy] = values
        ax.plot(
            list(workers),
            list(values),
            linestyle=LINE_STYLES[i % len(LINE_STYLES)],
            marker=MARKERS[i % len(MARKERS)],
            markersize=max(3.0, 9.0 - 1.5 * i),
            markerfacecolor="none",
            linewidth=max(1.0, 2.6 - 0.4 * i),
            label=f"{strategy} (= {same[0]})" if same else strategy,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(workers), [str(w) for w in workers])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling efficiency (compute / worker-time)")
    ax.set_title("Scaling efficiency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _same_line(a: Sequence[float], b: Sequence[float]) -> bool:
    if len(a) != len(b):
        return False
    return all(abs(x - y) <= 1e-3 * max(abs(x), 1e-9) for x, y in zip(a, b, strict=True))


def _save(fig: plt.Figure, path: str | Path) -> Path:
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(out, dpi=110)
    except OSError as exc:  # a read-only --plot-dir, a directory where the PNG goes
        raise UsageError(
            f"--plot-dir {out.parent}: cannot write {out.name} there ({exc.strerror}): pass "
            "a --plot-dir that is a writable directory"
        ) from None
    finally:
        plt.close(fig)
    return out
