"""gradsync's warnings in a ``gradsync run`` worker: one ``gradsync: ...`` line each."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = """
import warnings
from pathlib import Path
import gradsync.logs as logs
logs.one_line_warnings()
package = Path(logs.__file__).parent  # gradsync/
here = str(package / "synchronizer.py")
warnings.warn_explicit("gradsync: step 3 skipped", RuntimeWarning, here, 1)
warnings.warn_explicit("sparse payload", UserWarning, str(package / "compression" / "sparse.py"), 2)
from gradsync.checkpoint.store import CheckpointWarning
warnings.warn_explicit("skipping checkpoint x", CheckpointWarning, "/elsewhere/user.py", 3)
warnings.warn_explicit("a user's own", UserWarning, "/elsewhere/user.py", 4)
"""


def test_gradsyncs_warnings_are_one_line_and_others_keep_their_format() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[:3] == [
        "gradsync: step 3 skipped",  # raised from gradsync's files, its prefix not doubled
        "gradsync: sparse payload",
        "gradsync: skipping checkpoint x",  # a gradsync category, wherever raised
    ], done.stderr
    assert lines[3] == "/elsewhere/user.py:4: UserWarning: a user's own", done.stderr
