"""Elastic restart after a killed worker, end to end through `gradsync run`: the run completes
and its final parameters are bitwise equal to an uninterrupted run with the same seed."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gradsync.checkpoint import CheckpointStore
from tests.support.cli import gradsync
from tests.support.overlap import Overlapped, overlapped, run_dir
from tests.support.shared_runs import (
    FAULT_COMMON,
    KILLED_BSP_RESUMED,
    SharedRun,
)

pytestmark = pytest.mark.e2e

# the line gradsync run prints for a worker's death: (local rank, how it ended)
DEATH = re.compile(r"gradsync: worker process (\d) of this machine \(pid \d+\) (.*)")
COMMON = FAULT_COMMON


def _final(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "final_model.pt", weights_only=True)


def _run(out: Path, *extra: str) -> str:
    proc = gradsync("run", "--nproc", "2", "--out", str(out), *COMMON, *extra, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def _assert_resumed_bitwise(
    clean: Path, faulty: Path, err: str, killed: int, resumed: tuple[int, ...]
) -> None:
    """The faulty run (rank ``killed`` SIGKILLed at step 17, one restart) resumed at one of
    ``resumed``, named the death once, without the survivor's backtrace, and ended where the
    uninterrupted run ended, every step's telemetry once per rank."""
    found = re.findall(r"restart: resuming at step (\d+) \(restart 1 of 1\)", err)
    assert len(found) == 1 and int(found[0]) in resumed, err[-3000:]
    # the death the agent recovered from is named, once
    deaths = DEATH.findall(err)
    assert deaths == [(str(killed), "was killed by SIGKILL")], err[-3000:]
    # Rank 0 serves the round's store (--max-restarts): where it dies, its peer's wait on it
    # fails, and c10d would print that failure with a C++ backtrace.
    assert "Exception raised from" not in err and "frame #" not in err, err[-3000:]
    assert (faulty / "faults" / f"kill-rank{killed}-step17.json").exists()
    a, b = _final(clean), _final(faulty)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # telemetry of the replayed steps is not double counted
    steps = [
        json.loads(line)["step"] for line in (faulty / "metrics.jsonl").read_text().splitlines()
    ]
    assert sorted(steps) == sorted(list(range(30)) * 2)


@pytest.mark.timeout(300)
def test_killed_rank_resumes_bitwise_equal_from_a_checkpoint_of_every_step(
    clean_bsp_run: SharedRun, killed_bsp_run: SharedRun
) -> None:
    """bsp, a checkpoint every step, written in the background: the shared runs,
    tests/e2e/conftest.py, killed and uninterrupted."""
    faulty = killed_bsp_run
    _assert_resumed_bitwise(clean_bsp_run.out, faulty.out, faulty.stderr, 1, KILLED_BSP_RESUMED)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("strategy", "killed"),
    [
        # rank 1 dies at step 17, between the checkpoints of steps 10 and 20
        (["--strategy", "diloco:4"], 1),
        # residuals resumed; rank 0 dies here: it serves the round's store, which its peer's
        # wait then fails on (its death named without the survivor's backtrace)
        (["--strategy", "bsp", "--compress", "topk:0.05"], 0),
    ],
    ids=["diloco", "topk-error-feedback-rank-0"],
)
def test_killed_rank_resumes_bitwise_equal(
    tmp_path: Path, strategy: list[str], killed: int
) -> None:
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    # the two runs are independent (each its own ports and directory): started at once
    # (tests/support/overlap.py), a run leaves a core idle much of its time on 2 cores
    faulty_flags = ["--checkpoint-every", "10", "--max-restarts", "1", "--kill", f"{killed}:17"]
    runs = {
        "clean": functools.partial(_run, clean, *strategy),
        "faulty": functools.partial(_run, faulty, *strategy, *faulty_flags),
    }
    with overlapped(runs) as done:
        done.result("clean")
        err = done.result("faulty")
    _assert_resumed_bitwise(clean, faulty, err, killed, (10,))


def _resume_on_3_ranks(out: Path) -> subprocess.CompletedProcess[str]:
    """The 2-rank run's checkpoint of its last step (a copy of the shared run's directory,
    ``out``), resumed on 3 ranks for 10 more steps."""
    return gradsync(
        "run", "--nproc", "3", "--out", str(out), *COMMON[:4], "--steps", "40", "--resume",
        "--no-plots", "--no-progress", timeout=240,
    )  # fmt: skip


def _resume_local_on_3_ranks(out: Path) -> subprocess.CompletedProcess[str]:
    """What a 2-rank local:5 run leaves after its checkpoint of step 10 (written here rather
    than by a first run, which would only cost time): one file per rank, the manifest;
    resumed on 3 ranks."""
    store = CheckpointStore(out / "checkpoints")
    for rank in range(2):
        saved = {"strategy": "local", "layout": {"workers": 2, "servers": 0}}
        store.save(10, rank, 2, {**saved, "compression": "none", "extra": {}})
    store.commit(10, 2)
    base = [*COMMON[:4], "--strategy", "local:5", "--no-plots", "--no-progress"]
    return gradsync(
        "run", "--nproc", "3", "--out", str(out), *base, "--steps", "20", "--resume", timeout=240
    )


def _resume_past_an_unfinished_checkpoint(out: Path) -> subprocess.CompletedProcess[str]:
    """What a kill during a save leaves: the newest checkpoint without its manifest (in a copy
    of the shared one-rank run's directory, ``out``: 10 steps, a checkpoint every 5)."""
    flags = ["--nproc", "1", "--out", str(out), *COMMON[:4], "--no-plots"]
    (out / "checkpoints" / "step-000010" / "MANIFEST.json").unlink()
    return gradsync("run", *flags, "--steps", "14", "--resume", timeout=180)


@pytest.fixture(scope="module")
def resumes(
    tmp_path_factory: pytest.TempPathFactory,
    killed_bsp_run: SharedRun,
    one_rank_run: SharedRun,
) -> Iterator[Overlapped]:
    """The last three tests' ``gradsync run --resume`` launches, started at once
    (tests/support/overlap.py): each resumes a directory of its own (a copy of a shared run's,
    or one written here) with its own ports, none is killed, timed or waits on a timeout, and
    a launch leaves a core idle much of its time on 2 cores; each test reads its own."""
    launches = {
        "3 ranks": functools.partial(
            _resume_on_3_ranks, killed_bsp_run.copy(tmp_path_factory.mktemp("bsp-3") / "run")
        ),
        "local on 3 ranks": functools.partial(
            _resume_local_on_3_ranks, tmp_path_factory.mktemp("local-3") / "run"
        ),
        "unfinished": functools.partial(
            _resume_past_an_unfinished_checkpoint,
            one_rank_run.copy(tmp_path_factory.mktemp("unfinished") / "run"),
        ),
    }
    with overlapped(launches) as started:
        yield started


@pytest.mark.timeout(300)
def test_bsp_resumes_on_a_different_number_of_ranks(resumes: Overlapped) -> None:
    # The 2-rank run's checkpoint of its last step (the shared run, tests/e2e/conftest.py,
    # copied: this resume writes into its directory), resumed on 3 ranks for 10 more steps.
    more = resumes.result("3 ranks")
    out = run_dir(more)
    assert more.returncode == 0, more.stderr[-2000:]
    assert "resuming at step 30" in more.stderr and "restarts from zero" not in more.stderr
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in records if r["step"] >= 30} == {0, 1, 2}
    assert max(r["step"] for r in records) == 39


@pytest.mark.timeout(300)
def test_other_strategies_refuse_a_different_number_of_ranks(resumes: Overlapped) -> None:
    # What a 2-rank local:5 run leaves after its checkpoint of step 10, resumed on 3 ranks
    again = resumes.result("local on 3 ranks")
    assert again.returncode == 1, again.stderr[-2000:]
    assert "written by 2 ranks; resuming local with 3 is not supported" in again.stderr
    assert "Traceback" not in again.stderr


@pytest.mark.timeout(240)
def test_a_resume_past_an_unfinished_checkpoint_says_so_in_one_line(
    resumes: Overlapped, one_rank_run: SharedRun
) -> None:
    # What a kill during a save leaves: the newest checkpoint without its manifest (in a copy
    # of the shared one-rank run's directory, tests/e2e/conftest.py: 10 steps, a checkpoint
    # every 5).
    first = one_rank_run.stderr
    assert ", on the CPU (gloo) -> " in first.splitlines()[0], first[:500]
    more = resumes.result("unfinished")
    assert more.returncode == 0, more.stderr[-2000:]
    lines = more.stderr.splitlines()
    skipped = [n for n, line in enumerate(lines) if "skipping checkpoint" in line]
    assert len(skipped) == 1, more.stderr[-3000:]
    assert lines[skipped[0]].startswith("gradsync: skipping checkpoint "), lines[skipped[0]]
    assert "incomplete: no MANIFEST.json" in lines[skipped[0]]
    # Python's own format would follow it with the source line of the warnings.warn call.
    assert "store.latest(" not in more.stderr and "Warning:" not in more.stderr, more.stderr
    # The progress line starts after the line that says where the run went back to.
    resumed = [n for n, line in enumerate(lines) if "--resume: resuming at step 5" in line]
    shown = [n for n, line in enumerate(lines) if re.search(r"step \d+/14", line)]
    assert resumed and shown and min(shown) > resumed[0], more.stderr[-3000:]
