"""The device-specific pieces that can be checked without a GPU: reading step times from
device events, and zero:3's refusal of a model on a GPU over gloo."""

from __future__ import annotations

from typing import Any

import pytest

from gradsync.errors import UsageError
from gradsync.strategies.zero3 import refuse_gloo_off_host
from gradsync.telemetry.device_clock import StepMarks
from gradsync.telemetry.timing import TelemetryCollector

pytestmark = pytest.mark.unit


class _Event:
    """A completed device event at ``ms`` milliseconds."""

    def __init__(self, ms: float) -> None:
        self.ms, self.waited = ms, False

    def synchronize(self) -> None:
        self.waited = True

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
