"""One NCCL rank on the GPU, and steps run under CUDA's sync debug mode: shared by the host-read
test of every strategy (tests/unit/test_host_reads_cuda.py) and the compressed steps of
tests/e2e/test_gpu_compiled.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import gradsync as gs


@contextlib.contextmanager
def one_nccl_rank() -> Iterator[None]:
    """A world of one over NCCL for the block (the one already up where it is NCCL's); the
    sync debug mode off again after it."""
    if dist.is_initialized() and dist.get_backend() != "nccl":
        pytest.skip("a non-NCCL default group is up in this process (another module's)")
    made = not dist.is_initialized()
    if made:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
        if made:
            dist.destroy_process_group()


def steps_that_never_wait(
    sync: gs.Synchronizer, workload: Any, model: torch.nn.Module, steps: int, warmup: int
) -> None:
    """``steps`` steps of ``workload`` on the GPU, each after the first ``warmup`` with CUDA's
    sync debug mode raising at any call that waits for the device."""
    batches = [tuple(t.cuda() for t in workload.batch(step, 8, 0, 8)) for step in range(steps)]
    for step, (x, y) in enumerate(batches):
        torch.cuda.set_sync_debug_mode("error" if step >= warmup else 0)
        try:
            with sync.step() as s:
                s.loss = workload.loss(model, x, y)
                s.loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
