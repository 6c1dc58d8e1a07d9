"""Live membership's records (``membership="torchft"``, docs/membership.md): what each step's
quorum was, what a run's report.json says of them, and how its trace shows them.

``membership.jsonl``, in the run directory of each replica group (``RUN/group-K/`` under
``gradsync run --replica-groups``, or a script's own ``run_dir``), one line per step of the
group, written by its rank 0 when the step's commit is decided::

    {"step": 8, "restart": 0, "pid": 4242, "time": 1717.2, "quorum_id": 3, "participants": 2,
     "committed": true, "quorum_s": 5.31, "stall_s": 5.3,
     "members": ["0:9f..", "1:c4.."], "left": ["1:07.."], "joined": ["1:c4.."]}

``replica_id`` (this group's own id among the members) is on a process's first line.

``time`` is when the group asked for the step's quorum (epoch seconds); ``quorum_s`` how long
the quorum took (a replacement's healing included); ``stall_s`` how much longer than this
process's median quorum over its previous steps (null at a process's first step, which has no
normal yet); ``members`` (torchft's replica ids, ``GROUP:UUID``: a replacement is a new id) on
the first line of a process and on every line whose quorum differs from the process's previous
one, which also says who ``left`` and who ``joined`` it since; ``healed_bytes`` on the step a
replacement healed at. ``pid`` and ``restart`` (the elastic agent's count) tell a group's
processes apart: a replacement started by hand, not by an agent, is restart 0 too.

A periodic strategy (``local:H``, ``diloco:H``) joins one quorum a period, before the period's
first local step, and decides the period's average at its last: its line is at that last step
and says ``joined_at``, the step the quorum was joined before, where its members, its wait and
a healing happened; the summary tells a loss, a stall and a healing at ``joined_at`` (a
replacement's healing is at the same step in faults/healed.jsonl). The run's final average (an
incomplete last period's, in ``report()``) comes after the last step: its line says ``final``
and is at the step its quorum was joined, or at the last step a quorum decided where none was
open.

Why a file of its own rather than fields of metrics.jsonl's step records: the quorum is the
replica group's, not a rank's (every rank of a group sees the same one), and metrics.jsonl's
records travel as rows of floats gathered across the group's ranks every ``telemetry_every``
steps and saved with checkpoints, a format every reader and checkpoint shares; a survivor's
view of a loss matters most when the process dies before its next gather, so each line is
written and flushed at its step (one write per step, beside the quorum's and the commit's
round trips to the lighthouse and the Manager). ``faults/healed.jsonl`` (each healing) and
``faults/attempts.jsonl`` (each start of a group's process) stay where they are; the summary
below reads all three.

Torch-free and torchft-free: ``gradsync report`` and the run's summary read these files
anywhere, and ``gradsync.membership.ft_manager`` hands its observations over as plain values.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

MEMBERSHIP_FILE = "membership.jsonl"
#: where a group's healings and process starts are (``gradsync.attached_run`` writes them)
HEALED_PATH = Path("faults") / "healed.jsonl"
ATTEMPTS_PATH = Path("faults") / "attempts.jsonl"
#: a replica group's final model as its rank 0 had it at the end of ``report()``: the step and
#: a short hex fingerprint of its parameters, which ``gradsync run``'s summary compares across
#: groups (``compare_final_models``). Beside the group's other process records in faults/,
#: which ``--overwrite`` deletes with them.
FINAL_MODEL_PATH = Path("faults") / "final_model.json"
#: a step's quorum that took this much longer than normal is a stall in the report and the
#: trace: a lost group costs the survivors the lighthouse's heartbeat timeout (2 s) or the
#: replacement's start-up; the quorum's own jitter is milliseconds
STALL_S = 0.1
#: a process's normal quorum: the median over up to this many of its previous steps
BASELINE_STEPS = 50


def group_name(replica_id: str) -> str:
    """The replica group a torchft replica id names (``"1:UUID"`` -> ``"1"``); a bare UUID (a
    group started without ``REPLICA_GROUP_ID``) by its first 8 characters."""
    name, colon, _ = replica_id.partition(":")
    return name if colon else replica_id[:8]


class MembershipLog:
    """One process's ``membership.jsonl`` lines: ``entry`` builds a step's line from what the
    quorum was (the stall against this process's own normal, who left and joined since its
    previous quorum); ``write`` appends it to ``path`` (when given) and flushes it."""

    def __init__(self, path: Path | None, restart: int, pid: int | None = None) -> None:
        self.path = path
        self.restart = restart
        self.pid = os.getpid() if pid is None else pid
        self._history: deque[float] = deque(maxlen=BASELINE_STEPS)
        self._members: list[str] | None = None
        self._quorum_id: int | None = None
        self._steps = 0  # lines built by this process
        self._fh: IO[str] | None = None

    def entry(
        self,
        *,
        step: int,
        time: float,
        quorum_s: float,
        quorum_id: int | None,
        participants: int,
        members: list[str] | None,
        committed: bool,
        healed_bytes: int | None = None,
        replica_id: str | None = None,
        joined_at: int | None = None,
        final: bool = False,
    ) -> dict[str, Any]:
        normal = statistics.median(self._history) if self._history else None
        self._history.append(quorum_s)
        entry: dict[str, Any] = {
            "step": step,
            "restart": self.restart,
            "pid": self.pid,
            "time": time,
            "quorum_id": quorum_id,
            "participants": participants,
            "committed": committed,
            "quorum_s": round(quorum_s, 6),
            "stall_s": None if normal is None else round(max(0.0, quorum_s - normal), 6),
        }
        if self._steps == 0 and replica_id is not None:
            entry["replica_id"] = replica_id
        if members is not None and (self._steps == 0 or quorum_id != self._quorum_id):
            entry["members"] = sorted(members)
            if self._members is not None:
                entry["left"] = sorted(set(self._members) - set(members))
                entry["joined"] = sorted(set(members) - set(self._members))
        self._members = members if members is not None else self._members
        self._quorum_id = quorum_id
        self._steps += 1
        if healed_bytes is not None:
            entry["healed_bytes"] = healed_bytes
        if joined_at is not None:
            entry["joined_at"] = joined_at
        if final:
            entry["final"] = True
        return entry

    def write(self, **observed: Any) -> dict[str, Any]:
        entry = self.entry(**observed)
        if self.path is not None:
            if self._fh is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
            # Whole lines, flushed each step: a process SIGKILLed next loses none of them.
            self._fh.write(json.dumps(entry) + "\n")
            self._fh.flush()
        return entry

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


@dataclass(slots=True)
class GroupMembership:
    """What one replica group's directory recorded: its membership lines, its healings and
    its process starts (each a list of the files' JSON objects, in file order)."""

    name: str
    entries: list[dict[str, Any]]
    healed: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)


#: what every line of each file holds (the summary and the trace read these)
_NEEDS = {
    MEMBERSHIP_FILE: ("step", "time", "quorum_id", "participants", "committed", "quorum_s"),
    HEALED_PATH.name: ("step", "bytes", "seconds", "time"),
    ATTEMPTS_PATH.name: ("restart",),
}


def read_group(directory: Path, name: str = "0") -> GroupMembership:
    """A replica group's records from its run directory (files it lacks read as empty; a line
    torn by a process killed mid-write, the last one, is dropped). A line that is not JSON, or
    lacks what every line holds, is a ``ValueError`` naming the file and the line."""
    return GroupMembership(
        name,
        _jsonl(directory / MEMBERSHIP_FILE),
        _jsonl(directory / HEALED_PATH),
        _jsonl(directory / ATTEMPTS_PATH),
    )


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.endswith("}"):
            continue  # blank, or torn by a kill mid-write
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}: line {number} is not JSON ({exc})") from None
        missing = [k for k in _NEEDS[path.name] if k not in entry]
        if missing:
            raise ValueError(f"{path}: line {number} has no {', '.join(missing)}")
        found.append(entry)
    return found


def model_digest(rows: bytes) -> str:
    """16 hex digits of a SHA-256 of a model's fingerprint rows (``checks.guards.fingerprint``,
    their bytes): what ``write_final_model`` records and the run's summary compares."""
    return hashlib.sha256(rows).hexdigest()[:16]


def write_final_model(directory: Path, *, step: int, fingerprint: str, restart: int) -> None:
    """Group rank 0's record of its final model (``FINAL_MODEL_PATH``), replaced whole: a
    later ``report()`` of the same process, or of a replacement, supersedes it, and a reader
    never sees half of it."""
    path = directory / FINAL_MODEL_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"step": step, "fingerprint": fingerprint, "restart": restart, "pid": os.getpid()}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(entry) + "\n", encoding="utf-8")
    os.replace(partial, path)


def read_final_model(directory: Path) -> dict[str, Any] | None:
    """A group's final model record, or None where it wrote none (it did not end normally,
    or its script never called ``report()``). A damaged one is a ``ValueError`` naming it."""
    path = directory / FINAL_MODEL_PATH
    if not path.exists():
        return None
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    if not isinstance(entry, dict) or "step" not in entry or "fingerprint" not in entry:
        raise ValueError(f"{path} has no step or fingerprint")
    return entry


def compare_final_models(records: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """The run report's ``final_models``: each group's final model (``read_final_model``, by
    group name) and whether the groups that recorded one at the same step agree. ``agree`` is
    None where no two groups recorded one at one step (nothing to compare); ``differ`` lists
    each step where they do not, the groups at it in sets of equal fingerprints."""
    at: dict[int, dict[str, list[str]]] = {}
    for name, r in records.items():
        if r is not None:
            at.setdefault(int(r["step"]), {}).setdefault(str(r["fingerprint"]), []).append(name)
    compared = {step: models for step, models in at.items() if sum(map(len, models.values())) > 1}
    differ = [
        {"step": step, "models": sorted(models.values())}
        for step, models in sorted(compared.items())
        if len(models) > 1
    ]
    return {
        "agree": (not differ) if compared else None,
        "groups": {
            name: None if r is None else {"step": int(r["step"]), "fingerprint": r["fingerprint"]}
            for name, r in records.items()
        },
        "differ": differ,
    }


def summarize(groups: list[GroupMembership], expected: int | None = None) -> dict[str, Any]:
    """report.json's ``membership`` section over ``groups``: the quorums, the steps with fewer
    than ``expected`` participants (None: the most any quorum had), each loss seen by the
    others, the steps not committed, the replacements' healings and the stalls. Under a
    periodic strategy (``local:H``, ``diloco:H``: its lines say ``joined_at``) a line is a
    period's exchange, not a step: the counts are ``exchanges`` and
    ``exchanges_with_fewer_participants`` (``periodic``), not ``steps``."""
    entries = [(g.name, e) for g in groups for e in g.entries]
    periodic = any("joined_at" in e and not e.get("final") for _, e in entries)
    unit = "exchanges" if periodic else "steps"
    most = max((e["participants"] for _, e in entries), default=0)
    expected = most if expected is None else expected
    fewer = sorted({e["step"] for _, e in entries if e["participants"] < expected})
    stalls = [  # the quorum's wait: at the step it was joined before
        {"group": name, "step": joined_step(e), "seconds": e["stall_s"]}
        for name, e in entries
        if e.get("stall_s") is not None and e["stall_s"] >= STALL_S
    ]
    longest = max(stalls, key=lambda s: s["seconds"], default=None)
    not_committed = sorted({e["step"] for _, e in entries if not e["committed"]})
    return {
        "groups": len(groups),
        "periodic": periodic,
        # a step's exchange each (bsp, zero:N), or a period's (local:H, diloco:H)
        unit: len({e["step"] for _, e in entries}),
        "quorums": _quorums(entries),
        "expected_participants": expected,
        f"{unit}_with_fewer_participants": len(fewer),
        "fewer_participants_at": step_ranges(fewer),
        "failures": _failures(groups),
        "not_committed": len(not_committed),
        "not_committed_at": step_ranges(not_committed),
        "healings": _healings(groups),
        "stalls": stalls,
        "max_stall": longest,
        "restarts": sum(max((int(a["restart"]) for a in g.attempts), default=0) for g in groups),
    }


def _quorums(entries: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each quorum (the lighthouse's ids are the run's) once: the first step it decided and
    how many took part."""
    seen: dict[Any, dict[str, Any]] = {}
    for _, e in sorted(entries, key=lambda ne: (ne[1]["step"], ne[1]["time"])):
        if e["quorum_id"] not in seen:
            seen[e["quorum_id"]] = {
                "id": e["quorum_id"],
                "step": e["step"],
                "participants": e["participants"],
            }
    return list(seen.values())


def _failures(groups: list[GroupMembership]) -> list[dict[str, Any]]:
    """Each replica that left a quorum, once, at the first step another group saw it gone:
    which group it was and who saw it. Where a process recorded no members, its participants
    dropping from one step to the next is a loss of a replica it cannot name."""
    lost: dict[str, dict[str, Any]] = {}
    # each process's own id, named by its group's directory (ids need not name their group)
    names = {e["replica_id"]: g.name for g in groups for e in g.entries if "replica_id" in e}
    for g in groups:
        previous: dict[str, Any] | None = None
        for e in g.entries:
            for replica in _gone(previous, e):
                named = not replica.startswith("?")
                seen = lost.setdefault(
                    replica,
                    {
                        "step": joined_step(e),
                        "group": names.get(replica, group_name(replica)) if named else None,
                        "replica_id": replica if named else None,
                        "participants": e["participants"],
                        "seen_by": [],
                    },
                )
                if g.name not in seen["seen_by"]:
                    seen["seen_by"].append(g.name)
            previous = e
    return sorted(lost.values(), key=lambda f: (f["step"], f["group"] or ""))


def _gone(previous: dict[str, Any] | None, entry: dict[str, Any]) -> list[str]:
    """The replicas ``entry``'s quorum lost since ``previous``, the same process's line
    before it (``?@STEP`` for one it cannot name)."""
    if "left" in entry:
        return list(entry["left"])
    if previous is None or _process(previous) != _process(entry) or "members" in entry:
        return []
    if entry["participants"] < previous["participants"]:
        return [f"?@{joined_step(entry)}"]
    return []


def peer_healings(group: GroupMembership) -> list[dict[str, Any]]:
    """The group's healings that caught a process up with a live peer: a replacement's (a
    later process than the group's first), or a process's that had already taken part in a
    quorum at an earlier step (it fell behind: cut off from the others by a partition, or its
    step not committed) and stays restart 0. Not: the first quorum's sync of groups that
    started apart."""
    first = _process(group.entries[0]) if group.entries else None
    took_part_from: dict[tuple[int, int | None], int] = {}
    for e in group.entries:
        key = _process(e)
        took_part_from[key] = min(took_part_from.get(key, joined_step(e)), joined_step(e))
    found = []
    for h in group.healed:
        since = took_part_from.get(_process(h))
        if _is_replacement(h, first) or (since is not None and since < int(h["step"])):
            found.append(h)
    return found


def _healings(groups: list[GroupMembership]) -> dict[str, Any]:
    """The healings from a live peer (``peer_healings``): a replacement's, or a cut-off live
    process's. The first process's sync at the first quorum of groups that started apart is
    counted apart (``initial_syncs``)."""
    healed, initial = [], 0
    for g in groups:
        caught_up = peer_healings(g)
        healed += [(g.name, h) for h in caught_up]
        initial += len(g.healed) - len(caught_up)
    return {
        "count": len(healed),
        "bytes": sum(int(h["bytes"]) for _, h in healed),
        "seconds": round(sum(float(h["seconds"]) for _, h in healed), 6),
        "at": [
            {"group": name, "step": h["step"], "bytes": h["bytes"], "seconds": h["seconds"]}
            for name, h in healed
        ],
        "initial_syncs": initial,
    }


def joined_step(entry: dict[str, Any]) -> int:
    """The step a line's quorum was joined before: where its members, its wait and a healing
    happened (a periodic strategy's line is at the step whose average it decided, later)."""
    return int(entry.get("joined_at", entry["step"]))


def _process(entry: dict[str, Any]) -> tuple[int, int | None]:
    """Which of a group's processes wrote a line (its restart, its pid where it says)."""
    return int(entry.get("restart", 0)), entry.get("pid")


def _is_replacement(healed: dict[str, Any], first: tuple[int, int | None] | None) -> bool:
    """Whether a healing was a later process's than the group's first: a restart by the
    elastic agent, or (where the lines name pids) another process started in its place."""
    if int(healed.get("restart", 0)) > 0:
        return True
    pid = healed.get("pid")
    return first is not None and pid is not None and first[1] is not None and pid != first[1]


def step_ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"`` (sorted, distinct steps)."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def describe(
    section: dict[str, Any],
    exits: Sequence[int] | None = None,
    final_models: dict[str, Any] | None = None,
) -> str:
    """The summary's one line of a ``summarize`` section, e.g. ``membership: 2 quorums; lost
    group 1 at step 8 (seen by group 0); 0 of 30 steps with fewer than 2 participants; 1
    healing (0.04 MB in 1.39 s); longest stall 2.05 s (group 0, step 8)``; under a periodic
    strategy, ``0 of 15 exchanges (one a period) with fewer than 2 participants``.

    ``exits``: each group's exit status, group K's at K, where the caller knows them. A loss
    the records show is one a quorum saw: a group that failed with every other (no quorum
    left to see it go) is in none, so "no group lost" is said only where ``exits`` are all 0;
    a group that exited otherwise is named (``group 1 exited 1``), and without ``exits`` no
    loss seen is said as that.

    ``final_models``: the run report's (``compare_final_models``), said last (``final models
    equal across 2 groups (step 30)``); where they differ, ``final_models_warning`` says how."""
    parts = [counted(len(section["quorums"]), "quorum")]
    finished = [f for f in section["failures"] if _finished_there(f, final_models)]
    lost = [
        f"group {f['group'] or '?'} at step {f['step']} (seen by group {', '.join(f['seen_by'])})"
        for f in section["failures"]
        if f not in finished
    ]
    failed = [f"group {k} exited {code}" for k, code in enumerate(exits or ()) if code != 0]
    if lost:
        parts.append("lost " + ", ".join(lost))
    if finished:
        # left the quorum by ending its run there, while another group went on (a script's
        # own loop counting past the steps it healed over, or --min-replicas 1 after a stall)
        parts.append(
            "finished before the others: "
            + ", ".join(
                f"group {f['group']} at step {f['step']} (seen by group {', '.join(f['seen_by'])})"
                for f in finished
            )
        )
    if not lost and not finished:
        seen_all = exits is not None and not failed
        parts.append("no group lost" if seen_all else "no loss seen by a quorum")
    parts += failed
    unit = "exchange" if section.get("periodic") else "step"
    fewer = section[f"{unit}s_with_fewer_participants"]
    at = section["fewer_participants_at"]
    parts.append(
        f"{fewer} of {counted(section[unit + 's'], unit)}"
        + (" (one a period)" if unit == "exchange" else "")
        + f" with fewer than {section['expected_participants']} participants"
        + (f" ({'at step(s) ' if unit == 'exchange' else ''}{at})" if fewer else "")
    )
    healings = section["healings"]
    parts.append(
        f"{counted(healings['count'], 'healing')} ({healings['bytes'] / 1e6:.2f} MB in "
        f"{healings['seconds']:.2f} s)"
    )
    longest = section["max_stall"]
    parts.append(
        f"longest stall {longest['seconds']:.2f} s (group {longest['group']}, step "
        f"{longest['step']})"
        if longest is not None
        else f"no stall over {STALL_S:g} s"
    )
    if section["not_committed"]:
        parts.append(f"not committed: step(s) {section['not_committed_at']}")
    if final_models is not None:
        parts.append(_final_models_said(final_models))
    return "membership: " + "; ".join(parts)


def _finished_there(failure: dict[str, Any], final_models: dict[str, Any] | None) -> bool:
    """Whether a replica the others saw leave (``_failures``) left by ending its run: its
    group's final model was recorded (at the end of ``report()``) at that step or before. A
    group lost mid-run and replaced ends later than the step it was lost at."""
    if final_models is None or failure["group"] is None:
        return False
    record = final_models["groups"].get(str(failure["group"]))
    return record is not None and int(record["step"]) <= int(failure["step"])


def _final_models_said(section: dict[str, Any]) -> str:
    """The membership line's part of ``compare_final_models``'s section."""
    if section["agree"] is False:
        return "final models differ (warning below)"
    groups = section["groups"]
    at: dict[int, list[str]] = {}
    for name, g in groups.items():
        if g is not None:
            at.setdefault(int(g["step"]), []).append(name)
    compared = {step: names for step, names in sorted(at.items()) if len(names) > 1}
    apart = [
        f"{_groups([name])} " + ("none recorded" if g is None else f"at step {g['step']}")
        for name, g in groups.items()
        if g is None or len(at[int(g["step"])]) == 1
    ]
    if len(compared) == 1 and not apart:
        ((step, names),) = compared.items()
        return f"final models equal across {len(names)} groups (step {step})"
    equal = [f"{_groups(names)} (step {step})" for step, names in compared.items()]
    said = ["final models equal across " + ", ".join(equal)] if equal else []
    return ", ".join([*said, "final models not compared: " + ", ".join(apart)])


def final_models_warning(section: dict[str, Any], membership: dict[str, Any]) -> str | None:
    """The summary's warning where groups that ended at one step hold different models
    (``compare_final_models``'s section), and why that happens: None where none differ.
    ``membership``: the run's ``summarize`` section, whose steps with fewer participants are
    where a group trained without the others."""
    if section["agree"] is not False:
        return None
    groups = section["groups"]
    said = [
        f"at step {d['step']}, "
        + " != ".join(
            f"{_groups(names)} ({groups[names[0]]['fingerprint']})" for names in d["models"]
        )
        for d in section["differ"]
    ]
    fewer = membership.get("fewer_participants_at") or "none recorded"
    return (
        "warning: the replica groups' final models differ: " + "; ".join(said) + "\n"
        "  a group cut off from the quorum (stopped, or partitioned, past the lighthouse's "
        "heartbeat timeout) trains on alone, and the others without it: fewer than "
        f"{membership.get('expected_participants', '?')} participants at step(s) {fewer}; "
        'see docs/membership.md, "Final models"'
    )


def _groups(names: Sequence[str]) -> str:
    return f"group {names[0]}" if len(names) == 1 else f"groups {', '.join(names)}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """ "1 step", "2 steps" (``plural`` where it is not ``noun`` + "s": "2 processes"): also
    the run report's header (``telemetry.cli``) and ``gradsync run``'s lines."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def trace_marks(group: GroupMembership) -> list[dict[str, Any]]:
    """What a group's trace shows of its membership, as ``{"name", "start", "dur", "args"}``
    (epoch seconds; ``dur`` None: an instant): each new quorum, each stall, each step not
    committed, and each healing (healed.jsonl's time is when it was loaded)."""
    marks: list[dict[str, Any]] = []
    args: dict[str, Any]
    for e in group.entries:
        if "members" in e:
            change = _change(e)
            name = f"quorum {e['quorum_id']}: {e['participants']} participant(s){change}"
            keys = ("step", "joined_at", "quorum_id", "members", "left", "joined")
            args = {k: e[k] for k in keys if k in e}
            marks.append({"name": name, "start": e["time"], "dur": None, "args": args})
        stall = e.get("stall_s")
        if stall is not None and stall >= STALL_S:
            args = {"step": joined_step(e), "stall_s": stall, "quorum_id": e["quorum_id"]}
            name = f"stall {stall:.2f} s (quorum)"
            marks.append({"name": name, "start": e["time"], "dur": e["quorum_s"], "args": args})
        if not e["committed"]:
            args = {"step": e["step"], "quorum_id": e["quorum_id"]}
            marks.append({"name": "not committed", "start": e["time"], "dur": None, "args": args})
    for h in group.healed:
        args = {k: h[k] for k in ("step", "bytes", "seconds", "restart") if k in h}
        name = f"healed from a peer: step {h['step']}, {h['bytes'] / 1e6:.2f} MB"
        start = float(h["time"]) - float(h["seconds"])
        marks.append({"name": name, "start": start, "dur": h["seconds"], "args": args})
    return sorted(marks, key=lambda m: m["start"])


def _change(entry: dict[str, Any]) -> str:
    left = [group_name(r) for r in entry.get("left") or ()]
    joined = [group_name(r) for r in entry.get("joined") or ()]
    said = ([f"lost group {', '.join(left)}"] if left else []) + (
        [f"joined group {', '.join(joined)}"] if joined else []
    )
    return f" ({'; '.join(said)})" if said else ""
