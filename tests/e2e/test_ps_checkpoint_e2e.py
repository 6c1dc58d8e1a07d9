"""Checkpoint and resume with parameter servers through ``gradsync run``: a killed worker's run
resumes from the checkpoint; killing a server rank is refused."""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import pytest
import torch

from gradsync.workloads import make_workload
from tests.support.cli import gradsync
from tests.support.overlap import overlapped

pytestmark = pytest.mark.e2e


COMMON = [
    "--workload", "mlp", "--params", "3000", "--steps", "12", "--nproc", "2",
    "--no-plots", "--no-progress", "--timeout", "60",
]  # fmt: skip


def _final(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "final_model.pt", weights_only=True)


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in state.values()])


def _last_loss(run: Path) -> float:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in records)
    return sum(r["loss"] for r in records if r["step"] == last) / 2


@pytest.mark.timeout(240)
def test_killed_worker_with_async_servers_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    base = ["run", "--strategy", "async", *COMMON, "--steps", "16"]
    # worker 1 dies at step 13, after the checkpoints of steps 5 and 10. They are written in
    # the background, so the one of step 10 may not be complete yet: either is a resume.
    kill = ["--checkpoint-every", "5", "--max-restarts", "1", "--kill", "1:13"]
    # the two runs are independent (each its own ports and directory): started at once
    # (tests/support/overlap.py), a run leaves a core idle much of its time on 2 cores
    runs = {
        "clean": functools.partial(gradsync, *base, "--out", str(clean), timeout=200),
        "faulty": functools.partial(gradsync, *base, "--out", str(faulty), *kill, timeout=200),
    }
    with overlapped(runs) as done:
        proc = done.result("clean")
        assert proc.returncode == 0, proc.stderr[-3000:]
        proc = done.result("faulty")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = re.findall(r"restart: resuming at step (\d+)", proc.stderr)
    assert resumed in (["5"], ["10"]), proc.stderr[-3000:]
    assert (faulty / "faults" / "kill-rank1-step13.json").exists()
    recoveries = (faulty / "faults" / "recoveries.jsonl").read_text().splitlines()
    assert [json.loads(x)["resumed_at_step"] for x in recoveries] == [int(resumed[0])]
    # every step's telemetry, once per worker: the records of the steps before the resume
    # point, never gathered before the kill (no gathers mid-run under async), came back with
    # the checkpoint
    records = [json.loads(x) for x in (faulty / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["rank"], r["step"]) for r in records) == sorted(
        (r, s) for r in (0, 1) for s in range(16)
    )
    # async is not deterministic (the server applies pushes in arrival order), so "close":
    # two clean runs end about 0.03-0.09 apart, after moving about 0.6 from the start
    a, b = _last_loss(clean), _last_loss(faulty)
    assert math.isfinite(b) and abs(a - b) <= 0.1 * abs(a), (a, b)
    start = _flat(make_workload("mlp", seed=0, params=3000).build_model().state_dict())
    want, got = _flat(_final(clean)), _flat(_final(faulty))
    assert torch.isfinite(got).all()
    assert (got - want).norm() < 0.3 * (want - start).norm()


def test_parameter_server_kill_of_a_server_rank_is_refused(tmp_path: Path) -> None:
    proc = gradsync(
        "run", "--out", str(tmp_path / "run"), "--strategy", "ssp:1", *COMMON,
        "--checkpoint-every", "5", "--max-restarts", "1", "--kill", "2:3",
        timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--kill names rank 2, a parameter server" in proc.stderr
