"""What a SIGKILLed rank leaves of a checkpoint every step when its writer writes every snapshot
(``files_every=1``: the writer of every strategy that is not lockstep, streaming DiLoCo's too).

A user-tester saw a streaming DiLoCo run (``diloco:4:2:1``, ``--checkpoint-every 1``) resume two
steps before the killed rank's step, both newer step directories skipped as "incomplete: no
MANIFEST.json". These tests pin down which cause that can be: not the writers (two saves in
flight at a kill, behind a writer that lags, are both written and the newer one is committed),
but a survivor that had not handed its snapshots of those steps over when it was stopped. The
ranks of a non-lockstep strategy drift apart between the points where they wait on each other
(streaming DiLoCo: every H/F steps, where a fragment's exchange is resolved), and a survivor
blocked in ``submit`` (its writer behind by ``depth``) has not handed over the snapshot it
holds: the newest checkpoint is the newest step every rank handed over, which may be up to
H/F steps before the killed rank's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import gradsync as gs
from gradsync.checkpoint import CheckpointStore
from gradsync.checkpoint.store import CheckpointWarning
from gradsync.checkpoint.writer_locks import wait_for_writers
from gradsync.checkpoint.writer_process import process_writer_available
from gradsync.testing import RankFailure, run_ranks
from gradsync.workloads import make_workload
from tests.support.proctree import reaped_within

pytestmark = [
    pytest.mark.ranks,
    pytest.mark.timeout(60),
    pytest.mark.skipif(not process_writer_available(), reason="needs Linux memfd"),
]

# One rank's saves: steps 1..LAST, each handed to a process writer that writes every snapshot.
# STOP > 0: once step STOP is written, the writer is stopped (SIGSTOP: a writer starved of CPU,
# as a SCHED_IDLE one is on a busy machine), so the later steps stay in flight and, past
# ``depth``, ``submit`` blocks. Prints the writer's pid, then "saving N" before each save.
_RANK = """
import os, signal, sys, time, torch
from gradsync.checkpoint import CheckpointStore
from gradsync.checkpoint.store import snapshot
from gradsync.checkpoint.writer_process import ProcessCheckpointWriter
directory, rank, last, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
w = ProcessCheckpointWriter(CheckpointStore(directory), rank=rank, world_size=2,
                            save_id="attempt-1", timeout_s=30)
print(w._child.pid, flush=True)
weights = torch.zeros(50_000)
for step in range(1, last + 1):
    print("saving", step, flush=True)
    weights.fill_(float(step))
    w.submit(step, snapshot({"w": weights}, pool=w.pool))
    if step == stop:
        while w._written < step:
            time.sleep(0.005)
        os.kill(w._child.pid, signal.SIGSTOP)
print("saved", flush=True)
time.sleep(60)
"""


class _Rank:
    def __init__(self, directory: Path, rank: int, last: int, stop: int = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _RANK, str(directory), str(rank), str(last), str(stop)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.writer = int(self.proc.stdout.readline())

    def until(self, line: str) -> None:
        assert self.proc.stdout is not None
        while (got := self.proc.stdout.readline()) and got.strip() != line:
            pass
        assert got, f"the rank ended before printing {line!r}"

    def kill(self) -> None:
        """SIGKILL the rank alone, as ``--kill`` does (its writer process lives on), then let
        its writer go on."""
        self.proc.kill()
        self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.writer, signal.SIGCONT)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        with contextlib.suppress(ProcessLookupError):  # left stopped by a failed assertion
            os.kill(self.writer, signal.SIGCONT)


def _newest(directory: Path, check: bool = True) -> tuple[int | None, list[str]]:
    """The step a resume would take, and the warnings naming the steps it skipped."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        info = CheckpointStore(directory).latest()
        if info is not None and check:
            saved = CheckpointStore(directory).load(info, 1)["w"]
            assert torch.equal(saved, torch.full((50_000,), float(info.step)))
    skipped = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    return (None if info is None else info.step), skipped


def test_two_saves_in_flight_behind_a_lagging_writer_are_both_written_at_a_kill(
    tmp_path: Path,
) -> None:
    # Rank 1's writer stops after step 3: steps 4 and 5 are in flight (its ``depth``) when both
    # ranks are killed. Its writer writes them as it is let go, and rank 0's, once its peer's
    # has ended, commits step 5: no step lost, and never two in a row.
    ranks = [_Rank(tmp_path, 0, 5), _Rank(tmp_path, 1, 5, stop=3)]
    try:
        for r in ranks:
            r.until("saved")
        for r in ranks:
            r.kill()
        for r in ranks:
            assert reaped_within(r.writer, within_s=20), f"writer {r.writer} did not end"
    finally:
        for r in ranks:
            r.close()
    step, skipped = _newest(tmp_path)
    assert step == 5 and skipped == []


#: streaming DiLoCo's fragment 0 starts its exchange after step 13 ((13 + 1) % 4 == 2), applied
#: after step 14 (TAU 1); the killed rank reaches step 15
STALLED, KILLED = 13, 15


def _drifted(rank: int, world: int, directory: str) -> None:
    """``gradsync run --strategy diloco:4:2:1 --checkpoint-every 1 --kill 1:15`` on two ranks,
    with rank 0 stalled right after step 13 (descheduled on a busy machine, or its save
    waiting for its writer) until rank 1 reaches its kill; rank 0 is then stopped as the
    elastic agent stops a survivor (its SIGTERM ends it at once: ``runner.stopped``)."""
    w = make_workload("mlp", seed=5, params=3000)
    model = w.build_model()
    sync = gs.Synchronizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        strategy="diloco:4:2:1",
        timeout_s=30,
        telemetry_every=1000,  # no gather of the step records: no other wait on each other
    )
    reached = Path(directory) / "rank-1-reached-its-kill"
    for step in range(KILLED):
        with sync.step(samples=4):
            x, y = w.batch(step, 4 * world, 4 * rank, 4 * rank + 4)
            w.loss(model, x, y).backward()
        if rank == 0 and step == STALLED:
            deadline = time.monotonic() + 30
            while not reached.exists():
                assert time.monotonic() < deadline, "rank 1 waited for the stalled rank 0"
                time.sleep(0.01)
            os._exit(143)  # stopped before its save of step 14 was handed over
        sync.save(Path(directory), wait=False)  # as gradsync run's --checkpoint-every 1
    # where ``--kill 1:15`` fires, at the start of step 15, its save of step 15 handed over
    reached.write_text(str(sync.step_count))
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_streaming_diloco_lets_a_survivor_lag_the_killed_rank_by_h_over_f_steps(
    tmp_path: Path,
) -> None:
    # The tester's observation with the real strategy and writers: diloco:4:2:1 waits on the
    # peers only where a fragment's exchange is resolved (its save, or its application a step
    # later), every H/F = 2 steps. So rank 1 saves steps 14 and 15 and reaches its kill while
    # rank 0, stalled after posting step 13's exchange, has handed over step 13 alone. Both
    # writers write all they were handed, and the resume takes step 13, the newest step both
    # ranks saved: 14 and 15 "incomplete: no MANIFEST.json", two steps lost, none by the
    # checkpoints.
    out = run_ranks(_drifted, 2, str(tmp_path), timeout_s=100, allow_failures=True)
    assert all(isinstance(r, RankFailure) for r in out)  # both ended without returning
    assert (tmp_path / "rank-1-reached-its-kill").read_text() == str(KILLED)
    assert wait_for_writers(tmp_path, timeout_s=20) == []  # they wrote all and ended
    step, skipped = _newest(tmp_path, check=False)
    assert step == STALLED
    assert len(skipped) == KILLED - STALLED
    for newer, why in zip(range(KILLED, STALLED, -1), skipped, strict=True):
        assert f"step-0000{newer}: incomplete: no MANIFEST.json" in why
