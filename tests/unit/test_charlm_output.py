"""The charlm workload's model returns logits FSDP2 takes without a warning: a Linear on 3-D
input returns a view, and FSDP2 (``zero:3``) warned of it on every rank of every charlm run."""

from __future__ import annotations

import warnings

import pytest
import torch

import gradsync as gs
from gradsync.workloads import make_workload

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_charlm_under_zero3_trains_without_fsdp2s_view_warning(one_rank: None) -> None:
    workload = make_workload("charlm", seed=0)
    model = workload.build_model()
    sync = gs.Synchronizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "zero:3")
    x, y = workload.batch(0, 2, 0, 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with sync.step():
            workload.loss(sync.model, x, y).backward()
    sync.close()
    assert not [w for w in seen if "view tensor" in str(w.message)], [str(w.message) for w in seen]
