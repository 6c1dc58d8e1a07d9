"""``trace.json``: a Chrome trace event file (Perfetto, chrome://tracing) of a run.

One process per rank. Thread "step" holds what the step records give, nested as
``step N`` > ``compute`` | ``sync`` > ``idle`` (idle is the first ``idle`` seconds of sync: the
barrier wait comes before the communication that finishes the step). Spans from spans.jsonl
(bucket all-reduces, optimizer...) go on their own threads, one per category, because their
clocks are read at other points than the records' and need not nest inside the derived spans;
overlapping spans (buckets in flight together) get extra lanes instead of breaking the nesting.
Spans that records already give (compute, sync, idle of a recorded step) are not repeated.
Straggler findings appear as spans on a "stragglers" thread of the rank they name. Under live
membership (``membership.jsonl`` in the run directory) a "membership" thread of rank 0, the
replica group's, shows each new quorum as an instant, each stall and healing as a span, and
each step not committed as an instant (``gradsync.telemetry.membership.trace_marks``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gradsync.telemetry.membership import GroupMembership, trace_marks
from gradsync.telemetry.records import Span, StepRecord
from gradsync.telemetry.stragglers import Finding

__all__ = ["merge_traces", "trace_events", "write_trace"]

_DERIVED = ("compute", "sync", "idle")
_STEP_TID, _FINDING_TID = 0, 1
#: after the lanes of spans.jsonl's categories (2 and up), however many a rank has
_MEMBERSHIP_TID = 99
_US = 1e6


class _Builder:
    """The events of one trace: spans in integer microseconds from the run's start, and the
    name of every (rank, thread) lane they use."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.events: list[dict[str, Any]] = []
        self.threads: dict[tuple[int, int], str] = {}

    def us(self, t: float) -> int:
        # Integer microseconds from the run's start: epoch floats carry ~0.2 us of rounding, and
        # children computed separately from their parent could poke out of it by that much.
        return round((t - self.t0) * _US)

    def span(self, rank: int, tid: int, name: str, cat: str, a: int, b: int, args: Any) -> None:
        ev = {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": tid}
        self.events.append({**ev, "ts": a, "dur": max(0, b - a), "args": args})

    def steps(self, recs: list[StepRecord]) -> set[tuple[int, int]]:
        """A step span per record, split into compute, sync and idle; returns the (rank, step)
        pairs recorded."""
        recorded: set[tuple[int, int]] = set()
        for r, nxt in zip(recs, [*recs[1:], None], strict=False):
            recorded.add((r.rank, r.step))
            self.threads[(r.rank, _STEP_TID)] = "step"
            args = {"step": r.step}
            start = self.us(r.time)
            sync = start + round(r.compute * _US)
            end = sync + round(r.sync * _US)
            if nxt is not None and nxt.rank == r.rank:
                # Rounding each boundary on its own can push a step 1 us into the next one.
                end = max(start, min(end, self.us(nxt.time)))
                sync = min(sync, end)
            self.span(r.rank, 0, f"step {r.step}", "step", start, end, {**args, "bytes": r.bytes})
            self.span(r.rank, 0, "compute", "compute", start, sync, args)
            self.span(r.rank, 0, "sync", "sync", sync, end, {**args, "comm_s": r.comm})
            if r.idle > 0:
                # min(): strategies without a barrier every step can carry idle > sync.
                idle_end = min(end, sync + round(r.idle * _US))
                self.span(r.rank, 0, "idle", "idle", sync, idle_end, args)
        return recorded

    def extra_spans(self, extra: list[Span], recorded: set[tuple[int, int]]) -> None:
        """Spans the strategies recorded, each category on as many lanes as its overlaps need."""
        lanes: dict[tuple[int, str], list[int]] = {}  # (rank, cat) -> end time of each lane
        tids: dict[tuple[int, str, int], int] = {}
        for s in extra:
            if s.name in _DERIVED and (s.rank, s.step) in recorded:
                continue
            a = self.us(s.start)
            b = a + round(s.dur * _US)
            ends = lanes.setdefault((s.rank, s.cat), [])
            lane = next((i for i, end in enumerate(ends) if end <= a), len(ends))
            if lane == len(ends):
                ends.append(0)
            ends[lane] = b
            key = (s.rank, s.cat, lane)
            if key not in tids:
                tids[key] = 2 + sum(1 for k in tids if k[0] == s.rank)
                label = "runtime" if s.cat == "step" else s.cat
                self.threads[(s.rank, tids[key])] = label if lane == 0 else f"{label} {lane + 1}"
            self.span(s.rank, tids[key], s.name, s.cat, a, b, {"step": s.step, **(s.args or {})})

    def findings(self, recs: list[StepRecord], findings: Sequence[Finding]) -> None:
        for f in findings:
            if f.rank is None or not recs:
                continue
            inside = [r for r in recs if r.rank == f.rank and f.first_step <= r.step <= f.last_step]
            if inside:
                last = inside[-1]
                start, end = self.us(inside[0].time), self.us(last.time + last.compute + last.sync)
                why = {"first_step": f.first_step, "last_step": f.last_step, "why": f.describe()}
                name = f"straggler: {f.slowdown:.1f}x slower"
                self.span(f.rank, _FINDING_TID, name, "straggler", start, end, why)
                self.threads[(f.rank, _FINDING_TID)] = "stragglers"

    def membership(self, marks: list[dict[str, Any]]) -> None:
        """The replica group's quorums, stalls, healings and uncommitted steps
        (``trace_marks``), on rank 0."""
        for mark in marks:
            a = self.us(mark["start"])
            ev = {"name": mark["name"], "cat": "membership", "pid": 0, "tid": _MEMBERSHIP_TID}
            if mark["dur"] is None:  # an instant, drawn across its thread
                self.events.append({**ev, "ph": "i", "s": "t", "ts": a, "args": mark["args"]})
            else:
                self.span(
                    0,
                    _MEMBERSHIP_TID,
                    mark["name"],
                    "membership",
                    a,
                    a + round(mark["dur"] * _US),
                    mark["args"],
                )
            self.threads[(0, _MEMBERSHIP_TID)] = "membership"

    def metadata(self) -> list[dict[str, Any]]:
        meta: list[dict[str, Any]] = []
        for rank in sorted({pid for pid, _ in self.threads}):
            meta.append(_meta("process_name", rank, 0, {"name": f"rank {rank}"}))
            meta.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
        for (rank, tid), name in sorted(self.threads.items()):
            meta.append(_meta("thread_name", rank, tid, {"name": name}))
            meta.append(_meta("thread_sort_index", rank, tid, {"sort_index": tid}))
        return meta


def trace_events(
    records: Iterable[StepRecord],
    spans: Iterable[Span] | None = None,
    findings: Sequence[Finding] = (),
    membership: GroupMembership | None = None,
) -> dict[str, Any]:
    recs = sorted(records, key=lambda r: (r.rank, r.step))
    extra = sorted(spans or (), key=lambda s: (s.rank, s.start))
    marks = trace_marks(membership) if membership is not None else []
    # A replacement's first quorum and healing come before its first step record.
    times = [r.time for r in recs] + [s.start for s in extra] + [m["start"] for m in marks]
    # Offsets from the run's start keep microsecond precision that epoch microseconds would lose.
    t0 = min(times) if times else 0.0
    trace = _Builder(t0)
    trace.extra_spans(extra, trace.steps(recs))
    trace.findings(recs, findings)
    trace.membership(marks)
    return {
        "traceEvents": trace.metadata() + trace.events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "gradsync", "start_epoch_s": t0},
    }


def write_trace(
    path: str | Path,
    records: Iterable[StepRecord],
    spans: Iterable[Span] | None = None,
    findings: Sequence[Finding] = (),
    membership: GroupMembership | None = None,
) -> Path:
    """Write the trace of ``records`` (+ ``spans`` from spans.jsonl, + ``findings``, + the
    replica group's ``membership``) to ``path``."""
    out = Path(path)
    with open(out, "w", encoding="utf-8") as fh:
        trace = trace_events(records, spans, findings, membership)
        json.dump(trace, fh, separators=(",", ":"))
    return out


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def merge_traces(parts: Sequence[tuple[str, int, dict[str, Any]]]) -> dict[str, Any]:
    """One trace of several runs' traces (``trace_events``' dicts) on one clock: each part is
    ``(label, first_rank, trace)``, its ranks renumbered from ``first_rank`` and named
    ``"{label} rank R"``, its times shifted by its ``start_epoch_s`` from the earliest one's.
    What ``gradsync run --replica-groups`` writes as ``RUN/trace.json``: every group's steps,
    quorums, stalls and healings side by side (each group's own trace starts at its own
    first event, so a replacement's healing and the survivors' stall would not line up)."""
    starts = [float(t.get("otherData", {}).get("start_epoch_s", 0.0)) for _, _, t in parts]
    t0 = min(starts, default=0.0)
    events: list[dict[str, Any]] = []
    for (label, first_rank, trace), start in zip(parts, starts, strict=True):
        shift = round((start - t0) * _US)
        for ev in trace.get("traceEvents", []):
            moved = {**ev, "pid": first_rank + int(ev.get("pid", 0))}
            if ev.get("ph") == "M":
                if ev.get("name") == "process_name":
                    moved["args"] = {"name": f"{label} rank {ev['pid']}"}
                elif ev.get("name") == "process_sort_index":
                    moved["args"] = {"sort_index": moved["pid"]}
            else:
                moved["ts"] = int(ev["ts"]) + shift
            events.append(moved)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "gradsync", "start_epoch_s": t0},
    }
