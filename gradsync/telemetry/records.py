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
import math
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

#: how much of a file's end is read at a time to find its last newline (``_cut_torn_tail``)
_TAIL_CHUNK = 1 << 16

try:  # where the system has no flock (Windows), records are appended unlocked
    import fcntl
except ImportError:  # pragma: no cover - not on Linux or macOS
    fcntl = None  # type: ignore[assignment]

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
    #: which attempt of the run took the step: 0, then the elastic agent's restart count
    #: (``TORCHELASTIC_RESTART_COUNT``) after each restart. The records ``sync.load`` restores
    #: from a checkpoint are written by the attempt that loads them, with the number of the
    #: attempt that ran them (each pending row carries it: ``timing._COLUMNS``); those of a
    #: checkpoint written before the rows carried it get the loading attempt's. Written only
    #: where not 0
    attempt: int = 0
    #: False for a record its rank wrote alone, no gather having taken it (a script that
    #: never calls ``report()``, a rank stopped by a signal): its ``idle`` and ``comm`` need
    #: the other ranks' records of the step, which ``read_records`` derives; written only
    #: where False
    gathered: bool = True

    def to_json(self) -> str:
        data = asdict(self)
        if not self.attempt:
            del data["attempt"]
        if self.gathered:
            del data["gathered"]
        return json.dumps(data, separators=(",", ":"))

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
    compute). Steps without a barrier keep the idle the strategy measured.
    ``carry`` holds each rank's compute accumulated since the last barrier across calls
    (records arrive in batches).
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
    """Write ``records`` to ``path``, one line each, in one write under an exclusive lock of
    the file where the system has ``flock``: rank 0 appends every gathered batch to
    ``metrics.jsonl``, and a rank closed without ``report()`` appends its own last records
    (``AttachedRun.write_own_records``), maybe at the same moment."""
    text = "".join(r.to_json() + "\n" for r in records)
    try:
        with open(path, "a" if append else "w", encoding="utf-8") as fh:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # released when the file closes
            if append:
                _cut_torn_tail(path, fh.fileno())
            fh.write(text)
    except OSError as exc:
        if exc.filename is not None:
            raise
        # a write's error (a full disk) names no file: "OSError: [Errno 28] No space left on
        # device" alone left the user to guess which one
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc


def drop_steps_from(path: Path, step: int) -> None:
    """A JSON-lines file of records with a ``"step"`` (``spans.jsonl``, a replica group's
    ``membership.jsonl``) less those of the steps a resume runs again (``step`` on), under the
    lock every append takes (``write_records``): each rank appends its own spans as it goes
    (``Synchronizer``), so the file outlives a killed attempt. A torn line goes too."""
    if not path.exists():
        return
    with open(path, "r+", encoding="utf-8") as fh:
        if fcntl is not None:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # released when the file closes
        kept = []
        for line in fh.read().splitlines():
            try:
                if int(json.loads(line)["step"]) < step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue
        fh.seek(0)
        fh.truncate()
        fh.write("".join(kept))


def _cut_torn_tail(path: Path, fd: int) -> None:
    """A last line without its newline (a crash or a full disk cut an append short) is cut
    off before the next append, with a warning: appended to, it would become a line that is
    not JSON in the middle of the file, which every later read refuses (a resume's restored
    records are written before anything reads the file)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return
    with open(path, "rb") as raw:  # ``fd`` is the appender's, write-only
        raw.seek(size - 1)
        if raw.read(1) == b"\n":
            return  # whole: one byte read per append
        keep = size
        while keep > 0:  # back to the byte after the last newline, a chunk at a time
            start = max(0, keep - _TAIL_CHUNK)
            raw.seek(start)
            chunk = raw.read(keep - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            keep = start
    os.ftruncate(fd, keep)
    warnings.warn(
        f"{path}: dropped its last line, torn by an interrupted write ({size - keep} bytes "
        "without a newline), before appending to it",
        RuntimeWarning,
        stacklevel=4,
    )


def read_records(run_dir: str | Path) -> list[StepRecord]:
    """Read ``metrics.jsonl`` from a run directory (or the file itself): one record per rank
    per step, the latest attempt's where a restart ran a step again (see ``latest_attempts``).
    A record whose field holds what no run writes (a string, NaN, a negative or absurd time) is
    a ``ValueError`` naming the file, the line, the field and what is valid."""
    path = _resolve(run_dir, METRICS_FILE)
    records = []
    for number, data in _read_lines(path):
        try:
            records.append(StepRecord.from_dict(check_record(data)))
        except ValueError as exc:
            raise ValueError(f"{path}: line {number}: {exc}") from None
    return settle_ungathered(latest_attempts(records))


def settle_ungathered(records: list[StepRecord]) -> list[StepRecord]:
    """``records``, with ``idle`` and ``comm`` derived (``fill_idle``) for those no gather
    took, from every rank's records of their steps, attempt by attempt. Each rank wrote them
    alone, with the idle its strategy measured (0 at a barrier) and no comm: a script that
    never called ``report()`` (a front-door port) reported comm 0, idle 0 and a barrier tax
    of 0% for its steps. Where a step's records are missing from some rank (a rank killed
    before its write), its idle is derived from the ranks whose records are there. In place,
    in the order given."""
    attempts: dict[int, list[StepRecord]] = {}
    for r in records:
        if not r.gathered:
            attempts.setdefault(r.attempt, []).append(r)
    for own in attempts.values():
        fill_idle(own)
    return records


#: bounds of a step record's numbers: far beyond any run, and small enough that the report's
#: sums and differences of them stay finite (1e9 s is 31 years; 1e12 s after the epoch, the
#: year 33658)
MAX_SECONDS = 1e9
MAX_TIME = 1e12
_INTEGERS = {"rank": 2**31, "step": 2**53, "samples": 2**63, "bytes": 2**63}
_DURATIONS = ("compute", "sync", "idle", "comm")


def check_record(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` if it is a step record as gradsync writes one, else a ``ValueError`` naming the
    first bad field, its value and what is valid. ``loss`` may be NaN or infinite: a diverged
    step's loss is recorded as it was."""
    missing = [f.name for f in fields(StepRecord) if f.name not in data and f.name in _REQUIRED]
    if missing:
        raise ValueError(f"a step record needs {', '.join(missing)}, and this one has none")
    for name, limit in _INTEGERS.items():
        value = data[name]
        if not (_is_number(value) and value == int(value) and 0 <= value < limit):
            raise ValueError(
                f"{name} is {_shown(value)}: valid is a whole number from 0 to {limit - 1}"
            )
    if not (_is_number(data["time"]) and abs(data["time"]) <= MAX_TIME):
        raise ValueError(
            f"time is {_shown(data['time'])}: valid is the wall-clock in seconds since the "
            f"epoch, a number within {MAX_TIME:g}"
        )
    for name in _DURATIONS:
        value = data[name]
        if not (_is_number(value) and 0 <= value <= MAX_SECONDS):
            raise ValueError(
                f"{name} is {_shown(value)}: valid is a duration in seconds, from 0 to "
                f"{MAX_SECONDS:g}"
            )
    loss = data.get("loss")
    if loss is not None and not (isinstance(loss, int | float) and not isinstance(loss, bool)):
        raise ValueError(
            f"loss is {_shown(loss)}: valid is a number (NaN for a diverged step) or null"
        )
    for name in ("skipped", "barrier", "gathered"):
        if not isinstance(data.get(name, False), bool):
            raise ValueError(f"{name} is {_shown(data[name])}: valid is true or false")
    attempt = data.get("attempt", 0)
    if not (_is_number(attempt) and attempt == int(attempt) and 0 <= attempt < 2**31):
        raise ValueError(
            f"attempt is {_shown(attempt)}: valid is a whole number from 0 (the run's first "
            "attempt) to 2147483647"
        )
    return data


_REQUIRED = frozenset(("rank", "step", "time", *_DURATIONS, "samples", "bytes"))


def _shown(value: object) -> str:
    """``value`` as the file spells it (true, NaN, "x"), not as Python does."""
    return json.dumps(value)


#: what ``json.loads`` returns, by the name JSON gives it
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def _is_number(value: object) -> bool:
    """A finite int or float, not a bool (JSON's true is no count or time)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def latest_attempts(records: Iterable[StepRecord]) -> list[StepRecord]:
    """Every (rank, step) once: the last record of it, in the order given (file order).

    A run restarted by the elastic agent runs again the steps after its checkpoint (all of
    them, without checkpoints), and ``metrics.jsonl`` is appended to: a step's later record is
    its latest attempt, the one whose update the run kept. Counting both would count the
    rolled-back work twice. A record that replaces another takes its own place in the order
    (after the records written before it), and a file without repeats reads back unchanged.

    A script that resumes through ``sync.load`` keeps its step numbers across a restart
    (``load`` drops the records of the steps that run again). One that resumes from its own
    checkpoint, or starts over, counts from 0 again in each attempt: an attempt whose steps
    repeat an earlier attempt's is another stretch of the run's work, not a rerun gradsync
    can place, and its steps are numbered on after the earlier attempts' last
    (``restarted_counts``), so that no attempt's records replace another's.
    """
    listed = list(records)
    shift = restarted_counts(listed)
    latest: dict[tuple[int, int], StepRecord] = {}
    for r in listed:
        if shift.get(r.attempt):
            r = replace(r, step=r.step + shift[r.attempt])
        key = (r.rank, r.step)
        latest.pop(key, None)
        latest[key] = r
    return list(latest.values())


def restarted_counts(records: Iterable[StepRecord]) -> dict[int, int]:
    """The attempts (``StepRecord.attempt``) whose step count began again: ``{attempt: the
    steps its numbers are moved by}``, the earlier attempts' last step + 1. An attempt began
    again where its records start at step 0 and a (rank, step) of them is one of an earlier
    attempt's (a replica group's replacement, which heals forward from a live peer's step,
    starts past 0)."""
    by_attempt: dict[int, list[StepRecord]] = {}
    for r in records:
        by_attempt.setdefault(r.attempt, []).append(r)
    shift: dict[int, int] = {}
    seen: set[tuple[int, int]] = set()
    end = 0  # the earlier attempts' last step + 1, as numbered on
    for attempt in sorted(by_attempt):
        own = by_attempt[attempt]
        again = min(r.step for r in own) == 0 and any((r.rank, r.step) in seen for r in own)
        moved = end if again else 0
        if moved:
            shift[attempt] = moved
        seen.update((r.rank, r.step + moved) for r in own)
        end = max(end, max(r.step + moved for r in own) + 1)
    return shift


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
    makes: a ``ValueError`` naming the file and the line, for the user to look at; so is a
    line that is JSON but not an object (every record is one)."""
    found = []
    for _, data in _read_lines(path):  # a loop, not a comprehension: the warning's stacklevel
        found.append(data)
    return found


def _read_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of each line of ``path``, as ``read_jsonl`` reads them."""
    if not path.exists():
        raise FileNotFoundError(
            f"no {path.name} in {path.parent}: is this a gradsync run directory?"
        )
    if not path.is_file():
        raise ValueError(
            f"{path} is not a file (a directory?): it should be the file of records gradsync "
            "writes, one JSON object per line"
        )
    lines = path.read_bytes().split(b"\n")  # bytes: a cut can split a character, too
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            if number < len(lines):  # a newline follows it: the line was written whole
                raise ValueError(f"{path}: line {number} is not JSON ({exc})") from None
            warnings.warn(
                f"{path}: dropped its last line (line {number}), torn by an interrupted "
                f"write: {len(line)} bytes without a newline that are not JSON",
                RuntimeWarning,
                stacklevel=3,  # the reader's caller
            )
            continue
        if not isinstance(data, dict):
            raise ValueError(
                f"{path}: line {number} is a JSON {_JSON_TYPES.get(type(data), 'value')}, not "
                'an object: each line is one record, {"rank": ..., "step": ..., ...}'
            )
        yield number, data
