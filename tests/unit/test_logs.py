"""gradsync's notices go through the ``gradsync`` logger: shown as ``gradsync: ...`` while the
application configured no logging, through the application's handlers once it has, and
silenced by the logger's level."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest

from gradsync import logs

pytestmark = pytest.mark.unit


@contextlib.contextmanager
def no_root_handlers() -> Iterator[None]:
    """As in a script that set up no logging: pytest's own capture handlers, which it adds to
    the root logger for each test's call, set aside meanwhile."""
    root = logging.getLogger()
    kept = list(root.handlers)
    root.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:] = kept


def test_a_notice_is_one_gradsync_line_when_nothing_is_configured(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with no_root_handlers():
        logs.get_logger("run").info("restart: resuming at step %d", 10)
    assert capsys.readouterr().err == "gradsync: restart: resuming at step 10\n"


def test_the_application_s_own_handler_gets_it_instead(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(f"{record.name}: {record.getMessage()}")

    with no_root_handlers():
        logging.getLogger().addHandler(Keep())
        logs.get_logger("run").info("restart: resuming at step 10")
    assert seen == ["gradsync.run: restart: resuming at step 10"]
    assert capsys.readouterr().err == ""  # not shown twice


def test_the_level_silences_notices_and_keeps_warnings(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gradsync_logger = logging.getLogger("gradsync")
    before = gradsync_logger.level
    gradsync_logger.setLevel(logging.WARNING)  # setLevel: the loggers' cached levels go too
    try:
        with no_root_handlers():
            logs.get_logger("run").info("a notice")
            logs.get_logger("run").warning("a warning")
    finally:
        gradsync_logger.setLevel(before)
    assert capsys.readouterr().err == "gradsync: a warning\n"


def test_an_unknown_level_in_the_environment_is_named_with_the_choices(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(logs.LEVEL_ENV, "loud")
    gradsync_logger = logging.getLogger("gradsync")
    before = gradsync_logger.level
    gradsync_logger.setLevel(logging.NOTSET)
    try:
        with no_root_handlers():
            logs._configure()
    finally:
        level_after = gradsync_logger.level
        gradsync_logger.setLevel(before)
    assert capsys.readouterr().err == (
        "gradsync: GRADSYNC_LOG_LEVEL='loud' is not a level; choose one of debug, info, "
        "warning, error (using info)\n"
    )
    assert level_after == logging.INFO
