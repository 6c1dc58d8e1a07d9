"""The plain all-reduce's exchange is waited as its work, with no Python callback on its future
(issue 44: a callback runs on gloo's thread, which must take the GIL for it while the training
thread waits for that future); spans, which time the exchange in a callback, still get one.
Counted through ``exit_safety.then``, the one way gradsync attaches a callback to a future."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradsync as gs
from gradsync import exit_safety
from gradsync.workloads import make_workload

pytestmark = pytest.mark.unit


def _callbacks_per_step(monkeypatch: pytest.MonkeyPatch, **options: Any) -> float:
    attached: list[object] = []
    real = exit_safety.then

    def counted(future: Any, fn: Any) -> Any:
        attached.append(fn)
        return real(future, fn)

    monkeypatch.setattr(exit_safety, "then", counted)
    w = make_workload("mlp", seed=3, params=2000)
    model = w.build_model()
    sync = gs.Synchronizer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "bsp", check_every=0, **options
    )
    before = {p: p.detach().clone() for p in model.parameters()}
    steps = 4
    for step in range(steps):
        with sync.step():
            w.loss(model, *w.batch(step, 8, 0, 8)).backward()
    assert any(not torch.equal(p, before[p]) for p in model.parameters())  # it trained
    sync.close()
    return len(attached) / steps


def test_the_plain_all_reduce_attaches_no_callback(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _callbacks_per_step(monkeypatch, telemetry=False) == 0


def test_spans_still_time_the_exchange_in_a_callback(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _callbacks_per_step(monkeypatch, record_spans=True) >= 1
