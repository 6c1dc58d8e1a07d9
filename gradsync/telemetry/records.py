"""The telemetry record: one per rank per step, the unit every report, plot and trace is built from.

Vocabulary (docs/observability.md), all durations in seconds:

- ``compute``: time inside the ``with sync.step():`` block.
- ``sync``: time from block exit until the update has been applied (``optimizer.step()`` done).
- ``idle``: max over ranks of ``compute`` at this step minus this rank's ``compute`` (barrier wait).
- ``comm``: ``sync - idle`` floored at zero (communication that overlap did not hide).

``bytes`` is the payload this rank handed to collectives or point-to-point sends during the
step (what the compressor put on the wire), not multiplied by the collective algorithm's factor.
``time`` is the wall-clock (Unix epoch seconds) at block entry, for timelines.

``barrier`` says whether the step ended at a barrier with the other ranks. BSP: every step.
Local SGD / DiLoCo: every H-th step; there ``idle`` generalises the definition above to the
compute every rank accumulated since the previous barrier. Parameter-server strategies have no
barrier; their ``idle`` is the wait the server imposed (SSP's staleness bound), measured.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
SPANS_FILE = "spans.jsonl"


@dataclass(slots=True)
class StepRecord:
    rank: int
    step: int
    time: float
    compute: float
    sync: float
    idle: float
    comm: float
    samples: int
    bytes: int
    loss: float | None = None
    skipped: bool = False
    barrier: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(slots=True)
class Span:
    """A timed interval on one rank, for the Perfetto timeline (compute, bucket comm, idle...)."""

    rank: int
    step: int
    name: str
    start: float
    dur: float
    cat: str = "step"
    args: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Span:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def fill_idle(
    records: Iterable[StepRecord], carry: dict[int, float] | None = None
) -> list[StepRecord]:
    """Derive ``idle`` and ``comm`` from the compute times of every rank.

    At a barrier step, idle = max over ranks of the compute accumulated since the previous
    barrier, minus the rank's own (for BSP, every step is a barrier and this is the step's
    compute). Steps without a barrier keep the idle the strategy measured. ``carry`` holds each
    rank's compute accumulated since the last barrier across calls (records arrive in batches).
    """
    out = sorted(records, key=lambda r: (r.step, r.rank))
    acc = carry if carry is not None else {}
    by_step: dict[int, list[StepRecord]] = {}
    for r in out:
        by_step.setdefault(r.step, []).append(r)
    for step in sorted(by_step):
        group = by_step[step]
        for r in group:
            acc[r.rank] = acc.get(r.rank, 0.0) + r.compute
        if any(r.barrier for r in group):
            slowest = max(acc[r.rank] for r in group)
            for r in group:
                r.idle = slowest - acc[r.rank]
                acc[r.rank] = 0.0
        for r in group:
            r.comm = max(0.0, r.sync - r.idle)
    return out


def write_records(path: Path, records: Iterable[StepRecord | Span], append: bool = True) -> None:
    with open(path, "a" if append else "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(r.to_json() + "\n")


def read_records(run_dir: str | Path) -> list[StepRecord]:
    """Read ``metrics.jsonl`` from a run directory (or the file itself): one record per rank
    per step, the latest attempt's where a restart ran a step again (see ``latest_attempts``)."""
    return latest_attempts(
        StepRecord.from_dict(d) for d in read_jsonl(_resolve(run_dir, METRICS_FILE))
    )


def latest_attempts(records: Iterable[StepRecord]) -> list[StepRecord]:
    """Every (rank, step) once: the last record of it, in the order given (file order).

    A run restarted by the elastic agent runs again the steps after its checkpoint (all of
    them, without checkpoints), and ``metrics.jsonl`` is appended to: a step's later record is
    its latest attempt, the one whose update the run kept. Counting both would count the
    rolled-back work twice. A record that replaces another takes its own place in the order
    (after the records written before it), and a file without repeats reads back unchanged.
    """
    latest: dict[tuple[int, int], StepRecord] = {}
    for r in records:
        key = (r.rank, r.step)
        latest.pop(key, None)
        latest[key] = r
    return list(latest.values())


def read_spans(run_dir: str | Path) -> list[Span]:
    path = _resolve(run_dir, SPANS_FILE)
    if not path.exists():
        return []
    return [Span.from_dict(d) for d in read_jsonl(path)]


def _resolve(run_dir: str | Path, name: str) -> Path:
    p = Path(run_dir)
    return p / name if p.is_dir() else p


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every line of a run directory's jsonl file (metrics, spans, recoveries), parsed.

    These files grow by appends, so a full disk or a crash mid-write can leave the last line
    cut short: no newline after it, not JSON. That line is dropped with a warning naming the
    file, and the rest is read, so that a resume goes on (losing one record) instead of
    failing on it. A line that does not parse anywhere else is damage no interrupted append
    makes: a ``ValueError`` naming the file and the line, for the user to look at."""
    if not path.exists():
        raise FileNotFoundError(
            f"no {path.name} in {path.parent}: is this a gradsync run directory?"
        )
    lines = path.read_bytes().split(b"\n")  # bytes: a cut can split a character, too
    found = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            found.append(json.loads(line))
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            if number < len(lines):  # a newline follows it: the line was written whole
                raise ValueError(f"{path}: line {number} is not JSON ({exc})") from None
            warnings.warn(
                f"{path}: dropped its last line (line {number}), torn by an interrupted "
                f"write: {len(line)} bytes without a newline that are not JSON",
                RuntimeWarning,
                stacklevel=2,
            )
    return found
