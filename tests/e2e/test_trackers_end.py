"""End-to-end: the ``--tracker`` sinks of a script's run get its last steps and end with how
the attempt ended, in one run of three attempts (each ``gradsync run`` costs seconds of
start-up on 2 cores).

- An attempt that fails: a rank raising ends its trackers FAILED; rank 0 stopped by the agent's
  SIGTERM after rank 1 failed ends them KILLED. Either way what rank 0 wrote to metrics.jsonl
  reaches them first (W&B's offline file held a header and no history, MLflow's run stayed
  RUNNING), in each attempt of a run with a restart.
- The script never calls ``sync.report()``: in the attempt that ends, each rank writes the
  steps no gather took into metrics.jsonl at its exit; rank 0's trackers get them too (they
  had the gathered steps alone, 0-9 of 25), and its MLflow run ends FINISHED (it stayed
  RUNNING).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from gradsync.telemetry import trackers
from gradsync.telemetry.records import read_jsonl, read_records
from tests.e2e.test_trackers_run import _items, _wandb_records
from tests.support.cli import gradsync

pytestmark = pytest.mark.e2e

INSTALLED = [n for n in ("tensorboard", "wandb", "mlflow") if importlib.util.find_spec(n)]
needs_trackers = pytest.mark.skipif(not INSTALLED, reason="no tracker extra installed")

#: a user's script of the front-door kind: no report(), no close(); in attempt K the K-th of
#: ``FAIL_RANKS`` (the last for later ones) raises at step ``FAIL_AT`` (-1: none does)
SCRIPT = """
import os
import sys
import torch
import gradsync as gs

steps, fail_at = int(sys.argv[1]), int(sys.argv[3])
fail_ranks = [int(r) for r in sys.argv[2].split(",")]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
fail_rank = fail_ranks[min(attempt, len(fail_ranks) - 1)]
gs.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.05))
data = torch.Generator().manual_seed(gs.rank())
for step in range(steps):
    if step == fail_at and gs.rank() == fail_rank:
        raise RuntimeError(f"the user's error at step {step}")
    x = torch.randn(8, 4, generator=data)
    with sync.step(samples=8) as s:
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        s.loss = loss
"""


def _run(tmp_path: Path, *script_args: str, restarts: int = 0) -> tuple[Path, Any]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    argv = ["run", "--nproc", "2", "--no-plots", "--tracker", ",".join(INSTALLED)]
    argv += ["--max-restarts", str(restarts), "--out", str(out), "--", str(script)]
    return out, gradsync(*argv, *script_args, timeout=100)


def _mlflow_runs(out: Path) -> list[tuple[str, dict[int, dict[str, float]]]]:
    """Each MLflow run's status and scalars by step."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / trackers.MLFLOW_DIR).as_uri())
    experiment = client.get_experiment_by_name(trackers.WANDB_PROJECT)
    found = []
    for run in client.search_runs([experiment.experiment_id]):
        got: dict[int, dict[str, float]] = {}
        for key in run.data.metrics:
            for metric in client.get_metric_history(run.info.run_id, key):
                got.setdefault(metric.step, {})[key] = metric.value
        found.append((run.info.status, got))
    return found


def _wandb_runs(out: Path) -> list[tuple[int | None, dict[int, dict[str, float]]]]:
    """Each offline W&B run's exit code (None: no exit record) and history by step."""
    found = []
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        code, got = None, {}
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                got[record.history.step.num] = _items(record.history.item)
            elif kind == "exit":
                code = record.exit.exit_code
        found.append((code, got))
    return found


def _tensorboard_attempts(out: Path) -> list[dict[int, dict[str, float]]]:
    """Each attempt's TensorBoard scalars by step, one event file each (rank 0's writer, one
    a process), oldest first: read as one, a later attempt's steps would hide an earlier's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(
        (out / trackers.TENSORBOARD_DIR).glob("events.out.tfevents.*"),
        key=lambda p: (int(p.name.split(".")[3]), p.stat().st_mtime),
    )
    found = []
    for path in files:
        events = EventAccumulator(str(path))
        events.Reload()
        got: dict[int, dict[str, float]] = {}
        for tag in events.Tags()["scalars"]:
            for event in events.Scalars(tag):
                got.setdefault(event.step, {})[tag] = event.value
        found.append(got)
    return found


#: how each tracker's run of a failed attempt ends (rank 0 raised; rank 0 SIGTERMed) and of
#: one that ran to its end: MLflow's status, W&B's exit code; TensorBoard's event files have no
#: ending (None), and are told apart by their order
FAILED = {"tensorboard": None, "mlflow": "FAILED", "wandb": 1}
KILLED = {"tensorboard": None, "mlflow": "KILLED", "wandb": 1}
FINISHED = {"tensorboard": None, "mlflow": "FINISHED", "wandb": 0}


@needs_trackers
@pytest.mark.timeout(200)
def test_each_attempt_ends_its_trackers_and_a_script_without_report_sends_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run, three attempts of a script that never calls ``sync.report()``. Attempt 0:
    rank 0 raises at step 13 (FAILED); attempt 1, after the restart: rank 1 raises, and the
    agent stops rank 0 with SIGTERM (KILLED); attempt 2: no rank raises, and the script's 25
    steps end (FINISHED), with every step in its trackers (they had steps 0-9 alone)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    steps = 25  # gathers at 10 and 20: the trackers had steps 0-9 alone
    fail_at = 13  # past the gather at step 10, which no tracker had yet (written at the next)
    out, proc = _run(tmp_path, str(steps), "0,1,-1", str(fail_at), restarts=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the user's raises, one an attempt (their message is printed only where the run ends on
    # them): rank 0's process, then rank 1's, exited with code 1
    deaths = re.findall(r"worker process (\d) of this machine \(pid \d+\) (.*)", proc.stderr)
    assert deaths == [("0", "exited with code 1"), ("1", "exited with code 1")], proc.stderr
    assert "tracker" not in proc.stderr, proc.stderr[-3000:]  # no sink failed (logged)

    # rank 0's records of each attempt, as it wrote them (the other rank's come after it)
    raw = [r for r in read_jsonl(out / "metrics.jsonl") if r["rank"] == 0]
    for attempt, last in ((0, fail_at), (1, fail_at), (2, steps)):
        got_steps = sorted(r["step"] for r in raw if r.get("attempt", 0) == attempt)
        assert got_steps == list(range(last)), (attempt, got_steps)
    # the last attempt's records, with the idle and comm derived for those no gather took;
    # read as the steps after the earlier attempts' (its steps count from 0 again), which its
    # trackers got as the script numbered them
    last = [r for r in read_records(out) if r.attempt == 2]
    first = min(r.step for r in last)
    want: dict[int, dict[str, float]] = {}
    for r in last:
        for tag in ("compute", "comm", "idle", "loss"):
            want.setdefault(r.step - first, {})[f"{tag}/rank{r.rank}"] = float(getattr(r, tag))
    assert sorted(want) == list(range(steps)) and all(len(v) == 8 for v in want.values())

    runs: dict[str, list[tuple[Any, dict[int, dict[str, float]]]]] = {}
    if "tensorboard" in INSTALLED:  # in the attempts' order
        runs["tensorboard"] = [(None, got) for got in _tensorboard_attempts(out)]
    if "mlflow" in INSTALLED:
        runs["mlflow"] = _mlflow_runs(out)
    if "wandb" in INSTALLED:
        runs["wandb"] = _wandb_runs(out)
    assert sorted(runs) == sorted(INSTALLED)
    for name, found in runs.items():
        assert len(found) == 3, (name, [ending for ending, _ in found])  # one an attempt
        endings = [ending for ending, _ in found]
        want_endings = [FAILED[name], KILLED[name], FINISHED[name]]
        assert sorted(endings, key=str) == sorted(want_endings, key=str), (name, endings)
        if name == "tensorboard":
            failed, finished = found[:2], found[2]
        else:
            failed = [run for run in found if run[0] != FINISHED[name]]
            (finished,) = [run for run in found if run[0] == FINISHED[name]]
        for _, got in failed:  # what rank 0 wrote reached them before they ended
            rank0 = sorted(step for step, scalars in got.items() if "compute/rank0" in scalars)
            assert rank0 == list(range(fail_at)), (name, rank0)
        got = finished[1]
        assert sorted(got) == list(range(steps)), name
        for step, scalars in want.items():
            for key, value in scalars.items():
                assert got[step][key] == pytest.approx(value, rel=1e-6), (name, step, key)
