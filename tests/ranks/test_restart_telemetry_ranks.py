"""Telemetry of a run resumed on more ranks: each rank's own records restored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.ranks


def _resized(
    rank: int, world: int, directory: str, resume: bool
) -> tuple[list[tuple[int, int, int]], dict[str, Any]]:
    """3 steps on 2 ranks, each step's record naming its rank by its sample count (10 + rank),
    saved with the records not gathered yet (periodic gathers every 4 steps); or the resume of
    that on 3 ranks followed by 6 steps, across periodic gathers: the new rank restored no
    records, so gathers scheduled by each rank's pending count alone would come after
    different steps on different ranks (a hang). Each rank registers a replicated state and a
    per-rank one, both naming it: after the resize only the replicated one is loaded, rank
    0's on every rank."""
    import gradsync as gs
    from tests.support import zero_ranks as zr

    w = zr._workload()
    model = w.build_model()
    sync = gs.Synchronizer(model, zr.make_optimizer("sgd", model), telemetry_every=4, timeout_s=20)
    loaded: dict[str, Any] = {}
    sync.register_state(
        "schedule", lambda: {"of": rank}, lambda s: loaded.update(schedule=s), replicated=True
    )
    sync.register_state("shard", lambda: {"of": rank}, lambda s: loaded.update(shard=s))
    steps = range(3)
    if resume:
        assert sync.load(directory) is not None
        steps = range(3, 9)
    for step in steps:
        with sync.step(samples=10 + rank):
            w.loss(model, *zr._batch(w, step, rank, world)).backward()
    if not resume:
        sync.save(directory)
    sync.report()  # gathers the records, the restored ones included
    sync.close()
    assert sorted({r.step for r in sync._collector.records}) == list(range(9 if resume else 3))
    own = sorted((r.rank, r.step, r.samples) for r in sync._collector.records if r.step < 3)
    return own, loaded


@pytest.mark.timeout(120)
def test_a_resume_on_more_ranks_restores_each_ranks_own_records(tmp_path: Path) -> None:
    """Rank 1 gets its own records of the steps before the checkpoint back, not rank 0's; the
    new rank 2, which never ran them, gets none; the periodic gathers after it stay in step."""
    from gradsync.testing import run_ranks

    run_ranks(_resized, 2, str(tmp_path), False, timeout_s=90)
    resumed = run_ranks(_resized, 3, str(tmp_path), True, timeout_s=90)
    expected = [(rank, step, 10 + rank) for rank in range(2) for step in range(3)]
    assert resumed[0][0] == expected
    # registered states: the replicated one from rank 0's file on every rank, the other not
    assert [loaded for _, loaded in resumed] == [{"schedule": {"of": 0}}] * 3
