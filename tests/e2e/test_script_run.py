"""End-to-end: the user's own script under ``gradsync run -- SCRIPT``, with what the built-in
workloads get: the run directory (report.json naming the slowed rank, a trace track per rank,
the plots), ``--kill`` with a restart that resumes from the script's own checkpoints to the
same final model as an uninterrupted run, and ``-m MODULE``."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.telemetry.plots import PLOT_FILES
from tests.support.overlap import Overlapped, overlapped, run_dir
from tests.support.shared_runs import USER_SCRIPT, USER_SCRIPT_STEPS, SharedRun

pytestmark = pytest.mark.e2e

SCRIPT = USER_SCRIPT
STEPS = USER_SCRIPT_STEPS


def _run(
    tmp_path: Path, name: str, flags: list[str], command: list[str], in_root: bool = False
) -> tuple[Path, str]:
    """``in_root``: started in the repository's root, with nothing on PYTHONPATH, as a user
    runs ``gradsync run -- -m PACKAGE.MODULE`` beside their package (as ``python -m``)."""
    out = tmp_path / name
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])}
    # The console script, as a user types it: ``python -m gradsync`` would put the current
    # directory on the import path by itself.
    gradsync = [str(Path(sys.executable).parent / "gradsync")]
    if in_root:
        env.pop("PYTHONPATH")
    else:
        gradsync = [sys.executable, "-m", "gradsync"]
    proc = subprocess.run(
        [*gradsync, "run", "--nproc", "2", "--out", str(out)]
        + flags
        + ["--", *command, str(STEPS), str(tmp_path / f"{name}-ckpt"), str(out / "final.pt")],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=SCRIPT.parents[2] if in_root else tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


@pytest.mark.timeout(400)
def test_a_user_script_gets_the_run_directory_faults_and_restarts(
    tmp_path: Path, user_script_run: SharedRun
) -> None:
    """The run slowed at rank 1 (tests/e2e/conftest.py: the one test_cluster_run reads too)
    gets the run directory; a run killed at step 10 ends where it ends."""
    slowed = user_script_run.out
    report = json.loads((slowed / "report.json").read_text())
    assert report["steps"] == STEPS
    stragglers = [f["rank"] for f in report["stragglers"] if f["kind"] == "straggler"]
    assert stragglers == [1], report["stragglers"]
    trace = json.loads((slowed / "trace.json").read_text())
    tracks = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "compute"}
    assert tracks == {0, 1}
    for name in PLOT_FILES:
        assert (slowed / name).stat().st_size > 10_000, name
    # the script's gradient size, which gradsync run cannot count before the script runs: the
    # report's bytes against fp32 gradients, as a built-in workload's (its Linear layers only)
    numel = sum(t.numel() for t in torch.load(slowed / "final.pt").values())
    assert report["bytes"]["fp32_per_rank_step"] == 4 * numel, report["bytes"]

    # Killed at step 10 and restarted, the script resumes from its own sync.save checkpoints
    # (-m: the same script as a module), and ends where an uninterrupted run ends.
    killed, stderr = _run(
        tmp_path,
        "killed",
        ["--kill", "1:10", "--max-restarts", "1", "--no-plots"],
        ["-m", "tests.support.user_script"],
        in_root=True,
    )
    assert re.search(r"restart: resuming at step (9|10) \(restart 1 of 1\)", stderr), stderr
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").open()]
    assert sorted(steps) == sorted(list(range(STEPS)) * 2)  # each step once per rank
    whole = torch.load(slowed / "final.pt")
    resumed = torch.load(killed / "final.pt")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def _compare(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradsync", "compare", "--nproc", "2", "--no-plots"]
        + ["--strategies", "bsp,local:4", "--out", str(tmp_path / "cmp"), "--", str(SCRIPT)]
        + [str(STEPS), "{run_dir}/ckpt", "{run_dir}/final.pt"],  # each run's own directory
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )


def _front_door(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    example = SCRIPT.parents[2] / "examples" / "ddp_lm_frontdoor.py"
    return subprocess.run(
        [sys.executable, "-m", "gradsync", "run", "--nproc", "2", "--no-plots"]
        + ["--out", str(tmp_path / "fd")]
        + ["--", str(example), "--steps", "14", "--eval-every", "100", "--out", str(tmp_path)]
        + ["--accumulation", "1"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )


def _failing(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = SCRIPT.parent / "failing_script.py"
    return subprocess.run(
        [sys.executable, "-m", "gradsync", "run", "--nproc", "2", "--no-plots"]
        + ["--out", str(tmp_path / "failed"), "--timeout", "30", "--", str(script), "5"],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])},
        cwd=tmp_path,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Overlapped]:
    """Three tests' launches at once (tests/support/overlap.py), each its own command with its
    own ports and directory: ``gradsync compare`` on the user's script, the front-door example
    without report(), a script that raises on rank 1. None is timed, and a launch leaves a core
    idle much of its time on 2 cores; each test reads its own. (The slowed runs, whose
    stragglers are judged by time, and the killed one run alone.)"""
    launches: dict[str, Callable[[], Any]] = {
        name: functools.partial(launch, tmp_path_factory.mktemp(name))
        for name, launch in (("compare", _compare), ("front-door", _front_door))
    }
    launches["failing"] = functools.partial(_failing, tmp_path_factory.mktemp("failing"))
    with overlapped(launches) as started:
        started.wait()  # all ended before the next test's slowed run, judged by time, starts
        yield started


@pytest.mark.timeout(300)
def test_compare_runs_each_strategy_on_the_user_script(runs: Overlapped) -> None:
    proc = runs.result("compare")
    out = run_dir(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line}
    assert {"bsp", "local:4"} <= set(table), proc.stdout
    for name in ("bsp", "local-4"):  # each strategy's own run directory and checkpoints
        config = json.loads((out / name / "config.json").read_text())
        assert config["strategy"] == name.replace("-", ":") and "strategy" in config["given"]
        assert (out / name / "final.pt").exists() and (out / name / "ckpt").is_dir()
    # The runs differ: local:4 averages every 4th step, bsp every step
    bsp, local = (torch.load(out / name / "final.pt") for name in ("bsp", "local-4"))
    assert any(not torch.equal(bsp[k], local[k]) for k in bsp)


@pytest.mark.timeout(200)
def test_the_ported_ddp_example_gets_the_run_directory_too(tmp_path: Path) -> None:
    """examples/ddp_lm_gradsync.py, a public DDP script ported to gs.Synchronizer, unchanged."""
    example = SCRIPT.parents[2] / "examples" / "ddp_lm_gradsync.py"
    out = tmp_path / "lm"
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync", "run", "--nproc", "2", "--slow", "1:3", "--no-plots"]
        + ["--straggler-warmup", "2", "--straggler-window", "6", "--out", str(out), "--"]
        + [str(example), "--steps", "14", "--eval-every", "100", "--out", str(tmp_path / "own")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 14
    stragglers = [f["rank"] for f in report["stragglers"] if f["kind"] == "straggler"]
    assert stragglers == [1], report["stragglers"]  # (a "slowdown" of every rank may be there too)
    assert (tmp_path / "own" / "final.pt").exists()  # the script's own outputs, where it says


@pytest.mark.timeout(200)
def test_a_front_door_script_that_never_calls_report_keeps_every_step_record(
    runs: Overlapped,
) -> None:
    """examples/ddp_lm_frontdoor.py, unchanged, calls neither ``model.report()`` nor
    ``close()``: each rank's records that no gather took (the last ones, up to twice
    ``telemetry_every``) reach metrics.jsonl all the same, written by each rank at its exit.
    Before, 14 steps left metrics.jsonl with 10 of them, and a run of fewer steps than a
    gather failed saying the script "took no step"."""
    proc = runs.result("front-door")
    out = run_dir(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert sorted((r["rank"], r["step"]) for r in records) == [
        (rank, step) for rank in range(2) for step in range(14)
    ]
    assert "run: " in proc.stderr + proc.stdout and "(14 steps, 2 ranks)" in proc.stdout


@pytest.mark.timeout(120)
def test_the_ranks_stopped_after_a_peer_failed_keep_their_step_records(runs: Overlapped) -> None:
    """Rank 1's script raises before step 5: the run fails, and the agent stops rank 0 (waiting
    in step 5) with SIGTERM. Each rank's records of steps 0-4, which no gather had taken (a
    gather every 10 steps), reach metrics.jsonl: rank 0 writes its own when stopped
    (gradsync.runner.stopped). Before, metrics.jsonl held rank 1's alone."""
    proc = runs.result("failing")
    out = run_dir(proc)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "the user's error at step 5" in proc.stderr, proc.stderr[-3000:]
    records = {(r["rank"], r["step"]) for r in map(json.loads, (out / "metrics.jsonl").open())}
    assert {(rank, step) for rank in range(2) for step in range(5)} <= records, sorted(records)
