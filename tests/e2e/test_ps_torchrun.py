"""examples/train_ps.py under plain torchrun: a parameter-server job exits 0, every time.

Before ``Synchronizer._final_handshake`` such jobs often trained to the end and then aborted in
interpreter shutdown ("terminate called without an active exception", SIGABRT): a gloo thread
freed the last collective's tensors after Python had begun to finalize. That happens when the
main thread reaches shutdown holding the GIL while the gloo thread waits for it. A long GIL
switch interval (set in every process through a ``sitecustomize`` module) makes the main thread
keep the GIL until it blocks, which widens that window from a race into the common case: with
the old code, 5 of 6 runs of this command aborted this way; without the long interval, about
1 in 5.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.torchrun import ROOT, torchrun

pytestmark = pytest.mark.e2e

RUN_TIMEOUT_S = 60


@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 30)
def test_parameter_server_example_exits_cleanly_under_torchrun(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import sys\n\nsys.setswitchinterval(0.5)\n")
    path = [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    env["OMP_NUM_THREADS"] = "1"
    # 2 workers + 1 server (rank 2); both barrier-free strategies (two runs: with the old code
    # 5 of 6 aborted, so both passing by chance had a probability of about 3%).
    for strategy in ("async", "ssp:1"):
        args = ["--standalone", "--nproc_per_node=3", "examples/train_ps.py"]
        args += ["--strategy", strategy, "--steps", "5", "--params", "2000"]
        out = torchrun(args, env, RUN_TIMEOUT_S)  # fails the test on a non-zero exit
        assert "terminate called" not in out
        assert "final loss" in out  # rank 0 trained to the end and printed its report
