"""What Linux's ``/proc/PID/stat`` says of a process: its state letter, its parent and when it
started, read one way for every module that asks (the liveness checks, the reaper, the
emulated cluster's launch and clean-up, the checkpoint writers).

The command name, in parentheses, may hold spaces and parentheses itself, so the fields are
those after its last ``)``. Torch-free (the checkpoint writer's process imports it)."""

from __future__ import annotations

import os

#: field indexes after the command name (``man 5 proc``: state is field 3, so index 0)
_STATE, _PARENT, _START = 0, 1, 19


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name, or None where the process is
    gone (or /proc is not there, or the line is not whole)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return parse_stat(f.read())
    except OSError:
        return None


def parse_stat(text: bytes) -> list[str] | None:
    """The fields of a ``/proc/PID/stat`` line after the command name (None: not whole)."""
    fields = text[text.rfind(b")") + 2 :].decode("ascii", "replace").split()
    return fields if b")" in text and len(fields) > _START else None


def state(pid: int | str) -> str | None:
    """The state letter of ``pid`` (R, S, D, T, t, Z, X...), or None where it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else fields[_STATE]


def state_and_start(pid: int | str) -> tuple[str, str] | None:
    """The state letter of ``pid`` and when it started (clock ticks after boot, which tells a
    process from a later one given the same pid), or None where it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else (fields[_STATE], fields[_START])


def parents() -> dict[int, int]:
    """Every process's parent pid, by pid (those that end while this reads are left out)."""
    found: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if entry.isdigit():
            fields = stat_fields(entry)
            if fields is not None and fields[_PARENT].isdigit():
                found[int(entry)] = int(fields[_PARENT])
    return found


__all__ = ["parents", "parse_stat", "stat_fields", "state", "state_and_start"]
