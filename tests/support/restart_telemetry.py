"""What tests/*/test_restart_telemetry*.py share: a metrics file torn mid-line."""

from __future__ import annotations

from pathlib import Path


def tear_last_line(path: Path) -> str:
    """Cut ``path``'s last line in the middle, as a full disk or a crash mid-write leaves it;
    the line as it was."""
    text = path.read_text()
    last = text.splitlines()[-1]
    path.write_text(text[: len(text) - len(last) // 2 - 1])  # no newline after it
    return last
