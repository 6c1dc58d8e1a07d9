"""Run the existing multi-rank tests with their workloads on another device (issue 18).

``GRADSYNC_RANK_DEVICE=cuda python -m pytest -m ranks`` puts every workload model and batch
built inside a rank of a multi-rank group on that device, so the tests' rank functions train
CUDA tensors over gloo (which reduces CUDA tensors through host memory) without each of them
taking a device argument. Everything outside a multi-rank group is left alone: the pytest
process builds its references on the CPU as before, and what the ranks return is loaded onto
the CPU, so the tests compare host tensors as they do on a machine without a GPU.

Unset, or ``cpu``, everything does what it did. Rank functions that build their own ``nn.Module``
instead of a workload stay on the CPU; ``tests/ranks/test_gpu_ranks.py`` and
``tests/e2e/test_gpu.py`` cover the device-specific paths.
"""

from __future__ import annotations

import io
import os
from typing import Any

ENV = "GRADSYNC_RANK_DEVICE"


def requested() -> str | None:
    device = os.environ.get(ENV, "").strip()
    return None if device in ("", "cpu") else device


def _in_multi_rank_group() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1


def install() -> None:
    """Wrap the workloads' ``build_model`` and ``batch``, and the loading of what ranks return,
    so that each follows ``GRADSYNC_RANK_DEVICE`` as it is when called, not when imported: a
    rank forked from the forkserver imports the tests with the server's environment, and takes
    its caller's only afterwards (``gradsync.testing``). Unset, each does what it did."""
    import torch

    import gradsync.testing
    from gradsync.workloads import charlm, mlp

    def target() -> str | None:
        return requested() if _in_multi_rank_group() else None

    for cls in (mlp.TeacherStudentMLP, charlm.CharLM):
        if getattr(cls, "_rank_device_wrapped", False):
            continue
        build, batch = cls.build_model, cls.batch

        def build_on_device(self: Any, _build: Any = build) -> torch.nn.Module:
            model, device = _build(self), target()
            return model if device is None else model.to(device)

        def batch_on_device(self: Any, *args: Any, _batch: Any = batch, **kwargs: Any) -> Any:
            (x, y), device = _batch(self, *args, **kwargs), target()
            return (x, y) if device is None else (x.to(device), y.to(device))

        cls.build_model = build_on_device  # type: ignore[method-assign]
        cls.batch = batch_on_device  # type: ignore[method-assign]
        cls._rank_device_wrapped = True  # type: ignore[attr-defined]

    load = gradsync.testing._from_bytes

    def load_on_cpu(data: bytes) -> Any:
        if requested() is None:
            return load(data)
        return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")

    gradsync.testing._from_bytes = load_on_cpu  # type: ignore[attr-defined]


def not_on_device(reason: str) -> Any:
    """A skip mark for a multi-rank test that cannot hold on ``GRADSYNC_RANK_DEVICE``'s device
    by design (a strategy that refuses a GPU model, a comparison with a CPU-made reference at
    a tolerance below the device's rounding); ``reason`` says which."""
    import pytest

    return pytest.mark.skipif(requested() is not None, reason=f"{ENV}: {reason}")
