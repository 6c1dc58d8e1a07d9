"""gradsync's loggers: every notice that is not a command's own output (a restart resumed at
step N, a rank training on the CPU where a GPU is visible, hogwild's counters, a tracker that
failed) goes to a logger under ``gradsync`` (stdlib ``logging``: ``gradsync.run``,
``gradsync.runtime``, ...), which the user configures like any other::

    logging.getLogger("gradsync").setLevel(logging.WARNING)    # notices off, warnings kept

``GRADSYNC_LOG_LEVEL`` (``debug``, ``info``, ``warning``, ``error``) sets the level before any
code runs, for ranks started by ``gradsync run`` or torchrun. The default is ``info``.

Why a handler of our own: a library usually adds none and leaves output to the application's
logging set-up, but most scripts set none, and Python's last-resort handler shows warnings
only: a restart's "resuming at step 10" would vanish. So the ``gradsync`` logger has one
handler, which prints ``gradsync: message`` on standard error, and only while the application
has configured no handler of its own on the root logger: once it has, records reach the
application's handlers (they propagate) and ours stays quiet, so nothing is shown twice.

Warnings a caller may want to catch or filter (``CheckpointWarning``, ``DivergenceWarning``)
stay ``warnings.warn``; the ``gradsync`` command shows them as one ``gradsync: ...`` line
each (``one_line_warnings``: its ranks, and its own process where it reads checkpoints).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import TextIO

__all__ = ["LEVEL_ENV", "get_logger", "one_line_warnings"]

LEVEL_ENV = "GRADSYNC_LOG_LEVEL"
_LEVELS = ("debug", "info", "warning", "error")


class _UnlessConfigured(logging.Handler):
    """Prints ``gradsync: message`` on the current standard error while the root logger has no
    handler (the application configured no logging); silent otherwise."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the application's handlers get it: the record propagates to them
        try:
            text = self.format(record)
            sys.stderr.write(f"gradsync: {text.removeprefix('gradsync: ')}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never fail the caller
            self.handleError(record)


def _configure() -> logging.Logger:
    root = logging.getLogger("gradsync")
    if not any(isinstance(h, _UnlessConfigured) for h in root.handlers):
        root.addHandler(_UnlessConfigured())
    chosen = os.environ.get(LEVEL_ENV, "info").strip().lower() or "info"
    if chosen not in _LEVELS:
        root.setLevel(logging.INFO)
        root.warning(
            "%s=%r is not a level; choose one of %s (using info)",
            LEVEL_ENV,
            chosen,
            ", ".join(_LEVELS),
        )
    elif root.level == logging.NOTSET:  # a level the user set in code is kept
        root.setLevel(chosen.upper())
    return root


_configure()


def get_logger(name: str) -> logging.Logger:
    """The logger ``gradsync.<name>``."""
    return logging.getLogger(f"gradsync.{name}")


#: gradsync's own files: a warning raised from one is gradsync's
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def one_line_warnings() -> None:
    """Show gradsync's own warnings in this process (of its categories, or raised from its
    files) through the ``gradsync.warnings`` logger: one ``gradsync: ...`` line each, like the
    command's other messages, at the level the user set for gradsync's logs
    (``GRADSYNC_LOG_LEVEL=error`` hides them). Python's format adds the file, line and source
    text of the ``warnings.warn`` call, which tell a user of the command nothing; other
    warnings keep it. Filters still apply first: a warning the script ignores is not shown.
    For the ``gradsync`` command's processes (its ranks, ``checkpoint export``), not for a
    library caller's."""
    shown = warnings.showwarning
    said = get_logger("warnings")

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if category.__module__.split(".")[0] == "gradsync" or filename.startswith(_PACKAGE):
            said.warning("%s", str(message).removeprefix("gradsync: "))
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
