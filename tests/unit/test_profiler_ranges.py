"""gradsync's phases show up as named ranges in a torch.profiler trace."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import gradsync as gs
from gradsync.workloads import make_workload

pytestmark = pytest.mark.unit


def test_every_phase_is_a_named_range_in_a_profiler_trace(one_rank: None) -> None:
    w = make_workload("mlp", seed=0, params=2000)
    model = w.build_model()
    sync = gs.Synchronizer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), check_every=1, telemetry_every=1
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(2):
            with sync.step() as s:
                w.loss(model, *w.batch(step, 4, 0, 4)).backward()
                s.synchronize()
        sync.report()
    sync.close()
    names = {event.name for event in prof.events()}
    expected = {
        "gradsync.begin_step",
        "gradsync.launch[bucket 0]",
        "gradsync.gradients_ready",
        "gradsync.update",
        "gradsync.divergence_check",
        "gradsync.telemetry_gather",
        "gradsync.finalize",
    }
    assert expected <= names, sorted(expected - names)
