"""Plain torchrun with ``--max-restarts``: a script that calls ``gs.init()`` restarts.

torch (2.5 and later) shares the agent's rendezvous store with the workers without putting the
attempt in the process group's keys, so a restarted attempt read the dead attempt's gloo
addresses and failed in ``gs.init()`` ("Gloo connectFullMesh failed ... Connection refused",
pytorch/pytorch#135712); a replica group of two ranks under torchrun could not restart
(gradsync.processes.stores.agent_store_of_this_attempt)."""

from __future__ import annotations

import os

import pytest

from tests.support.torchrun import ROOT, torchrun

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "tests" / "support" / "torchrun_restart_script.py"


@pytest.mark.timeout(150)
def test_a_restarted_attempt_joins_its_own_process_group() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torchrun's default: the store shared
    args = ["--standalone", "--nproc_per_node=2", "--max-restarts", "1", str(SCRIPT)]
    out = torchrun(args, env, timeout_s=120)  # fails the test on a non-zero exit
    assert "attempt 1 rank 0 summed 2" in out, out[-3000:]
    assert "attempt 1 rank 1 summed 2" in out, out[-3000:]
    assert "connectFullMesh" not in out, out[-3000:]
