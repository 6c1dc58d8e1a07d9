"""The fault injectors of ``gradsync.inject``: each fires where and when it says, and only then.

Scheduled faults are tested on a stand-in for the Synchronizer (the ``inject.Target``
protocol) and then on a real one in a world-size-1 group; hangs and kills need other
processes (tests/ranks/test_inject_ranks.py)."""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from gradsync import inject
from gradsync.errors import UsageError

pytestmark = pytest.mark.unit


class FakeSync:
    """What a scheduled fault reads of a Synchronizer; the test moves the step by hand."""

    def __init__(self, model: nn.Module, rank: int = 0) -> None:
        self.model = model
        self.rank = rank
        self.step_count = 0
        self.slowdowns: list[inject.Slowdown] = []


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _backward(model: nn.Module) -> list[torch.Tensor]:
    """One forward and backward pass from zero gradients; the gradients it left."""
    model.zero_grad(set_to_none=True)
    model(torch.ones(2, 3)).sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _finite(grads: list[torch.Tensor]) -> list[bool]:
    return [bool(torch.isfinite(g).all()) for g in grads]


# -- nan_gradient ---------------------------------------------------------------------------


def test_nan_gradient_poisons_every_gradient_of_its_step_only() -> None:
    sync = FakeSync(_model(), rank=1)
    fault = inject.nan_gradient(sync, rank=1, step=3)
    assert not fault.fired
    for step in range(6):
        sync.step_count = step
        grads = _backward(sync.model)
        assert len(grads) == 4
        if step == 3:
            assert all(bool(torch.isnan(g).all()) for g in grads), step
        else:
            assert all(_finite(grads)), step
    assert fault.fired


def test_nan_gradient_leaves_other_ranks_alone() -> None:
    sync = FakeSync(_model(), rank=0)
    fault = inject.nan_gradient(sync, rank=1, step=0)
    assert all(_finite(_backward(sync.model)))
    assert not fault.fired


def test_nan_gradient_is_seen_by_hooks_registered_before_it() -> None:
    # The Synchronizer's bucket hooks run after accumulation and exist before any fault is
    # installed: they must still see the poisoned gradient.
    model = _model()
    seen: list[bool] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(
            lambda q: seen.append(bool(torch.isfinite(q.grad).all()))
        )
    inject.nan_gradient(FakeSync(model), rank=0, step=0)
    _backward(model)
    assert seen == [False] * 4


def test_nan_gradient_on_one_named_parameter_with_an_infinity() -> None:
    sync = FakeSync(_model())
    inject.nan_gradient(sync, rank=0, step=0, param="2.bias", value=-math.inf)
    names = [n for n, _ in sync.model.named_parameters()]
    grads = dict(zip(names, _backward(sync.model), strict=True))
    assert torch.equal(grads["2.bias"], torch.full((1,), -math.inf))
    assert all(_finite([g for n, g in grads.items() if n != "2.bias"]))


def test_nan_gradient_removed_no_longer_fires() -> None:
    sync = FakeSync(_model())
    with inject.nan_gradient(sync, rank=0, step=0) as fault:
        assert "armed" in repr(fault)
    assert all(_finite(_backward(sync.model)))
    assert not fault.fired


def test_nan_gradient_refuses_what_it_cannot_do() -> None:
    sync = FakeSync(_model())
    with pytest.raises(UsageError, match=r"no trainable parameter 'nope'; valid: 0.weight, 0.bias"):
        inject.nan_gradient(sync, rank=0, step=0, param="nope")
    with pytest.raises(UsageError, match="must be NaN or infinite, got 1.0"):
        inject.nan_gradient(sync, rank=0, step=0, value=1.0)
    with pytest.raises(UsageError, match="needs a rank and a step >= 0, got 0, -1"):
        inject.nan_gradient(sync, rank=0, step=-1)


# -- raise_in_block -------------------------------------------------------------------------


def test_raise_in_block_raises_once_from_the_forward_pass_of_its_step() -> None:
    sync = FakeSync(_model(), rank=2)
    fault = inject.raise_in_block(sync, rank=2, step=1)
    _backward(sync.model)  # step 0: nothing
    sync.step_count = 1
    with pytest.raises(inject.InjectedError, match="injected failure: rank 2, step 1"):
        sync.model(torch.ones(1, 3))
    assert fault.fired
    assert all(_finite(_backward(sync.model)))  # the same step run again goes through


def test_raise_in_block_from_backward_before_any_gradient_lands() -> None:
    sync = FakeSync(_model())
    inject.raise_in_block(sync, rank=0, step=0, exc=OSError("disk gone"), during="backward")
    sync.model.zero_grad(set_to_none=True)
    loss = sync.model(torch.ones(2, 3)).sum()  # the forward pass is not where it fires
    with pytest.raises(OSError, match="disk gone"):
        loss.backward()
    assert all(p.grad is None for p in sync.model.parameters())


def test_raise_in_block_leaves_other_ranks_and_steps_alone() -> None:
    sync = FakeSync(_model(), rank=0)
    inject.raise_in_block(sync, rank=1, step=0)
    other_step = inject.raise_in_block(FakeSync(sync.model, rank=0), rank=0, step=5)
    assert all(_finite(_backward(sync.model)))
    assert not other_step.fired
    with pytest.raises(UsageError, match="during must be 'forward' or 'backward'"):
        inject.raise_in_block(sync, rank=0, step=0, during="optimizer")


# -- slow -----------------------------------------------------------------------------------


def test_slow_adds_a_slowdown_the_synchronizer_applies() -> None:
    sync = FakeSync(_model())
    s = inject.slow(sync, rank=1, factor=3, start=10, end=50)
    assert sync.slowdowns == [s] == inject.parse_slow("1:3@10-50")
    assert s.delay(1, 10, 0.5) == 1.0 and s.delay(1, 50, 0.5) == 0.0 and s.delay(0, 20, 0.5) == 0
    with pytest.raises(UsageError, match="factor must be in"):
        inject.slow(sync, rank=1, factor=0.5)
    assert sync.slowdowns == [s]


# -- kill -----------------------------------------------------------------------------------


def test_maybe_kill_fires_once_per_marker_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    signals: list[tuple[int, int]] = []

    def record(pid: int, sig: int) -> None:
        signals.append((pid, sig))
        raise SystemExit  # what SIGKILL would do to the caller: not return

    monkeypatch.setattr(os, "kill", record)
    kills = inject.parse_kill("1:3")
    inject.maybe_kill(kills, 0, 3, tmp_path)  # another rank
    inject.maybe_kill(kills, 1, 2, tmp_path)  # another step
    assert signals == []
    with pytest.raises(SystemExit):
        inject.maybe_kill(kills, 1, 3, tmp_path)
    assert signals == [(os.getpid(), signal.SIGKILL)]
    assert (tmp_path / "kill-rank1-step3.json").exists()
    inject.maybe_kill(kills, 1, 3, tmp_path)  # resumed past the kill: it does not fire again
    assert len(signals) == 1


# -- hang -----------------------------------------------------------------------------------


def test_hang_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(UsageError, match=r"inject.hang\(\) needs torch.distributed"):
        inject.hang(limit_s=0)


# -- on a real Synchronizer -----------------------------------------------------------------


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A world-size-1 group in this process (FileStore: no port), gone after the test."""
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _train(sync: gs.Synchronizer, steps: int) -> list[torch.Tensor]:
    snapshots = []
    for _ in range(steps):
        with sync.step():
            sync.model(torch.ones(2, 3)).pow(2).sum().backward()
        snapshots.append(torch.cat([p.detach().reshape(-1) for p in sync.model.parameters()]))
    return snapshots


def test_a_synchronizer_skips_the_step_nan_gradient_poisons(one_rank: None) -> None:
    model = _model()
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fault = inject.nan_gradient(sync, rank=0, step=1)
    snapshots = _train(sync, 3)
    assert fault.fired
    assert torch.equal(snapshots[0], snapshots[1])  # step 1 changed nothing
    assert not torch.equal(snapshots[1], snapshots[2])
    assert [r.step for r in sync.report().records if r.skipped] == [1]


def test_a_synchronizer_step_fails_with_the_injected_error_then_goes_on(one_rank: None) -> None:
    model = _model()
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inject.raise_in_block(sync, rank=0, step=1)
    _train(sync, 1)
    with pytest.raises(inject.InjectedError):
        _train(sync, 1)
    # The failed step counts, as a skipped one: every rank of a larger group skipped it too,
    # and step numbers must stay in agreement (see tests/ranks/test_gate.py).
    assert sync.step_count == 2
    assert [r.step for r in sync.flush_telemetry() if r.skipped] == [1]
    _train(sync, 2)
    assert sync.step_count == 4


def test_a_synchronizer_sleeps_for_an_injected_slowdown(one_rank: None) -> None:
    model = _model()
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inject.slow(sync, rank=0, factor=20, start=1, end=2)
    _train(sync, 2)
    first, slowed = sorted(sync.report().records, key=lambda r: r.step)
    # step 1 sleeps 19x step 0's compute (the last measured) on top of its own
    assert slowed.compute >= 19 * first.compute > 0


def test_a_slowdown_of_a_rank_the_group_lacks_is_refused(one_rank: None) -> None:
    """``slow="3:2"`` in a world of one slowed nothing, silently (``gradsync run --slow``
    refuses it before the run); a rank the group has is taken."""
    model = _model()
    with pytest.raises(UsageError, match=r"slow names rank 3, but this group's ranks are 0\.\.0"):
        gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), slow="3:2")
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), slow="0:2@5")
    try:
        assert [(s.rank, s.factor, s.start) for s in sync.slowdowns] == [(0, 2.0, 5)]
    finally:
        sync.close()


def test_a_slowdowns_sleep_is_counted_as_long_as_it_lasted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seconds returned are what the sleep took: the Synchronizer takes them out of the
    step's compute, and a sleep that overran (as the scheduler makes it on a busy machine)
    was counted as compute, growing every later delay (a user tester's --slow 1:3 gave 5.5x)."""
    real_sleep = inject.time.sleep

    def overrunning(seconds: float) -> None:
        real_sleep(seconds + 0.02)

    monkeypatch.setattr(inject.time, "sleep", overrunning)
    slow = [inject.Slowdown(rank=0, factor=3.0)]
    assert inject.apply_slowdowns(slow, rank=0, step=0, natural=0.005) >= 0.03
    assert inject.apply_slowdowns(slow, rank=1, step=0, natural=0.005) == 0.0  # not this rank


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("1:0.5", "bad --slow value '1:0.5': slowdown factor must be in [1, 1000], got 0.5"),
        ("1:3@30-10", "bad --slow value '1:3@30-10': slowdown end step 10 must be after its"),
        ("-1:2", "bad --slow value '-1:2': slowdown rank must be >= 0, got -1"),
        ("1:x", "bad --slow value '1:x'; valid: RANK:FACTOR[@START[-END]]"),
    ],
)
def test_a_bad_slow_value_says_which_number_is_wrong(spec: str, said: str) -> None:
    """Well-formed values out of range were told only the form, not what was wrong."""
    with pytest.raises(UsageError) as info:
        inject.parse_slow(spec)
    assert str(info.value).startswith(said), str(info.value)
