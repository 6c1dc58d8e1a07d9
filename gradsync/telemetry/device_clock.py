"""Step times on a CUDA device: events on the compute stream, read when the records are gathered.

On CUDA the host only queues work: a host clock around the forward and backward passes
measures how long it took to launch their kernels, not to run them, and the optimizer step
that follows finishes on the device long after the host has moved on. The Synchronizer
therefore marks three points of every step on the current stream when the model's parameters
live on a CUDA device: the step's start, the end of the user's block (forward and backward
queued, with the exchanges they started), and the end of the update. ``compute`` is the device
time from the first mark to the second, ``sync`` from the second to the third: what the device
spent on the gradients, then on waiting for the exchange and applying the update.

Nothing waits per step: the events are read when the pending records are turned into rows
(at the periodic gather, a checkpoint or the report), by which time they have long completed
on a busy device. A mark taken while the device is still finishing the previous step
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
    """The three events of one step, and the host seconds of synchronization the user's
    block waited for (``synchronize()`` inside it, a strategy's collectives in the block):
    those count as ``sync``, as on the host clock."""

    start: torch.cuda.Event
    block_end: torch.cuda.Event | None = None
    step_end: torch.cuda.Event | None = None
    in_block_sync: float = 0.0

    def times(self) -> tuple[float, float]:
        """(compute, sync) seconds; waits for the step's last event if it has not completed."""
        assert self.block_end is not None and self.step_end is not None, "a step half marked"
        self.step_end.synchronize()
        block = self.start.elapsed_time(self.block_end) / 1e3
        update = self.block_end.elapsed_time(self.step_end) / 1e3
        in_block = min(self.in_block_sync, block)
        return block - in_block, update + in_block


class DeviceClock:
    """Marks steps on the current stream of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event
