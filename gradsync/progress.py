"""A one-line live progress display for rank 0 (no dependency, degrades to periodic lines)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

# Rank 0 rewrites this file in the run directory at every progress update, whether or not the
# progress line is shown, so another process (`gradsync compare`) can follow a run that draws
# no line of its own, parameter-server runs included (their metrics arrive only at the end).
HEARTBEAT_FILE = "progress.json"


def read_heartbeat(run_dir: Path) -> dict[str, Any] | None:
    """The latest ``{"step", "total", "loss"}`` a run reported, or None before the first."""
    try:
        data = json.loads((Path(run_dir) / HEARTBEAT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Progress:
    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        enabled: bool = True,
        heartbeat: Path | None = None,
    ) -> None:
        self.total = total
        self.heartbeat = heartbeat
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.interactive = self.stream.isatty()
        self.started = time.perf_counter()
        self._last_line_at = -1.0
        self._last_line = ""
        self.label = ""

    def update(
        self,
        step: int,
        loss: float | None,
        samples_per_s: float,
        tax: float,
        *,
        last: bool = False,
    ) -> None:
        """``last``: the end of a run whose number of steps the line does not know (``total``
        0: a script's, under ``gradsync compare``), shown in a log as a last step is."""
        if self.heartbeat is not None:
            self._beat(step, loss)
        if not self.enabled:
            return
        loss_text = "n/a" if loss is None else f"{loss:.4f}"
        prefix = f"{self.label} " if self.label else ""
        if self.total > 0:
            width = 24
            done = min(width, int(width * step / self.total))
            where = f"[{'#' * done}{'-' * (width - done)}] step {step}/{self.total}"
        else:  # a script's own loop: its number of steps is not known here
            where = f"step {step}"
        line = f"{prefix}{where}  loss {loss_text}"
        if samples_per_s > 0:
            line += f"  {samples_per_s:,.0f} samples/s  barrier tax {tax:.1%}"
        now = time.perf_counter()
        if self.interactive:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif line != self._last_line and (
            now - self._last_line_at >= 5.0 or 0 < self.total <= step or last
        ):
            # Logs and CI get a line every few seconds rather than a carriage-return storm, and
            # the last step's once (compare's watcher and its own end both report it).
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_line_at, self._last_line = now, line

    def _beat(self, step: int, loss: float | None) -> None:
        """Replace the heartbeat file atomically: a reader never sees half a line."""
        assert self.heartbeat is not None
        tmp = self.heartbeat.with_name(self.heartbeat.name + ".tmp")
        try:
            tmp.write_text(
                json.dumps({"step": step, "total": self.total, "loss": loss}), encoding="utf-8"
            )
            os.replace(tmp, self.heartbeat)
        except OSError:  # a progress display must never stop training (e.g. a full disk)
            with contextlib.suppress(OSError):
                tmp.unlink()  # nor leave its half-written file behind

    def interrupt(self, message: str) -> None:
        """Print a line of its own (a warning) without garbling the progress line."""
        if self.interactive and self.enabled:
            self.stream.write("\n")
        self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.interactive:
            self.stream.write("\n")
            self.stream.flush()
