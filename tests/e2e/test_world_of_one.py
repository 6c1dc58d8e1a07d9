"""A world of one: ``python train.py`` without torchrun runs as a single-process group."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.overlap import Overlapped, overlapped

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def _plain_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _example() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_charlm.py"), "--steps", "3"],
        env=_plain_env(),
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
    )


def _every_strategy() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=_plain_env(),
        capture_output=True,
        text=True,
        timeout=110,
    )


def _first_use() -> subprocess.CompletedProcess[str]:
    code = "import gradsync\nprint(gradsync.compression.ddp_comm_hook.__name__)\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)


@pytest.fixture(scope="module")
def runs() -> Iterator[Overlapped]:
    """The file's three processes at once (tests/support/overlap.py): each a single process,
    one core's work, on 2 cores; nothing in them is timed. Each test reads its own."""
    launches = {"example": _example, "every-strategy": _every_strategy, "first-use": _first_use}
    with overlapped(launches) as started:
        yield started


@pytest.mark.timeout(120)
def test_the_example_runs_as_plain_python_without_torchrun(runs: Overlapped) -> None:
    done = runs.result("example")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "barrier tax" in done.stdout and "final loss" in done.stdout


SCRIPT = """
import torch, gradsync as gs
from gradsync.workloads import make_workload
gs.init()
assert gs.runtime.world_size() == 1
for strategy, compression in [("bsp", None), ("bsp", "int8"), ("local:2", None),
                              ("diloco:2", "topk:0.5")]:
    w = make_workload("mlp", seed=0, params=2000)
    model = w.build_model()
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           strategy=strategy, compression=compression)
    losses = []
    for step in range(6):
        with sync.step() as s:
            loss = w.loss(model, *w.batch(0, 8, 0, 8))  # one batch: the loss must fall
            loss.backward()
            s.loss = loss
        losses.append(float(loss))
    report = sync.report()
    sync.close()
    assert report.steps == 6 and len(report.ranks) == 1, report
    print(strategy, compression, "ok", losses[0] > losses[-1])
try:
    gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="async")
except gs.UsageError as exc:
    print("async:", exc)
"""


@pytest.mark.timeout(120)
def test_every_strategy_that_needs_no_second_rank_runs_in_a_world_of_one(
    runs: Overlapped,
) -> None:
    done = runs.result("every-strategy")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split(" ok")[0] for line in lines[:4]] == [
        "bsp None",
        "bsp int8",
        "local:2 None",
        "diloco:2 topk:0.5",
    ]
    assert all(line.endswith("True") for line in lines[:4]), lines  # the loss fell
    assert "leave no worker in a group of 1 ranks" in lines[4]


@pytest.mark.timeout(60)
def test_subpackages_load_on_first_use_after_a_plain_import(runs: Overlapped) -> None:
    done = runs.result("first-use")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ddp_comm_hook"
