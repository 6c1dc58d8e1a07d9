"""The device verdict waits for the first update that was applied (issue 44's edge).

Fused SGD with momentum allocates its momentum buffers uninitialised (``torch.empty_like``) on
its first step and fills them only if that step is applied. A first step skipped on the device
(``found_inf`` = 1) therefore leaves the buffers holding whatever the allocator had there,
and every later update adds that garbage in. Handing the optimizer the device flag "from the
second step on" is not enough: where steps 0 and 1 are both non-finite, step 1 is the
optimizer's first. Each strategy here must keep the host path until an update was applied.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import gradsync as gs
from gradsync import inject
from gradsync.workloads import make_workload
from tests.support.host_reads import host_reads

pytestmark = pytest.mark.unit

STEPS, NAN_STEPS = 5, (0, 1)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    """The whole parameters, as plain tensors (zero:3's are FSDP2's DTensors)."""
    whole = [getattr(p, "full_tensor", p.detach)() for p in model.parameters()]
    return torch.cat([t.detach().reshape(-1) for t in whole])


def _train(
    strategy: str, fused: bool
) -> tuple[list[torch.Tensor], torch.optim.Optimizer, set[int]]:
    """Steps 0 and 1 non-finite, then finite ones; the parameters after each step, and the
    steps that read a tensor on the host."""
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    # the reference: torch's per-tensor loop, which makes its buffers only when it updates
    loop = {"fused": True} if fused else {"foreach": False}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, **loop)
    sync = gs.Synchronizer(model, opt, strategy=strategy, telemetry=False)
    if strategy != "zero:3":
        for step in NAN_STEPS:
            inject.nan_gradient(sync, rank=0, step=step)
    params = []
    with host_reads() as reads:
        for step in range(STEPS):
            reads.step = step
            _one_step(sync, w, step, strategy)
            reads.step = None
            if step == NAN_STEPS[-1]:
                # No update was applied yet, so no momentum buffer may exist: one made by a
                # step skipped on the device was never written.
                assert not opt.state, f"{strategy}: state made by a skipped step"
            params.append(_flat(model))
    sync.close()
    return params, opt, reads.steps()


def _one_step(sync: gs.Synchronizer, w: Any, step: int, strategy: str) -> None:
    with sync.step() as s:
        x, y = w.batch(step, 8, 0, 8)
        s.loss = w.loss(sync.model, x, y)
        # zero:3: inject's hooks are on FSDP2's sharded parameters, which the gradient
        # bypasses (it reaches the gathered ones): a NaN loss instead
        nan = step in NAN_STEPS and strategy == "zero:3"
        (s.loss * math.nan if nan else s.loss).backward()


@pytest.mark.parametrize("strategy", ["bsp", "zero:1", "zero:2", "zero:3"])
def test_two_non_finite_first_steps_leave_no_garbage_momentum(
    one_rank: None, strategy: str
) -> None:
    fused, opt, reads = _train(strategy, fused=True)
    plain, _, _ = _train(strategy, fused=False)
    # The host decides until the first applied update (step 2), the device from then on.
    assert reads == {0, 1, 2}
    assert torch.equal(fused[0], fused[1])  # both skipped
    for step in range(STEPS):
        # The fused kernel rounds differently from the per-tensor loop: close, not bitwise.
        assert torch.allclose(fused[step], plain[step], rtol=1e-5, atol=1e-6), step
    for state in opt.state.values():
        assert bool(torch.isfinite(state["momentum_buffer"]).all())


def test_a_load_from_before_the_first_applied_update_goes_back_to_the_host(
    one_rank: None, inline_writer: None, tmp_path: Any
) -> None:
    """A checkpoint saved before any update was applied holds no momentum: after loading it,
    a non-finite step must again be decided on the host (a device skip there would make the
    buffers uninitialised), even though this process had applied updates since."""
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    sync = gs.Synchronizer(model, opt, telemetry=False)
    inject.nan_gradient(sync, rank=0, step=0)
    _one_step(sync, w, 0, "bsp")  # skipped: no state
    sync.save(tmp_path)  # its state: no momentum buffer
    for step in (1, 2):
        _one_step(sync, w, step, "bsp")  # applied: the device decides from here on
    sync.load(tmp_path)
    assert not opt.state
    inject.nan_gradient(sync, rank=0, step=1)
    with host_reads() as reads:
        reads.step = 1
        _one_step(sync, w, 1, "bsp")  # the checkpoint's next step, non-finite
        reads.step = None
    assert not opt.state, "state made by a step skipped on the device after the load"
    assert 1 in reads.steps()  # the host decided it
    sync.close()
