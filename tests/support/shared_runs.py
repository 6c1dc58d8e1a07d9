"""The ``gradsync run`` commands whose one run several e2e test files read: each launch costs
seconds of start-up on 2 cores, so tests/e2e/conftest.py makes each of these runs once a
session, and the tests that change a run directory (a resume) work on a copy of it."""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

from tests.support.proctree import Watched

#: the mlp of test_fault_e2e's runs: 20,000 parameters, 30 steps
FAULT_COMMON = [
    "--workload", "mlp", "--params", "20000", "--steps", "30", "--no-plots", "--no-progress",
]  # fmt: skip

#: 2 ranks of bsp, a checkpoint every step (written in the background), rank 1 SIGKILLed at
#: step 17 and the run restarted once: the newest complete checkpoint at the kill is step
#: 17's, or one or two before it if its writes were still under way
KILLED_BSP_STRATEGY = ["--strategy", "bsp"]
KILLED_BSP = [
    "--nproc", "2", *FAULT_COMMON, *KILLED_BSP_STRATEGY,
    "--checkpoint-every", "1", "--max-restarts", "1", "--kill", "1:17",
]  # fmt: skip
#: where KILLED_BSP's restart may resume
KILLED_BSP_RESUMED = (15, 16, 17)
#: KILLED_BSP uninterrupted: the reference its final model is held to, and zero:3's
CLEAN_BSP = ["--nproc", "2", *FAULT_COMMON, *KILLED_BSP_STRATEGY]

#: the --tracker sinks installed (the trackers extra): CLEAN_BSP's run writes each
TRACKERS_INSTALLED = [
    n for n in ("tensorboard", "wandb", "mlflow") if importlib.util.find_spec(n) is not None
]

#: one rank, 10 steps, a checkpoint every 5: what the resume tests change, then resume from
ONE_RANK = [
    "--nproc", "1", "--workload", "mlp", "--params", "20000", "--steps", "10",
    "--checkpoint-every", "5", "--no-plots", "--no-progress",
]  # fmt: skip

#: tests/support/user_script.py, a user's own script: what test_script_run and test_cluster_run
#: start with ``gradsync run -- SCRIPT``
USER_SCRIPT = Path(__file__).resolve().parent / "user_script.py"
USER_SCRIPT_STEPS = 30
#: the user's script for USER_SCRIPT_STEPS steps on 2 ranks of loopback, rank 1 slowed 3x,
#: its checkpoints and final parameters (``final.pt``) in its run directory; the flags of the
#: run come before ``--`` (plots on: test_script_run reads them)
USER_SCRIPT_SLOWED = ["--nproc", "2", "--slow", "1:3"]
USER_SCRIPT_COMMAND = [
    "--", str(USER_SCRIPT), str(USER_SCRIPT_STEPS), "{run_dir}/ckpt", "{run_dir}/final.pt",
]  # fmt: skip


@dataclass(frozen=True)
class SharedRun:
    """A finished run (it exited 0): its directory, its stderr, and what was seen of its
    process tree while it ran (every process and listener: tests/support/proctree.py), where
    it was watched."""

    out: Path
    stderr: str
    watched: Watched | None = None

    def copy(self, to: Path) -> Path:
        """The run directory copied to ``to``, for a test that changes it (the shared one is
        left as the run left it)."""
        shutil.copytree(self.out, to)
        return to
