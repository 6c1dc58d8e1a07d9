"""A one-line live progress display for rank 0 (no dependency, degrades to periodic lines)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.interactive = self.stream.isatty()
        self.started = time.perf_counter()
        self._last_line_at = -1.0
        self.label = ""

    def update(self, step: int, loss: float | None, samples_per_s: float, tax: float) -> None:
        if not self.enabled:
            return
        width = 24
        done = int(width * step / max(self.total, 1))
        bar = "#" * done + "-" * (width - done)
        loss_text = "n/a" if loss is None else f"{loss:.4f}"
        prefix = f"{self.label} " if self.label else ""
        line = (
            f"{prefix}[{bar}] step {step}/{self.total}  loss {loss_text}  "
            f"{samples_per_s:,.0f} samples/s  barrier tax {tax:.1%}"
            if samples_per_s > 0
            else f"{prefix}[{bar}] step {step}/{self.total}  loss {loss_text}"
        )
        now = time.perf_counter()
        if self.interactive:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif now - self._last_line_at >= 5.0 or step >= self.total:
            # Logs and CI get a line every few seconds rather than a carriage-return storm.
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_line_at = now

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
