"""End-to-end: ``gradsync run --tracker`` leaves each tracker's files in the run directory, and
each library's reader finds every rank's scalars in them, equal to metrics.jsonl's.

One run writes every installed tracker at once (the run dominates the cost): the session's
uninterrupted bsp run (tests/e2e/conftest.py, clean_bsp_run), which test_fault_e2e and
test_zero3_e2e read too.
TensorBoard is read with its EventAccumulator and MLflow with its client. W&B ships no Python
reader of its offline ``.wandb`` file any more (``wandb sync`` uploads it, which needs a
server), so ``_wandb_history`` reads it here: the file is LevelDB's log format behind a
7-byte ``:W&B`` header, and each record is W&B's own ``Record`` protobuf
(``wandb.proto.wandb_internal_pb2``), whose history rows hold the logged values.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gradsync.telemetry import trackers
from gradsync.telemetry.records import read_records
from tests.support.shared_runs import FAULT_COMMON, TRACKERS_INSTALLED, SharedRun

pytestmark = pytest.mark.e2e

STEPS = int(FAULT_COMMON[FAULT_COMMON.index("--steps") + 1])
INSTALLED = TRACKERS_INSTALLED


@pytest.mark.timeout(240)
@pytest.mark.skipif(not INSTALLED, reason="no tracker extra installed (pip install .[trackers])")
def test_run_with_every_tracker_writes_every_ranks_scalars(
    clean_bsp_run: SharedRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gradsync run --nproc 2 --workload mlp --tracker ...`` (CLEAN_BSP's flags, 30 steps;
    the fixture checked it exited 0)."""
    # MLflow 3 reads its file store only when asked, as the sink asked to write it
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = clean_bsp_run.out
    assert "failed" not in clean_bsp_run.stderr, clean_bsp_run.stderr[-3000:]  # no sink failed

    want: dict[int, dict[str, float]] = {}
    for r in read_records(out):
        for tag in ("compute", "comm", "idle", "loss"):
            want.setdefault(r.step, {})[f"{tag}/rank{r.rank}"] = float(getattr(r, tag))
    assert sorted(want) == list(range(STEPS)) and len(want[0]) == 8
    readers = {"tensorboard": _tensorboard, "wandb": _wandb, "mlflow": _mlflow}
    for name in INSTALLED:
        got = readers[name](out)
        for step, scalars in want.items():
            for key, value in scalars.items():
                assert got[step][key] == pytest.approx(value, rel=1e-6), (name, step, key)
        assert got[STEPS - 1]["run/steps"] == STEPS, name  # finish() ran: the report's values


def _tensorboard(out: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / trackers.TENSORBOARD_DIR))
    events.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            got.setdefault(event.step, {})[tag] = event.value
    return got


def _mlflow(out: Path) -> dict[int, dict[str, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / trackers.MLFLOW_DIR).as_uri())
    experiment = client.get_experiment_by_name(trackers.WANDB_PROJECT)
    (run,) = client.search_runs([experiment.experiment_id])
    got: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            got.setdefault(metric.step, {})[key] = metric.value
    return got


def _wandb(out: Path) -> dict[int, dict[str, float]]:
    """The run's history rows by step, and its final summary at the last step (W&B keeps
    end-of-run values there)."""
    (path,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    got: dict[int, dict[str, float]] = {}
    summary: dict[str, Any] = {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            got[record.history.step.num] = _items(record.history.item)
        elif kind == "summary":
            summary.update(_items(record.summary.update))
    got[STEPS - 1]["run/steps"] = summary["run/steps"]
    return got


def _items(items: Any) -> dict[str, Any]:
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}


_BLOCK = 32768  # LevelDB log blocks; the 7-byte header counts in the first one
_HEADER = 7  # ":W&B", a 2-byte ident, a 1-byte version; and each chunk's crc, length, type


def _wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data.startswith(b":W&B"), data[:_HEADER]
    pos, parts = _HEADER, b""
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a header: padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        parts += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):  # FULL, or LAST of FIRST / MIDDLE... LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record
