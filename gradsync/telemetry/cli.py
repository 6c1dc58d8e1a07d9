"""``gradsync report RUN_DIR``: the text summary, trace.json and plots of a finished run.

Everything is computed from the run directory's files (metrics.jsonl, optionally spans.jsonl and
config.json), so a run can be analysed after the fact, on another machine, with other settings.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync.errors import UsageError
from gradsync.module_cli import run_commands
from gradsync.telemetry.membership import (
    MEMBERSHIP_FILE,
    GroupMembership,
    counted,
    read_group,
)
from gradsync.telemetry.records import (
    METRICS_FILE,
    Span,
    StepRecord,
    read_records,
    read_spans,
)
from gradsync.telemetry.report import RunReport
from gradsync.telemetry.stragglers import (
    Finding,
    RankScores,
    StragglerConfig,
    find_stragglers,
    format_scores,
    rank_scores,
)
from gradsync.telemetry.trace import write_trace

__all__ = [
    "REPORT_FILE",
    "TRACE_FILE",
    "add_parsers",
    "analyze_records",
    "analyze_run",
    "handler",
    "main",
    "summarize_run",
]

TRACE_FILE = "trace.json"
REPORT_FILE = "report.json"  # written by the run itself (gradsync.attached_run), never by `report`


@dataclass(slots=True)
class RunAnalysis:
    run_dir: Path
    config: StragglerConfig
    report: RunReport
    findings: list[Finding]
    bytes: dict[str, float]
    outputs: list[Path] = field(default_factory=list)
    scores: list[RankScores] = field(default_factory=list)
    #: the step records analysed (``read_records``'), for a caller that says more of them
    records: list[StepRecord] = field(default_factory=list)
    #: set by ``gradsync report`` when its straggler settings differ from those the run's
    #: report.json was written with, which it leaves as the run wrote it: a line saying so
    run_settings: str = ""

    def format(self) -> str:
        ranks = len(self.report.ranks)
        steps = self.report.steps
        lines = [
            f"run: {self.run_dir} ({counted(steps, 'step')}, {counted(ranks, 'rank')})",
            "",
        ]
        lines += [self.report.format(), "", _format_bytes(self.bytes, ranks), ""]
        cfg = self.config
        window = counted(cfg.window, "step")
        lines.append(f"stragglers (window {window}, threshold {cfg.threshold:g}):")
        if self.unjudged:
            lines.append(f"  none judged: {self.unjudged}")
        else:
            lines += [f"  {f.describe()}" for f in self.findings] or [
                f"  none: no rank was {1 / cfg.threshold:.2f}x slower than the fastest rank, "
                f"with the others waiting for it, for {counted(cfg.min_len, 'step')} or more "
                f"after the first {cfg.warmup} (see docs/observability.md)"
            ]
        if any(s.lowest_relative is not None for s in self.scores):
            lines += [
                "",
                f"scores (window {window}; relative: vs the fastest rank, individual: "
                "vs its own best; 1.00 = as fast; last window and lowest):",
            ]
            lines += format_scores(self.scores)
        if self.outputs:
            lines += ["", "written:"] + [f"  {p}" for p in self.outputs]
            lines.append("  (open trace.json at https://ui.perfetto.dev or chrome://tracing)")
        if self.run_settings:
            lines += ["", self.run_settings]
        return "\n".join(lines)

    @property
    def unjudged(self) -> str:
        """Why no step was scored (empty when some were): the run has fewer recorded steps
        than the warm-up plus one window, so there is neither a finding nor a score."""
        cfg, steps = self.config, self.report.steps
        if steps >= cfg.warmup + cfg.window:
            return ""
        return (
            f"the run has {counted(steps, 'step')}, fewer than the warm-up ({cfg.warmup}) plus "
            f"one window ({counted(cfg.window, 'step')}): no step was scored, so there are no "
            "findings and no scores; lower the warm-up or the window"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "window": self.config.window,
            "threshold": self.config.threshold,
            "report": self.report.to_dict(),
            "bytes": self.bytes,
            "stragglers": [f.to_dict() for f in self.findings],
            "scores": [s.to_dict() for s in self.scores],
            "outputs": [str(p) for p in self.outputs],
            **({"unjudged": self.unjudged} if self.unjudged else {}),
            **({"run_settings": self.run_settings} if self.run_settings else {}),
        }

    def run_report(self) -> dict[str, Any]:
        """What a run writes into its report.json: the report's fields at the top level (as
        ``RunReport.to_dict``), plus the straggler findings and scores ``--json`` gives."""
        return {
            **self.report.to_dict(),
            "straggler_window": self.config.window,
            "straggler_threshold": self.config.threshold,
            "straggler_warmup": self.config.warmup,
            "stragglers": [f.to_dict() for f in self.findings],
            "scores": [s.to_dict() for s in self.scores],
            "bytes": self.bytes,
        }


def analyze_run(
    run_dir: str | Path,
    window: int = 20,
    threshold: float = 0.75,
    plots: bool = True,
    warmup: int = 10,
) -> RunAnalysis:
    """Read a run directory, find stragglers, write trace.json (and the PNGs) into it."""
    cfg = StragglerConfig(window=window, threshold=threshold, warmup=warmup)
    path = Path(run_dir)
    records, spans = _read_run(path)
    analysis = analyze_records(path, records, cfg)
    membership = _read_membership(path)
    try:
        trace = write_trace(path / TRACE_FILE, records, spans, analysis.findings, membership)
        analysis.outputs.append(trace)
        if plots:
            from gradsync.telemetry.plots import write_plots  # matplotlib is slow to import

            analysis.outputs += write_plots(records, path, analysis.findings)
    except OSError as exc:  # a read-only directory, a trace.json that is a directory
        fix = (
            "free space there, or copy the run somewhere that has it"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT)
            else "make it writable, or copy it somewhere that is"
        )
        raise UsageError(
            f"cannot write {exc.filename or path} ({exc.strerror}): the report writes "
            f"{TRACE_FILE} and its plots into the run directory {path}: {fix}"
        ) from None
    return analysis


def runs_below(path: Path) -> str:
    """Where the runs are when ``path`` holds run directories rather than being one: the
    group-K/ of a ``gradsync run --replica-groups`` run, the per-strategy directories of a
    ``gradsync compare`` (each its own run). Empty when none of its sub-directories is a run."""
    try:
        found = sorted(d for d in path.iterdir() if (d / METRICS_FILE).is_file())
    except OSError:
        return ""
    if not found:
        return ""
    shown = ", ".join(str(d) for d in found[:4]) + (", ..." if len(found) > 4 else "")
    return f"its sub-directories are runs, each with its own: give one of {shown}"


def _read_run(path: Path) -> tuple[list[StepRecord], list[Span]]:
    """The step records and spans of run directory ``path``, or a one-line ``UsageError``."""
    if not path.is_dir():
        raise UsageError(f"no run directory at {str(path)!r}: pass the directory a run wrote")
    if not (path / METRICS_FILE).exists():
        raise UsageError(
            f"{str(path)!r} has no {METRICS_FILE}: "
            + (runs_below(path) or "is it a gradsync run directory?")
        )
    try:
        # A torn last line is dropped with a RuntimeWarning (records.read_jsonl); here it is
        # one line of the command's output, not Python's warning format with this source line.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            records, spans = read_records(path), read_spans(path)
        for w in caught:
            if issubclass(w.category, RuntimeWarning):
                print(f"gradsync: warning: {w.message}", file=sys.stderr)
            else:  # not the reader's: as Python would show it
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    except (ValueError, TypeError) as e:  # JSON or schema damage: its file and line say where
        raise UsageError(f"cannot report on {path}: {e}") from None
    except OSError as e:
        raise UsageError(f"cannot read {e.filename or path}: {e.strerror}") from None
    if not records:
        raise UsageError(f"{path / METRICS_FILE} holds no step records: did the run take a step?")
    return records, spans


def _read_membership(path: Path) -> GroupMembership | None:
    """Live membership's quorums, stalls and healings, where the run recorded them (None:
    it did not), or a one-line ``UsageError`` naming the damage."""
    if not (path / MEMBERSHIP_FILE).exists():
        return None
    try:
        return read_group(path)
    except ValueError as e:  # its file and line say where
        raise UsageError(f"cannot report on {path}: {e}") from None


def analyze_records(run_dir: Path, records: list[StepRecord], cfg: StragglerConfig) -> RunAnalysis:
    """The report, straggler findings, scores and bytes of ``records``; writes nothing."""
    findings = find_stragglers(records, cfg.window, cfg.threshold, warmup=cfg.warmup)
    analysis = RunAnalysis(
        run_dir, cfg, RunReport.from_records(records), findings, _bytes(records, run_dir)
    )
    analysis.scores = rank_scores(records, cfg.window, warmup=cfg.warmup)
    analysis.records = records
    return analysis


def summarize_run(
    run_dir: str | Path,
    window: int = 20,
    threshold: float = 0.75,
    plots: bool = True,
    warmup: int = 10,
) -> str:
    """Write trace.json and the PNGs into ``run_dir``; return the text summary."""
    return analyze_run(run_dir, window, threshold, plots, warmup).format()


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="summarize a finished run: per-rank table, stragglers, trace.json, plots",
        description="Summarize a run directory: per-rank compute/comm/idle, barrier tax, "
        "stragglers with evidence, bytes; writes trace.json (Perfetto) and PNG plots into it.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="directory written by `gradsync run`")
    p.add_argument("--window", type=int, default=20, help="steps per scoring window (default 20)")
    p.add_argument(
        "--threshold",
        type=float,
        default=0.75,
        help="flag a rank whose score falls below this, in (0, 1) (default 0.75)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="first steps never scored (start-up is slow everywhere) (default 10)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    analysis = analyze_run(
        args.run_dir, args.window, args.threshold, plots=not args.no_plots, warmup=args.warmup
    )
    analysis.run_settings = _run_settings(analysis)
    print(json.dumps(analysis.to_dict(), indent=2) if args.json else analysis.format())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m gradsync.telemetry.cli report RUN_DIR``)."""
    return run_commands("gradsync", add_parsers, argv)


def _run_settings(analysis: RunAnalysis) -> str:
    """A line for ``gradsync report`` run with other straggler settings than the run's own:
    report.json is the run's record, written once with its settings and the strategy's own
    measures, which the report cannot recompute; the report leaves it as it was, and only
    trace.json, the plots and this summary follow the new settings. Empty when they agree, or
    without a readable report.json."""
    path = analysis.run_dir / REPORT_FILE
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
        theirs = tuple(written[f"straggler_{k}"] for k in ("window", "threshold", "warmup"))
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    cfg = analysis.config
    if theirs == (cfg.window, cfg.threshold, cfg.warmup):
        return ""
    window, threshold, warmup = theirs
    return (
        f"note: {path} keeps the run's own findings and scores (window {window}, threshold "
        f"{threshold:g}, warm-up {warmup}) and is left as it was; the findings and scores above, "
        f"{TRACE_FILE} and the plots are for window {cfg.window}, threshold "
        f"{cfg.threshold:g}, warm-up {cfg.warmup} (--json prints them)"
    )


def _bytes(records: list[StepRecord], run_dir: Path) -> dict[str, float]:
    total = float(sum(r.bytes for r in records))
    # no records: a script that took no step and called report() (the command says so)
    out = {"total": total, "per_rank_step": total / len(records) if records else 0.0}
    try:
        fp32 = json.loads((run_dir / "config.json").read_text()).get("fp32_bytes_per_step")
    except (OSError, ValueError, AttributeError):
        fp32 = None  # config.json is optional for the report
    if isinstance(fp32, int | float) and fp32 > 0:
        out["fp32_per_rank_step"] = float(fp32)
        if out["per_rank_step"] > 0:
            out["compression_ratio"] = fp32 / out["per_rank_step"]
    return out


def _mb(nbytes: float, decimals: int = 3) -> str:
    """``nbytes`` in MB: ``decimals`` places, or three significant figures where those would
    show 0.000 (sparseloco's few hundred bytes a step read "0.000 MB per rank per step")."""
    mb = nbytes / 1e6
    return f"{mb:.{decimals}f}" if nbytes == 0 or mb >= 10**-decimals else f"{mb:.3g}"


def _times(ratio: float) -> str:
    """A ratio as "4.0x", or "1.03x" near 1 ("1.0x more than fp32" hid zero:1's 1.025)."""
    return f"{ratio:.2f}x" if ratio < 1.1 else f"{ratio:.1f}x"


def _format_bytes(b: dict[str, float], ranks: int) -> str:
    line = (
        f"bytes sent: {_mb(b['per_rank_step'])} MB per rank per step "
        f"({_mb(b['per_rank_step'] * ranks)} MB per step over {counted(ranks, 'rank')}), "
        f"{_mb(b['total'], 1 if b['total'] >= 1e5 else 3)} MB in total"  # 0.036, not 0.0
    )
    # Uncompressed runs send fp32 gradients: a "1.0x fewer" line would only be noise.
    if "compression_ratio" in b and abs(b["compression_ratio"] - 1.0) > 0.01:
        ratio = b["compression_ratio"]
        # Some strategies send more than the gradient (zero:N also gathers the parameters, a
        # parameter server replies with them): "0.6x fewer" would read as a saving.
        than = f"{_times(ratio)} fewer" if ratio > 1 else f"{_times(1 / ratio)} more"
        line += (
            f"; {than} than fp32 gradients "
            f"({b['fp32_per_rank_step'] / 1e6:.3f} MB per rank per step)"
        )
    return line


if __name__ == "__main__":
    sys.exit(main())
