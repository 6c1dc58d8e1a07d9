"""Structural rules of the package that need a fresh interpreter: importing the synchronizer
registers no exit handler (``gradsync.exit_safety`` registers one on first use). The rules
read from the source: tests/unit/test_architecture.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_importing_the_synchronizer_registers_no_exit_handler() -> None:
    code = (
        "import gradsync.synchronizer, gradsync.exit_safety as e\n"
        "assert not e._registered, 'exit handler registered at import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
