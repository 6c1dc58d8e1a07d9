"""Structural rules of the package that need a fresh interpreter: importing the synchronizer
takes no exit hold (``gradsync.compat``). The rules read from the source:
tests/unit/test_architecture.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_importing_the_synchronizer_takes_no_exit_hold() -> None:
    code = (
        "import gradsync.synchronizer, gradsync.compat as c\n"
        "assert c._HELD is None, 'hold taken at import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
