"""Step times on a CUDA device: events on the compute stream, read when the records are gathered.

On CUDA the host only queues work: a host clock around the forward and backward passes
measures how long it took to launch their kernels, not to run them, and the optimizer step
that follows finishes on the device long after the host has moved on. The Synchronizer
therefore marks three points of every step on the current stream when the model's parameters
live on a CUDA device: the step's start, the end of the user's block (forward and backward
queued, with the exchanges they started), and the end of the update. ``compute`` is the device
time from the first mark to the second, ``sync`` from the second to the third: what the device
spent on the gradients, then on waiting for the exchange and applying the update.

No step waits for them: a record's events are read once they have completed (checked without
waiting as later steps are added), or when the pending records are turned into rows (the
periodic gather, a checkpoint, the report), which then waits for the newest step's work on the
device: once every ``telemetry_every`` steps. A mark taken while the device is still
finishing the previous step
completes only once that work is done, so each step's times start where the previous step's
work ends, and a device kept waiting for the host (a small model) shows the host's gaps as
time too: the device was not busy, but the step took that long.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cuda_device_of(params: list[torch.Tensor]) -> torch.device | None:
    """The CUDA device the parameters live on, or None (CPU, meta, or no parameters)."""
    for p in params:
        if p.is_cuda:
            return p.device
    return None


@dataclass(slots=True)
class StepMarks:
    """The three events of one step, and the synchronization the user's block waited for,
    which counts as ``sync``, as on the host clock: ``synchronize()`` inside the block as the
    pair of events around it (on the host, that wait also covers the backward still queued on
    the device), and host seconds for the rest (a strategy's collectives in the block)."""

    start: torch.cuda.Event
    block_end: torch.cuda.Event | None = None
    step_end: torch.cuda.Event | None = None
    in_block_sync: float = 0.0
    in_block_wait: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def done(self) -> bool:
        """Whether the step's last event has completed (reading the times will not wait)."""
        return self.step_end is not None and bool(self.step_end.query())

    def times(self) -> tuple[float, float]:
        """(compute, sync) seconds; waits for the step's last event if it has not completed."""
        assert self.block_end is not None and self.step_end is not None, "a step half marked"
        self.step_end.synchronize()
        block = self.start.elapsed_time(self.block_end) / 1e3
        update = self.block_end.elapsed_time(self.step_end) / 1e3
        in_block = self.in_block_sync
        if self.in_block_wait is not None:
            first, last = self.in_block_wait
            in_block += first.elapsed_time(last) / 1e3
        in_block = min(in_block, block)
        return block - in_block, update + in_block


class DeviceClock:
    """Marks steps on the current stream of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event
