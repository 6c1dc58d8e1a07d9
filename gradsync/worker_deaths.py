"""One line on stderr for each worker process that dies under ``gradsync run``.

torch's elastic agent reports a failed worker through its logger with a traceback of its own
making, and restarts the group without a word; ``gradsync run`` silences those loggers (the
final failure gets one line of its own, ``cli._describe_child_failure``). A death the agent
recovers from would then go unreported but for the resumed step. Here the one record that
names the failed process (``compat.elastic_worker_failure``) becomes a line saying which
worker died and how; the logger's other records stay silenced. A failure that ends the run gets
this line too, before the CLI's own, in the same words.

torch reports one failed process per round: the first its poll finds, in rank order. Two
workers dying within one poll (0.1 s) make one line, and a survivor that exits within that
poll may be the one named.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import TextIO

from gradsync import compat

__all__ = ["describe_exit", "report_worker_deaths", "signal_name"]


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal N`` for a number this platform does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(exitcode: int) -> str:
    """How a process ended, from its multiprocessing exit code (negative: a signal)."""
    if exitcode < 0:
        return f"was killed by {signal_name(-exitcode)}"
    return f"exited with code {exitcode}"


class _DeathLine(logging.Handler):
    def __init__(self, stream: TextIO | None) -> None:
        super().__init__(level=logging.ERROR)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        found = compat.elastic_worker_failure(record)
        if found is None:
            return
        exitcode, local_rank, pid = found
        stream = self.stream if self.stream is not None else sys.stderr
        print(
            f"gradsync: worker process {local_rank} of this machine (pid {pid}) "
            f"{describe_exit(exitcode)}",
            file=stream,
            flush=True,
        )


def report_worker_deaths(stream: TextIO | None = None) -> None:
    """Say each worker's death on ``stream`` (stderr at the time of writing by default) in one
    line, and nothing else torch's agent logs about it. Installed once per process."""
    logger = logging.getLogger(compat.ELASTIC_WORKER_LOGGER)
    if any(isinstance(h, _DeathLine) for h in logger.handlers):
        return
    logger.addHandler(_DeathLine(stream))
    logger.setLevel(logging.ERROR)
    logger.propagate = False  # the rest of the elastic loggers stay silenced
