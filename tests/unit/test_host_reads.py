"""No host read of step data in the steady-state step where the optimizer takes the non-finite
verdict on the device (issue 44): on the CPU through spies on the tensor members that hand
values to the host (``tests/support/host_reads.py``); on a GPU through CUDA's sync debug mode in
``test_host_reads_cuda.py``.
The periodic telemetry gather reads, once per ``telemetry_every`` steps and in a few copies
whatever the number of steps, and the divergence check compares there the fingerprints it
posted a period before: that is where the batched reads belong."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import gradsync as gs
from gradsync import inject
from gradsync.checks.guards import all_finite, nonfinite_flag, poison_nonfinite_, zero_if_
from gradsync.workloads import make_workload
from tests.support.host_reads import HostReads, host_reads
from tests.support.ranks import flat_params

pytestmark = pytest.mark.unit

#: the strategies whose update is the user's optimizer (zero:2 and zero:3: each rank's shard
#: of it, gated by the all-reduced flag, a world of one here)
STRATEGIES = ["bsp", "zero:1", "zero:2", "zero:3", "local:2", "diloco:2"]
WARMUP, STEPS, EVERY = 2, 12, 5


def _fused(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


@dataclass
class _Run:
    reads: HostReads
    handles: list[gs.StepHandle]
    params: list[torch.Tensor]
    report: gs.RunReport


def _train(
    strategy: str,
    optimizer: str,
    nan_at: int | None = None,
    telemetry: bool = True,
    scaler: torch.amp.GradScaler | None = None,
    compression: str = "none",
) -> _Run:
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = (
        _fused(optimizer, model)
        if optimizer != "plain"
        else torch.optim.SGD(model.parameters(), lr=0.05)
    )
    sync = gs.Synchronizer(
        model,
        opt,
        strategy=strategy,
        telemetry=telemetry,
        telemetry_every=EVERY,
        check_every=EVERY,
        scaler=scaler,
        compression=compression,
    )
    if nan_at is not None and strategy != "zero:3":
        inject.nan_gradient(sync, rank=0, step=nan_at)
    handles, params = [], []
    with host_reads() as reads:
        for step in range(STEPS):
            reads.step = step if step >= WARMUP else None
            with sync.step() as s:
                x, y = w.batch(step, 8, 0, 8)
                s.loss = w.loss(model, x, y)
                # zero:3: inject's hooks are on FSDP2's sharded parameters, which the
                # gradient bypasses (it reaches the gathered ones): a NaN loss instead
                nan = step == nan_at and strategy == "zero:3"
                loss = s.loss * math.nan if nan else s.loss
                (loss if scaler is None else scaler.scale(loss)).backward()
            reads.step = None
            handles.append(s)
            params.append(flat_params(model))
    report = sync.report()
    sync.close()
    return _Run(reads, handles, params, report)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_steady_state_step_reads_nothing_on_the_host(
    one_rank: None, strategy: str, optimizer: str
) -> None:
    reads = _train(strategy, optimizer).reads
    gathers = {s for s in range(STEPS) if (s + 1) % EVERY == 0}
    assert reads.steps() <= gathers, reads.describe()
    for step in gathers:
        # A few copies, not one per step: the verdicts, the losses and the records; and the
        # comparison of the fingerprints the check posted a period before (already on the
        # host by then: on CUDA in pinned memory, behind an event that has completed).
        assert len(reads.at(step)) <= 6, reads.describe()


@pytest.mark.parametrize("strategy", ["bsp", "zero:2"])
@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_the_front_door_step_reads_nothing_on_the_host(
    one_rank: None, skip_nonfinite: bool, strategy: str
) -> None:
    """zero:2: the front door shows its shards as DTensors without asking the verdict where it
    stays on the device (a skipped step keeps them there)."""
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = _fused("adamw", model)
    ddp = gs.DistributedDataParallel(
        model,
        optimizer=opt,
        strategy=strategy,
        skip_nonfinite=skip_nonfinite,
        telemetry_every=EVERY,
    )
    with host_reads() as reads:
        for step in range(STEPS):
            reads.step = step if step >= WARMUP else None
            x, y = w.batch(step, 8, 0, 8)
            w.loss(ddp, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            reads.step = None
    ddp.close()
    gathers = {s for s in range(STEPS) if (s + 1) % EVERY == 0}
    assert reads.steps() <= gathers, reads.describe()


def test_the_front_door_under_zero2_skips_a_non_finite_step_on_the_device(one_rank: None) -> None:
    """The shards shown without asking the verdict: a NaN step's update is still skipped (the
    fused optimizer on the agreed flag), reported, and training goes on."""
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = _fused("adamw", model)
    ddp = gs.DistributedDataParallel(model, optimizer=opt, strategy="zero:2", skip_nonfinite=True)
    nan_at = 6
    inject.nan_gradient(ddp.sync, rank=0, step=nan_at)
    params = []
    for step in range(10):
        x, y = w.batch(step, 8, 0, 8)
        w.loss(ddp, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # through the DTensor view
        opt.step()
        opt.zero_grad(set_to_none=True)
        params.append(flat_params(model))
    report = ddp.report()
    ddp.close()
    assert torch.equal(params[nan_at - 1], params[nan_at])
    assert not torch.equal(params[nan_at], params[nan_at + 1])
    assert bool(torch.isfinite(params[-1]).all())
    assert report.skipped_steps == 1


def test_the_divergence_check_posts_without_reading_and_compares_a_period_later(
    one_rank: None,
) -> None:
    """Without telemetry: the check after step 4 only posts; after step 9 it compares step 4's
    fingerprints (and posts step 9's). The verdicts, on the device from step 1, are read ten
    at a time: after step 10."""
    reads = _train("bsp", "adamw", telemetry=False).reads
    assert reads.at(4) == [], reads.describe()
    assert reads.steps() <= {9, 10}, reads.describe()
    assert all(r.where.startswith("gradsync/checks/verdicts.py") for r in reads.at(10))


def test_a_plain_optimizer_reads_its_verdict_on_the_host_every_step(one_rank: None) -> None:
    """The spies' own check: without a fused optimizer the guard must read every step."""
    reads = _train("bsp", "plain").reads
    assert reads.steps() == set(range(WARMUP, STEPS))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_non_finite_step_is_skipped_on_the_device_and_reported(
    one_rank: None, strategy: str
) -> None:
    nan_at = 6
    run = _train(strategy, "adamw", nan_at=nan_at)
    params, handles = run.params, run.handles
    assert torch.equal(params[nan_at - 1], params[nan_at])  # the update really was skipped
    assert not torch.equal(params[nan_at], params[nan_at + 1])  # and training went on
    assert bool(torch.isfinite(params[-1]).all())
    assert [s.step for s in handles if s.skipped] == [nan_at]
    report = run.report
    assert report.skipped_steps == 1
    assert [r.step for r in report.records if r.skipped] == [nan_at]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_grad_scaler_with_a_fused_optimizer_reads_nothing_and_still_skips(
    one_rank: None, strategy: str
) -> None:
    """The GradScaler hands the fused optimizer its found_inf on the device; gradsync takes the
    verdict from that same count, not from get_scale() before and after (two .item()): the
    steady state reads nothing between gathers, and a NaN step is skipped, reported and
    backs the scale off."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    nan_at = 6
    run = _train(strategy, "adamw", nan_at=nan_at, scaler=scaler)
    gathers = {s for s in range(STEPS) if (s + 1) % EVERY == 0}
    assert run.reads.steps() <= gathers, run.reads.describe()
    assert torch.equal(run.params[nan_at - 1], run.params[nan_at])
    assert not torch.equal(run.params[nan_at], run.params[nan_at + 1])
    assert [s.step for s in run.handles if s.skipped] == [nan_at]
    assert [r.step for r in run.report.records if r.skipped] == [nan_at]
    assert scaler.get_scale() == 2.0**9  # backed off once


@pytest.mark.parametrize("compression", ["int8", "int4", "powersgd:2"])
def test_a_compressed_exchange_scrubs_its_state_on_the_device(
    one_rank: None, compression: str
) -> None:
    """int8 keeps no tensor between steps and int4's error-feedback residuals restart at zero,
    so after a NaN step they are zeroed on the device where the flag is set (a NaN residual
    left there would be added into every later gradient: every later step skipped). PowerSGD's
    warm starts are drawn afresh when dropped, which zero cannot stand for: once it keeps them
    (after its start_iter=10 plain calls) it is still the host's check, every step."""
    nan_at = 6
    run = _train("bsp", "adamw", nan_at=nan_at, compression=compression)
    gathers = {s for s in range(STEPS) if (s + 1) % EVERY == 0}
    if compression.startswith("powersgd"):
        assert set(range(10, STEPS)) <= run.reads.steps(), run.reads.describe()
    else:
        assert run.reads.steps() <= gathers, run.reads.describe()
    assert torch.equal(run.params[nan_at - 1], run.params[nan_at])
    assert not torch.equal(run.params[nan_at + 1], run.params[nan_at + 2])  # not poisoned
    assert bool(torch.isfinite(run.params[-1]).all())
    assert [s.step for s in run.handles if s.skipped] == [nan_at]
    assert [r.step for r in run.report.records if r.skipped] == [nan_at]


def test_the_device_flag_agrees_with_the_host_check() -> None:
    big = torch.full((4,), 3e38)  # finite values whose float32 sum overflows
    cases = [
        [torch.ones(3)],
        [big],
        [torch.full((4,), 1e308, dtype=torch.float64)],  # float64: checked element by element
        [torch.ones(2), torch.tensor([1.0, float("nan")])],
        [torch.tensor([float("-inf")], dtype=torch.bfloat16)],
        [torch.tensor([1 + 1j, complex(0, float("inf"))])],
        [torch.ones(2, dtype=torch.float64), torch.tensor([float("inf")], dtype=torch.float64)],
        [torch.empty(0), torch.ones(2)],  # an empty tensor holds nothing non-finite
        [torch.empty(0), torch.tensor([float("nan")], dtype=torch.float16)],
        [torch.empty(0)],
        [torch.tensor([2.0, float("-inf"), 1.0])],  # the least element alone is not finite
        [torch.full((3,), -3e38), torch.full((3,), 65504.0, dtype=torch.float16)],
    ]
    for tensors in cases:
        assert float(nonfinite_flag(tensors)) == (0.0 if all_finite(tensors) else 1.0), tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_a_finite_bucket_is_left_bit_for_bit_and_a_non_finite_one_turns_all_nan(
    dtype: torch.dtype,
) -> None:
    """The poisoning before a compressed exchange: a multiply by 1.0 must change no finite
    value's bits (-0.0, the smallest subnormal, the largest finite), and one NaN or Inf must
    reach every element, with no host read."""
    info = torch.finfo(dtype)
    finite = torch.tensor(
        [-0.0, 0.0, info.smallest_normal / 4, -info.max, info.max, 1.5], dtype=dtype
    )
    assert bool(torch.isfinite(finite).all()) and float(finite[2]) != 0.0  # a subnormal
    buf = finite.clone()
    poison_nonfinite_(buf)
    assert torch.equal(buf.view(-1).view(torch.uint8), finite.view(-1).view(torch.uint8))
    for bad in (float("nan"), float("inf"), float("-inf")):
        buf = finite.clone()
        buf[2] = bad
        poison_nonfinite_(buf)
        assert bool(torch.isnan(buf).all()), (dtype, bad, buf)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return (torch.view_as_real(x) if x.is_complex() else x).contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64]
)
def test_zeroing_a_state_tensor_on_the_device_is_all_or_nothing_bit_for_bit(
    dtype: torch.dtype,
) -> None:
    """A residual of a skipped step is zeroed (+0.0 everywhere, as a dropped one restarts), and
    one of a step that was not is left bit for bit, NaN and -0.0 included."""
    t = torch.tensor([-0.0, float("nan"), float("-inf"), 1.5, -2.0]).to(dtype)
    kept = t.clone()
    zero_if_(t, torch.tensor(False))
    assert torch.equal(_bits(t), _bits(kept))
    zero_if_(t, torch.tensor(True))
    assert torch.equal(_bits(t), torch.zeros_like(_bits(t)))
