"""trace.json is a well-formed Chrome trace whose spans nest; the plots are real images."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import matplotlib.image as mpimg
import numpy as np
import pytest

from gradsync.telemetry.plots import PLOT_FILES, write_plots
from gradsync.telemetry.records import METRICS_FILE, Span, StepRecord, write_records
from gradsync.telemetry.stragglers import find_stragglers, synthetic_records
from gradsync.telemetry.trace import write_trace

pytestmark = pytest.mark.unit


def load(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    events = json.loads(path.read_text())["traceEvents"]
    return [e for e in events if e["ph"] == "M"], [e for e in events if e["ph"] == "X"]


def assert_nested(spans: list[dict[str, Any]]) -> None:
    """On each thread, any two spans are disjoint or one contains the other."""
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in spans:
        by_thread[(e["pid"], e["tid"])].append(e)
    for thread, evs in by_thread.items():
        stack: list[int] = []  # end times of open spans
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1], f"{e} overlaps its parent on {thread}"
            stack.append(end)


def bucket_spans(records: list[StepRecord]) -> list[Span]:
    out = []
    for r in records:
        start = r.time + r.compute + r.idle
        for b, (off, frac) in enumerate([(0.0, 0.6), (0.4, 0.5)]):  # buckets 0 and 1 overlap
            args = {"bucket": b, "bytes": 1000}
            out.append(
                Span(
                    r.rank,
                    r.step,
                    f"allreduce[{b}]",
                    start + off * r.comm,
                    frac * r.comm,
                    "comm",
                    args,
                )
            )
        out.append(Span(r.rank, r.step, "compute", r.time, r.compute))  # records give this one
        out.append(Span(r.rank, r.step, "optimizer", start + 0.9 * r.comm, 0.1 * r.comm))
    return out


def test_trace_from_records_alone(tmp_path: Path) -> None:
    recs = synthetic_records(30, 4, seed=1)
    meta, spans = load(write_trace(tmp_path / "trace.json", recs))
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    counts = Counter(e["name"] for e in spans)
    assert counts["compute"] == counts["sync"] == 120
    assert counts["idle"] == sum(1 for r in recs if r.idle > 0)
    assert all(isinstance(e["ts"], int) and e["dur"] >= 0 for e in spans)
    assert all(isinstance(e["args"]["step"], int) for e in spans)
    assert_nested(spans)
    # Idle sits at the start of sync; sync starts where compute ends.
    rank0 = {(e["name"], e["args"]["step"]): e for e in spans if e["pid"] == 0}
    for step in range(30):
        compute, sync = rank0[("compute", step)], rank0[("sync", step)]
        assert compute["ts"] + compute["dur"] == sync["ts"]
        if ("idle", step) in rank0:
            assert rank0[("idle", step)]["ts"] == sync["ts"]


def test_trace_adds_spans_without_duplicates(tmp_path: Path) -> None:
    recs = synthetic_records(20, 2, seed=2)
    meta, spans = load(write_trace(tmp_path / "t.json", recs, bucket_spans(recs)))
    counts = Counter(e["name"] for e in spans)
    assert counts["compute"] == 40  # the spans.jsonl copy was dropped
    assert counts["allreduce[0]"] == counts["allreduce[1]"] == counts["optimizer"] == 40
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    comm_threads = {threads[(e["pid"], e["tid"])] for e in spans if e["cat"] == "comm"}
    assert comm_threads == {"comm", "comm 2"}  # overlapping buckets get a second lane
    bucket = next(e for e in spans if e["name"] == "allreduce[1]")
    assert bucket["args"] == {"step": bucket["args"]["step"], "bucket": 1, "bytes": 1000}
    assert_nested(spans)


def test_trace_nests_when_idle_exceeds_sync(tmp_path: Path) -> None:
    # Strategies without a barrier every step can record idle > sync.
    recs = [
        StepRecord(0, 0, 100.0, 0.5, 0.01, 0.3, 0.0, 1, 0),
        StepRecord(1, 0, 100.0, 0.8, 0.01, 0.0, 0.01, 1, 0),
    ]
    _, spans = load(write_trace(tmp_path / "t.json", recs))
    assert_nested(spans)


def test_trace_marks_stragglers(tmp_path: Path) -> None:
    recs = synthetic_records(100, 4, slow=[(1, 40, 99, 2.0)], seed=3)
    meta, spans = load(write_trace(tmp_path / "t.json", recs, None, find_stragglers(recs)))
    (marker,) = [e for e in spans if e["cat"] == "straggler"]
    assert marker["pid"] == 1 and marker["args"]["first_step"] == 40
    assert {
        "name": "thread_name",
        "ph": "M",
        "pid": 1,
        "tid": marker["tid"],
        "args": {"name": "stragglers"},
    } in meta
    assert_nested(spans)


def test_plots_are_written_and_not_blank(tmp_path: Path) -> None:
    recs = synthetic_records(120, 4, slow=[(2, 40, 90, 2.0)], seed=4)
    write_records(tmp_path / METRICS_FILE, recs)
    paths = write_plots(tmp_path, tmp_path / "plots", find_stragglers(recs))
    assert [p.name for p in paths] == list(PLOT_FILES)
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(p)
        assert img.shape[0] > 200 and img.shape[1] > 400
        assert np.std(img[..., :3]) > 0.05, f"{p.name} looks blank"


def test_trace_of_no_records_is_still_valid(tmp_path: Path) -> None:
    data = json.loads(write_trace(tmp_path / "t.json", []).read_text())
    assert data["traceEvents"] == [] and data["displayTimeUnit"] == "ms"


def test_merged_traces_share_one_clock_and_number_each_parts_ranks_apart() -> None:
    """RUN/trace.json of replica groups: group 1 started 2.5 s after group 0, so its events
    move 2.5 s later; its rank 0 becomes pid 1 (``first_rank``), named after its group."""
    from gradsync.telemetry.trace import merge_traces, trace_events

    def record(at: float) -> StepRecord:
        return StepRecord(0, 0, at, compute=0.1, sync=0.05, idle=0.0, comm=0.0, samples=8, bytes=0)

    early, late = trace_events([record(100.0)]), trace_events([record(102.5)])
    merged = merge_traces([("group 0", 0, early), ("group 1", 1, late)])
    assert merged["otherData"]["start_epoch_s"] == 100.0
    names = {
        e["pid"]: e["args"]["name"]
        for e in merged["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {0: "group 0 rank 0", 1: "group 1 rank 0"}
    steps = {e["pid"]: e["ts"] for e in merged["traceEvents"] if e.get("name") == "step 0"}
    assert steps == {0: 0, 1: 2_500_000}
    # the parts themselves are left as they were (each starts at its own 0)
    assert [e["ts"] for e in late["traceEvents"] if e.get("name") == "step 0"] == [0]
