"""A user error of the installed command is one message and exit status 2, without a
traceback, as a process. Every message, checked in-process: tests/unit/test_cli_usage_errors.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import gradsync

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(60)
def test_a_cli_usage_error_exits_2_with_one_message(tmp_path: Path) -> None:
    proc = gradsync("run", "--out", str(tmp_path / "r"), "--strategy", "bogus", timeout=60)
    assert proc.returncode == 2
    assert "unknown strategy 'bogus'; valid: bsp, zero:N, local:H" in proc.stderr
    assert "Traceback" not in proc.stderr
