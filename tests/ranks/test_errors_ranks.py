"""Each user error of the API gets one clear message naming the bad value and what is valid, in
a rank that run_ranks starts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.testing import run_ranks

pytestmark = pytest.mark.ranks


def _bad_synchronizers(rank: int, world: int) -> list[str]:
    messages = []
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    frozen = nn.Linear(2, 1).requires_grad_(False)
    cases = [
        lambda: gs.Synchronizer(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1)),
        lambda: gs.Synchronizer(model, opt, bucket_mb=0),
        lambda: gs.Synchronizer(model, opt, bucket_mb=-1.5),
        lambda: gs.Synchronizer(model, opt, strategy="ssp"),
    ]
    for make in cases:
        try:
            make()
            messages.append("no error")
        except UsageError as exc:
            messages.append(str(exc))
    sync = gs.Synchronizer(model, opt)
    for bad in (0, -1, 1.5):
        try:
            with sync.step(micro_batches=bad):  # type: ignore[arg-type]
                pass
            messages.append("no error")
        except UsageError as exc:
            messages.append(str(exc))
    try:  # fewer backward passes than announced
        with sync.step(micro_batches=2):
            model(torch.ones(1, 2)).sum().backward()
        messages.append("no error")
    except UsageError as exc:
        messages.append(str(exc))
    return messages


@pytest.mark.timeout(90)
def test_api_usage_errors() -> None:
    messages = run_ranks(_bad_synchronizers, 1)[0]
    assert "has no trainable parameters" in messages[0]
    assert "bucket_mb must be a number > 0, None for the default plan or 'auto'" in messages[1]
    assert messages[1].endswith("got 0"), messages[1]
    assert "got -1.5" in messages[2]
    assert "unknown strategy 'ssp'" in messages[3]
    for m, bad in zip(messages[4:7], ("0", "-1", "1.5"), strict=True):
        assert f"micro_batches must be an integer >= 1, got {bad}" in m
    assert "micro_batches=2) but the block ran 1 backward pass" in messages[7]
