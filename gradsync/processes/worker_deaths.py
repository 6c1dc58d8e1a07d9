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

__all__ = ["describe_exit", "quiet_elastic_logs", "report_worker_deaths", "signal_name"]


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


#: the loggers of torch's launcher and elastic agent that ``quiet_elastic_logs`` silences
ELASTIC_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.multiprocessing",
)


def quiet_elastic_logs() -> None:
    """Silence what torch's launcher and elastic agent log, but for the one line per death
    (``report_worker_deaths``). Setting the parents' level is not enough: several of torch's
    modules give their logger a level of its own when imported (the agent's says "Received 2
    death signal, shutting down workers" on a Ctrl-C, before gradsync's own line). So the
    launcher is imported here, which imports them, and each such level is set too."""
    import torch.distributed.launcher.api  # noqa: F401 - imported for its loggers' levels

    for name in ELASTIC_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (
            isinstance(logger, logging.Logger)
            and name.startswith(ELASTIC_LOGGERS)
            and name != compat.ELASTIC_WORKER_LOGGER
            and logger.level != logging.NOTSET
        ):
            logger.setLevel(logging.CRITICAL)
    report_worker_deaths()
