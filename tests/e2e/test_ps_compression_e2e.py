"""Compressed parameter-server pushes through ``gradsync run``: async with topk survives a
killed worker."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from gradsync.checkpoint.store import CheckpointStore
from tests.support.cli import gradsync

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(150)
def test_cli_async_with_topk_survives_a_killed_worker(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = gradsync(
        "run",
        *("--workload", "mlp", "--params", "3000", "--nproc", "2", "--steps", "12"),
        *("--strategy", "async", "--compress", "topk:0.1"),
        *("--checkpoint-every", "5", "--kill", "1:7", "--max-restarts", "1"),
        *("--out", str(out), "--no-progress", "--no-plots"),
        timeout=140,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    workers = [r for r in rows if r["rank"] in (0, 1)]
    assert sorted((r["rank"], r["step"]) for r in workers) == [
        (w, s) for w in (0, 1) for s in range(12)
    ]
    numel = torch.cat(
        [t.reshape(-1) for t in torch.load(out / "final_model.pt", weights_only=True).values()]
    ).numel()
    assert all(r["bytes"] < 0.25 * 4 * numel for r in workers)  # top 10%: values + indices
    assert all(math.isfinite(r["loss"]) for r in workers)
    # The records of steps 0..4, never gathered under async, came back through the row log
    # the checkpoint names (docs/checkpoints.md), not in the file, which would otherwise carry
    # every record of the run.
    found = re.search(r"restart: resuming at step (\d+)\b", proc.stderr)
    assert found, proc.stderr[-3000:]
    store = CheckpointStore(out / "checkpoints")
    newest = store.latest()
    assert newest is not None
    saved = store.load(newest, 0)
    assert "telemetry" not in saved
    assert saved["telemetry_log"] == [int(found.group(1)), newest.step]
