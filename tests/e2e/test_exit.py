"""Issue 49: a script that ends while gloo still holds one of gradsync's callbacks exits 0, and
its exit waited for the callback (rank 0 ends 1.5 s before its last collective completes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.torchrun import torchrun

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(120)
def test_the_exit_waits_for_a_callback_still_in_gloo(tmp_path: Path) -> None:
    marker = tmp_path / "callback-ran"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun(
        ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
        + ["tests/support/exit_script.py", str(marker)],
        env,
        timeout_s=100,
    )
    # The callback ran in rank 0's process, after rank 1 joined: the sum of both ranks' ones.
    assert marker.read_text().split()[0] == "2.0"
