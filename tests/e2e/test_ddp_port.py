"""Two DDP scripts and their gradsync ports (examples/ddp_lm.py and examples/ddp_vision.py, each
with a ``_gradsync`` twin, the explicit form, and a ``_frontdoor`` twin, through
gs.DistributedDataParallel): under bsp the same final parameters and buffers, bit for bit (the
small diffs: tests/unit/test_ddp_port_unit.py, tests/unit/test_front_door_unit.py)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.ddp_port import RUNS, pair
from tests.support.overlap import Overlapped, overlapped
from tests.support.torchrun import ROOT, torchrun

pytestmark = pytest.mark.e2e


#: plain DDP under torchrun sometimes aborts at interpreter exit, after its work is done (1 run
#: in 10 here, run alone): a gloo thread frees a collective's tensors while the interpreter
#: shuts down (see Synchronizer._final_handshake, which gradsync's port goes through and DDP
#: does not)
EXIT_ABORT = "terminate called without an active exception"


#: runs of the DDP baseline at most: under the full suite's load the abort hit three runs in a
#: row once (2026-11-27, a fresh-clone CI run), so one in ten is not the rate to plan for
DDP_ATTEMPTS = 6


def run_ddp_original(launch: list[str], env: dict[str, str]) -> str:
    """The DDP baseline, run again only when it hit that exit abort."""
    for attempt in range(DDP_ATTEMPTS):
        try:
            return torchrun(launch, env, timeout_s=110)
        except pytest.fail.Exception as exc:
            if EXIT_ABORT not in str(exc) or attempt == DDP_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _plain_python(out: Path) -> subprocess.CompletedProcess[str]:
    """examples/ddp_lm_gradsync.py for 2 steps as plain python: no torchrun, no RANK."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    port = pair("ddp_lm")[1]
    args = [str(port), "--steps", "2", "--eval-every", "2", "--out", str(out)]
    return subprocess.run(
        [sys.executable, *args],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def plain_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Overlapped]:
    """The port as plain python, one process of one rank (a HashStore, no port), started
    beside the torchrun runs of the file's first tests (tests/support/overlap.py): those leave
    part of a core idle on 2 cores, and nothing in either is timed; the last test reads it."""
    with overlapped(
        {"plain": functools.partial(_plain_python, tmp_path_factory.mktemp("plain"))}
    ) as started:
        yield started


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", RUNS)
def test_the_port_ends_bitwise_equal_to_the_ddp_script(
    name: str, tmp_path: Path, plain_python: Overlapped
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args, printed = RUNS[name]
    finals = []
    original, port = pair(name)
    # both ports: the explicit sync.step() form and the DDP-shaped front door (issue 42)
    frontdoor = port.with_name(f"{name}_frontdoor.py")
    for script in (original, port, frontdoor):
        out = tmp_path / script.stem
        launch = ["--standalone", "--nproc_per_node=2", str(script), *args, "--out", str(out)]
        if script == original:
            log = run_ddp_original(launch, env)
        else:  # the port gets no second chance: gradsync's exit must be clean
            log = torchrun(launch, env, timeout_s=110)
        assert printed in log, log[-2000:]
        assert (out / "checkpoint.pt").exists()  # rank 0's evaluation and checkpoint ran
        finals.append(torch.load(out / "final.pt", weights_only=True))
    ddp, *ports = finals
    for ours in ports:
        assert ddp.keys() == ours.keys()
        for key in ddp:  # parameters and buffers (BatchNorm statistics) alike
            assert torch.equal(ddp[key], ours[key]), key


@pytest.mark.timeout(120)
def test_a_port_also_runs_as_plain_python(plain_python: Overlapped) -> None:
    done = plain_python.result("plain")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 2 train loss" in done.stdout
