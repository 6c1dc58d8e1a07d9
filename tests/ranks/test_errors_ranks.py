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
        # another model's optimizer: the model never moved, silently (a user tester's script)
        lambda: gs.Synchronizer(model, torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)),
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
    assert "optimizer SGD holds none of model Linear's parameters" in messages[4]
    for m, bad in zip(messages[5:8], ("0", "-1", "1.5"), strict=True):
        assert f"micro_batches must be an integer >= 1, got {bad}" in m
    assert "micro_batches=2) but the block ran 1 backward pass" in messages[8]


def _wrong_passes(rank: int, world: int) -> dict[str, list[str]]:
    """Another number of backward passes than announced, under the strategies that count them
    where a world of one cannot show it: zero:3 (FSDP2's reduce-scatters) and a parameter-server
    worker (tests/unit/test_backward_pass_count.py has the others); and that worker's
    ``sync.load()`` once its server serves."""
    out: dict[str, list[str]] = {}
    x = torch.ones(2, 4)
    for strategy in ("zero:3", "ssp:1"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
        sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
        messages = out[strategy] = []
        if sync.is_server:
            sync.serve()
            continue
        for ran in (1, 3):
            try:
                with sync.step(micro_batches=2):
                    for _ in range(ran):
                        sync.model(x).sum().backward()
                messages.append("no error")
            except UsageError as exc:
                messages.append(str(exc))
        with sync.step(micro_batches=2):  # the announced count still trains
            for _ in range(2):
                sync.model(x).sum().backward()
        if strategy == "ssp:1":
            # a worker's load once its server serves waited timeout_s (300 s), then failed
            # with gloo's own error (a user tester's script)
            try:
                sync.load("checkpoints-that-need-not-exist")
                out["load"] = ["no error"]
            except UsageError as exc:
                out["load"] = [str(exc)]
        sync.report()
        sync.close()
    return out


@pytest.mark.timeout(120)
def test_another_number_of_backward_passes_is_refused_under_zero3_and_ssp() -> None:
    by_rank = run_ranks(_wrong_passes, 2, timeout_s=110)
    for strategy, workers in (("zero:3", (0, 1)), ("ssp:1", (0,))):
        for rank in workers:
            got = by_rank[rank][strategy]
            assert len(got) == 2, (strategy, rank, got)
            for message, ran in zip(got, (1, 3), strict=True):
                assert f"micro_batches=2) but the block ran {ran} backward" in message, message
    (said,) = by_rank[0]["load"]
    assert said.startswith("sync.load() after this worker's first step: under a parameter"), said
