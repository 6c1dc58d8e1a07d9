"""The device-specific pieces that can be checked without a GPU: reading step times from
device events, zero:3's refusal of a model on a GPU over gloo, and the choice of backend."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradsync import runtime
from gradsync.errors import UsageError
from gradsync.runner.config import RunConfig
from gradsync.strategies.zero3 import refuse_gloo_off_host
from gradsync.telemetry.device_clock import StepMarks
from gradsync.telemetry.timing import TelemetryCollector

pytestmark = pytest.mark.unit


class _Event:
    """A completed device event at ``ms`` milliseconds."""

    def __init__(self, ms: float, done: bool = True) -> None:
        self.ms, self.waited, self.done = ms, False, done

    def synchronize(self) -> None:
        self.waited = True

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, later: _Event) -> float:
        return later.ms - self.ms


def _marks(start: float, block_end: float, step_end: float, in_block: float = 0.0) -> Any:
    return StepMarks(_Event(start), _Event(block_end), _Event(step_end), in_block)  # type: ignore[arg-type]


def test_compute_is_the_device_time_of_the_block_and_sync_the_rest_of_the_step() -> None:
    marks = _marks(10.0, 35.0, 41.0)
    compute, sync = marks.times()
    assert compute == pytest.approx(0.025) and sync == pytest.approx(0.006)
    assert marks.step_end.waited  # read only once the step's last event has completed


def test_synchronization_inside_the_block_counts_as_sync_as_on_the_host_clock() -> None:
    compute, sync = _marks(0.0, 30.0, 40.0, in_block=0.012).times()
    assert compute == pytest.approx(0.018) and sync == pytest.approx(0.022)
    # Never more than the block itself: compute stays >= 0.
    compute, sync = _marks(0.0, 5.0, 6.0, in_block=0.5).times()
    assert compute == 0.0 and sync == pytest.approx(0.006)


def test_a_synchronize_in_the_block_counts_its_device_time_as_sync() -> None:
    # On the host, synchronize() also waits for the backward still queued: its host seconds
    # would take the backward out of compute. The events around it give the wait alone.
    marks = _marks(0.0, 30.0, 40.0, in_block=0.001)
    marks.in_block_wait = (_Event(20.0), _Event(26.0))
    compute, sync = marks.times()
    assert compute == pytest.approx(0.023) and sync == pytest.approx(0.017)


def test_completed_device_events_are_read_as_steps_are_added_without_waiting() -> None:
    collector = TelemetryCollector(None, flush_every=1000)  # gathers only at the end
    first, second = _marks(0.0, 10.0, 12.0), _marks(12.0, 20.0, 23.0)
    second.step_end.done = False  # still running on the device
    collector.add(0, 0.0, 0.0, 0.0, 8, 0, None, marks=first)
    collector.add(1, 0.0, 0.0, 0.0, 8, 0, None, marks=second)
    collector.add(2, 0.0, 0.0, 0.0, 8, 0, None)
    assert collector._pending[0].marks is None  # read: its events hold nothing any more
    assert collector._pending[0].compute == pytest.approx(0.010)
    assert collector._pending[1].marks is second and not second.step_end.waited
    second.step_end.done = True
    collector.add(3, 0.0, 0.0, 0.0, 8, 0, None)
    assert collector._pending[1].marks is None
    assert collector._pending[1].sync == pytest.approx(0.003)


def test_pending_records_take_their_times_from_the_device_events_when_turned_into_rows() -> None:
    collector = TelemetryCollector(None, flush_every=10)
    collector.add(0, 100.0, 0.0009, 0.0001, 8, 0, None, marks=_marks(0.0, 20.0, 25.0))
    collector.add(1, 100.1, 0.003, 0.001, 8, 0, None)  # host-timed: kept as given
    rows = collector.pending_rows()
    assert rows[0, 2].item() == pytest.approx(0.020) and rows[0, 3].item() == pytest.approx(0.005)
    assert rows[1, 2].item() == pytest.approx(0.003) and rows[1, 3].item() == pytest.approx(0.001)


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:gloo", "GLOO"])
def test_zero3_refuses_a_model_on_the_gpu_over_gloo(backend: str) -> None:
    with pytest.raises(UsageError, match="zero:3 .* on cuda with a gloo group: use NCCL"):
        refuse_gloo_off_host(backend, "cuda")


@pytest.mark.parametrize(
    ("backend", "device_type"),
    [
        ("gloo", "cpu"),
        ("nccl", "cuda"),
        ("cpu:gloo,cuda:nccl", "cuda"),
        ("cpu:gloo,cuda:nccl", "cpu"),
    ],
)
def test_zero3_takes_what_its_collectives_can_carry(backend: str, device_type: str) -> None:
    refuse_gloo_off_host(backend, device_type)


class _Cuda:
    """What torch reports about CUDA and NCCL on a machine with ``gpus`` GPUs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)


@pytest.mark.parametrize(
    ("gpus", "processes", "expected"),
    [(0, 1, "gloo"), (1, 1, "nccl"), (1, 2, "gloo"), (4, 4, "nccl"), (2, 4, "gloo")],
)
def test_auto_takes_nccl_only_where_every_process_gets_a_gpu(
    monkeypatch: pytest.MonkeyPatch, gpus: int, processes: int, expected: str
) -> None:
    _Cuda(monkeypatch, gpus)
    assert runtime.choose_backend("auto", processes) == expected
    assert runtime.choose_backend("gloo", processes) == "gloo"
    assert runtime.choose_backend("nccl", processes) == "nccl"  # refused later if it cannot


def test_nccl_is_refused_by_name_where_a_process_would_have_no_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _Cuda(monkeypatch, 1)
    runtime.check_nccl(local_rank=0, local_processes=1)
    with pytest.raises(UsageError, match=r"runs 2 process\(es\) and this process sees 1 GPU"):
        runtime.check_nccl(local_rank=1, local_processes=2)
    _Cuda(monkeypatch, 0)
    with pytest.raises(UsageError, match="needs a CUDA device and this process sees none"):
        runtime.check_nccl(local_rank=0, local_processes=1)


def test_init_refuses_nccl_before_making_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    _Cuda(monkeypatch, 1)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not dist.is_initialized()
    with pytest.raises(UsageError, match="one GPU per process"):
        runtime.init(backend="nccl")
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"strategy": "bsp", "nproc": 2}, "nccl"),
        ({"strategy": "bsp", "nproc": 4}, "gloo"),  # more processes than GPUs
        ({"strategy": "async", "nproc": 1}, "gloo"),  # host-memory messages
        ({"strategy": "hogwild", "nproc": 2}, "gloo"),
        ({"strategy": "bsp", "nproc": 2, "hosts": 2}, "gloo"),  # the emulated cluster
    ],
)
def test_gradsync_run_auto_takes_nccl_only_where_the_run_can_use_it(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], expected: str
) -> None:
    _Cuda(monkeypatch, 2)
    config = RunConfig(backend="auto", **options)
    assert config.process_backend(config.nproc) == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"strategy": "async", "nproc": 1}, "parameter servers exchange host memory"),
        ({"strategy": "hogwild", "nproc": 2}, "hogwild shares parameters"),
        ({"strategy": "bsp", "nproc": 2, "hosts": 2}, "emulated cluster"),
        ({"strategy": "bsp", "nproc": 3}, "needs one GPU per process"),
    ],
)
def test_gradsync_run_refuses_nccl_where_it_cannot_carry_the_run(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], message: str
) -> None:
    _Cuda(monkeypatch, 2)
    with pytest.raises(UsageError, match=message):
        RunConfig(backend="nccl", **options)
