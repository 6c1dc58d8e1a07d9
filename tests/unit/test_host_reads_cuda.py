"""No host synchronization in the steady-state step on a GPU (issue 44): the strategies of
``test_host_reads.py`` on one NCCL rank under ``torch.cuda.set_sync_debug_mode("error")``,
which raises at any call that waits for the device. A module of its own: the CPU tests'
one-rank gloo group, module-scoped, would still be up in theirs, and gloo stages CUDA tensors
through the host (a wait)."""

from __future__ import annotations

import pytest
import torch

import gradsync as gs
from gradsync.workloads import make_workload
from tests.support.cuda_sync import one_nccl_rank, steps_that_never_wait
from tests.unit.test_host_reads import EVERY, STEPS, STRATEGIES, WARMUP

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_no_synchronization_with_cuda_sync_debug_mode() -> None:
    """The same steps on a GPU (a world of one over NCCL), with CUDA's sync debug mode raising
    at any call that waits for the device, between the telemetry gathers."""
    with one_nccl_rank():
        for strategy in STRATEGIES:
            _cuda_steps(strategy)


def _cuda_steps(strategy: str) -> None:
    w = make_workload("mlp", seed=2, params=30000)
    model = w.build_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    # No telemetry gather in the steps (it reads: the batch); the divergence check posts at
    # steps 4 and 9 and compares at step 9, where the event after the first has completed.
    sync = gs.Synchronizer(model, opt, strategy=strategy, telemetry_every=100, check_every=EVERY)
    steps_that_never_wait(sync, w, model, STEPS, WARMUP)
    sync.report()
    sync.close()
