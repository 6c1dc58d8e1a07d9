"""End-to-end: a script under ``gradsync run -- SCRIPT`` ends as under torchrun, in ranks forked
from gradsync's forkserver too. A file it writes every step and never closes is complete and its
``atexit`` handler ran (forked ranks ended with ``os._exit``, which skipped both: the file was
left empty); a DataLoader with workers in a script without ``if __name__ == "__main__":``
works (its workers were started by the rank's forkserver start method and imported the script
again, whose ``gs.init()`` failed the run); and after a kill and a restart nothing of the run
is left running (its DataLoader's forkserver was, with parent PID 1). The same run keeps each
attempt's step records of a script that resumes without ``sync.load``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

STEPS = 6

SCRIPT = """
import atexit, os, sys
import torch
import gradsync as gs
from torch.utils.data import DataLoader, TensorDataset

out = sys.argv[1]
gs.init()
rank = gs.rank()
atexit.register(lambda: open(f"{out}/atexit-{rank}", "w").write("ran"))
log = open(f"{out}/log-{rank}.txt", "w")  # never closed, as many scripts do
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
data = TensorDataset(torch.randn(4 * STEPS, 4), torch.randn(4 * STEPS, 1))
for step, (x, y) in enumerate(DataLoader(data, batch_size=4, num_workers=1)):
    with sync.step():
        torch.nn.functional.mse_loss(model(x), y).backward()
    log.write(f"step {step}\\n")
sync.report()
sys.exit(0)
""".replace("STEPS", str(STEPS))


def _of_the_run(run_dir: Path) -> list[int]:
    """The live processes that carry the run's directory in their environment: its ranks and
    whatever they started (a rank sets ``GRADSYNC_RUN_DIR`` before the script runs)."""
    mark = f"GRADSYNC_RUN_DIR={run_dir}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    found.append(int(entry))
    return found


@pytest.mark.timeout(200)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_script_ends_as_under_torchrun_after_a_kill_and_a_restart(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    written = tmp_path / "written"
    written.mkdir()
    run_dir = (tmp_path / "run").resolve()
    # stderr into a file, not a pipe: a process left behind holding a pipe would keep the test
    # reading it until its timeout
    with (tmp_path / "stderr").open("w") as err, (tmp_path / "stdout").open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gradsync", "run", "--nproc", "2", "--out", str(run_dir)]
            + ["--no-progress", "--no-plots", "--kill", "1:3", "--max-restarts", "1"]
            + ["--", str(script), str(written)],
            stdout=out,
            stderr=err,
            cwd=tmp_path,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=150)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    stderr = (tmp_path / "stderr").read_text()
    # Processes of the run still there a few seconds after it ended (a DataLoader's workers
    # notice their rank's end within 5 s, as under torchrun): killed, and the test fails.
    deadline = time.monotonic() + 10
    while (left := _of_the_run(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    assert "was killed by SIGKILL" in stderr, stderr[-3000:]
    assert left == [], f"left running after the run: {left}"
    for rank in (0, 1):  # the restarted attempt's, from the first step
        lines = (written / f"log-{rank}.txt").read_text().splitlines()
        assert lines == [f"step {s}" for s in range(STEPS)], (rank, lines)
        assert (written / f"atexit-{rank}").read_text() == "ran"
    _assert_each_attempts_records_kept(run_dir, (tmp_path / "stdout").read_text())


def _assert_each_attempts_records_kept(run_dir: Path, stdout: str) -> None:
    """The script resumes without sync.load, so its restart trains its STEPS steps again from
    0. Rank 0, stopped by the agent, wrote its records of steps 0-2 (attempt 0); the restart's
    records (attempt 1) follow them, and a line says why. Before, the restart's steps replaced
    the first attempt's and the summary said STEPS steps."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    first = sorted((r["rank"], r["step"]) for r in records if r.get("attempt", 0) == 0)
    assert first == [(0, step) for step in range(3)], first
    assert len([r for r in records if r.get("attempt") == 1]) == 2 * STEPS
    header, note = stdout.splitlines()[:2]
    assert header == f"run: {run_dir} ({STEPS + 3} steps, 2 ranks)", stdout[:500]
    assert note.startswith("restart 1 of 1: the script counted its steps from 0 again"), note
