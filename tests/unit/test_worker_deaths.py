"""``gradsync.processes.worker_deaths``: the record torch's elastic agent logs for a failed worker
becomes
one line on stderr; every other record of that logger stays silent."""

from __future__ import annotations

import ast
import inspect
import io
import logging
import signal

import pytest

from gradsync import compat
from gradsync.processes.worker_deaths import _DeathLine, describe_exit, report_worker_deaths
from tests.support.worker_deaths import TORCH_FORMAT

pytestmark = pytest.mark.unit


def _record(msg: str, args: tuple[object, ...]) -> logging.LogRecord:
    return logging.LogRecord(
        compat.ELASTIC_WORKER_LOGGER, logging.ERROR, "api.py", 1, msg, args, None
    )


def test_the_agents_failure_record_is_read() -> None:
    record = _record(TORCH_FORMAT, (-9, 1, 4242, "_recorded", "forkserver"))
    assert compat.elastic_worker_failure(record) == (-9, 1, 4242)
    binary = _record("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", (3, 0, 7, "x"))
    assert compat.elastic_worker_failure(binary) == (3, 0, 7)


@pytest.mark.parametrize(
    "record",
    [
        _record("[%s] Worker group %s. %s/%s attempts left", ("default", "FAILED", 1, 1)),
        _record("failed (exitcode: %s) local_rank: %s (pid: %s)", (1, 2)),  # too few values
        _record("failed (exitcode: %s) local_rank: %s (pid: %s)", ("x", 0, 1)),
        _record("exitcode %s", (1,)),
    ],
)
def test_other_records_are_not_read_as_a_death(record: logging.LogRecord) -> None:
    assert compat.elastic_worker_failure(record) is None


def test_exit_codes_are_described() -> None:
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert describe_exit(-15) == "was killed by SIGTERM"
    assert describe_exit(-1000) == "was killed by signal 1000"
    assert describe_exit(3) == "exited with code 3"


def test_one_line_per_death_and_nothing_else() -> None:
    out = io.StringIO()
    handler = _DeathLine(out)
    handler.handle(_record(TORCH_FORMAT, (-9, 1, 4242, "_recorded", "forkserver")))
    handler.handle(_record("[%s] Worker group %s.", ("default", "FAILED")))
    assert out.getvalue() == (
        "gradsync: worker process 1 of this machine (pid 4242) was killed by SIGKILL\n"
    )


def test_installed_once_on_the_agents_logger_alone() -> None:
    logger = logging.getLogger(compat.ELASTIC_WORKER_LOGGER)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        # A CLI test in this process may have installed one already.
        logger.handlers[:] = [h for h in saved[0] if not isinstance(h, _DeathLine)]
        out = io.StringIO()
        report_worker_deaths(out)
        report_worker_deaths(out)
        assert sum(isinstance(h, _DeathLine) for h in logger.handlers) == 1
        assert logger.propagate is False
        logger.error(TORCH_FORMAT, 1, 0, 99, "_recorded", "spawn")
        logger.warning(TORCH_FORMAT, 1, 0, 99, "_recorded", "spawn")  # below ERROR: silent
        assert (
            out.getvalue()
            == "gradsync: worker process 0 of this machine (pid 99) exited with code 1\n"
        )
    finally:
        logger.handlers[:] = saved[0]
        logger.setLevel(saved[1])
        logger.propagate = saved[2]


def test_the_installed_torch_logs_the_record_that_is_read() -> None:
    # The wording is torch's, not an API: if a torch rewords it, this fails before any run
    # goes quiet about its deaths. The AST joins the string's implicitly concatenated parts.
    from torch.distributed.elastic.multiprocessing import api

    assert api.logger.name == compat.ELASTIC_WORKER_LOGGER
    strings = [
        node.value
        for node in ast.walk(ast.parse(inspect.getsource(api)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]
    worded = [s for s in strings if s.startswith("failed (exitcode: %s)")]
    assert worded and all(compat.elastic_worker_failure(_record(s, (1, 2, 3))) for s in worded)


def test_the_agents_signal_exception_gives_its_signal() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    assert compat.elastic_signal(SignalException("got 2", sigval=signal.SIGINT)) == 2
    assert compat.elastic_signal(SignalException("got 15", sigval=signal.SIGTERM)) == 15
    assert compat.elastic_signal(RuntimeError("got 2")) is None
    assert compat.elastic_signal(KeyboardInterrupt()) is None
