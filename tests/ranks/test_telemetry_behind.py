"""The periodic telemetry gather runs behind the steps: no rank waits for another because of it.

Under a strategy whose ranks meet only every H steps, a blocking gather every few steps was a
barrier of its own. Here rank 1 holds still at step 2 until rank 0 says it has run past the
first gather: with a gather that waits, rank 0 never gets there and the test times out.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from gradsync.telemetry.timing import ROW_COLUMNS, TelemetryCollector
from gradsync.testing import run_ranks

STEPS, EVERY, AHEAD = 23, 5, 8  # rank 0 must get past step AHEAD before rank 1 goes on


def _behind(rank: int, world_size: int, store_path: str) -> dict[str, Any]:
    store = dist.FileStore(store_path, world_size)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    sync = gs.Synchronizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        strategy="local:1000",
        telemetry_every=EVERY,
        timeout_s=30,
    )
    gathered_after: list[int] = []  # records gathered so far, after each step
    pending_after_first: int | None = None
    for step in range(STEPS):
        if rank == 1 and step == 2:
            store.wait(["rank0-ahead"], datetime.timedelta(seconds=20))
        with sync.step(samples=2) as s:
            loss = model(torch.full((2, 4), float(rank + 1))).pow(2).mean()
            loss.backward()
            s.loss = loss
        gathered_after.append(len(sync._collector.records))
        if step == EVERY - 1:
            # The first gather is in flight: a checkpoint taken now still carries its rows.
            pending_after_first = len(sync._collector.pending_flat_rows()) // ROW_COLUMNS
        if rank == 0 and step == AHEAD:
            store.set("rank0-ahead", "1")
    report = sync.report()
    steps_seen = sorted((r.rank, r.step) for r in sync._collector.records)
    sync.close()
    return {
        "gathered_after": gathered_after,
        "pending_after_first": pending_after_first,
        "steps_seen": steps_seen,
        "report_steps": report.steps,
    }


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_periodic_gather_lets_a_rank_run_ahead_and_loses_no_record(tmp_path: Path) -> None:
    results = run_ranks(_behind, 2, str(tmp_path / "store"), timeout_s=90)
    for res in results:
        # Every step of every rank once, the last ones by the report's final gather.
        assert res["steps_seen"] == [(r, s) for r in range(2) for s in range(STEPS)]
        assert res["report_steps"] == STEPS
        assert res["pending_after_first"] == EVERY
    # Records are taken at the same step on every rank (a balancer fed by them stays in
    # agreement), one gather behind: the first gather's records after the second gather.
    assert results[0]["gathered_after"] == results[1]["gathered_after"]
    first = results[0]["gathered_after"]
    assert first[2 * EVERY - 2] == 0 and first[2 * EVERY - 1] == 2 * EVERY


def _fewer_than_a_gather(rank: int, world_size: int) -> dict[str, Any]:
    collector = TelemetryCollector(None, flush_every=5)
    for step in range(3):  # fewer than flush_every: the periodic gather pads the rest
        collector.add(step, 0.0, 0.01, 0.0, 2, 0, None)
    collector.flush_behind(2)
    in_flight = collector.pending_rows().shape[0]
    collector.flush(3)
    return {
        "in_flight": in_flight,
        "records": sorted((r.rank, r.step) for r in collector.records),
    }


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_a_gather_of_fewer_rows_than_its_period_takes_no_padding_for_a_record() -> None:
    for res in run_ranks(_fewer_than_a_gather, 2, timeout_s=45):
        assert res["in_flight"] == 3  # a checkpoint meanwhile carries the rows, not the padding
        assert res["records"] == [(r, s) for r in range(2) for s in range(3)]
