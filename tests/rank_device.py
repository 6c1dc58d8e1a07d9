"""Run the existing multi-rank tests with their workloads on another device (issue 18).

``GRADSYNC_RANK_DEVICE=cuda python -m pytest -m ranks`` puts every workload model and batch
built inside a rank of a multi-rank group on that device, so the tests' rank functions train
CUDA tensors over gloo (which reduces CUDA tensors through host memory) without each of them
taking a device argument. Everything outside a multi-rank group is left alone: the pytest
process builds its references on the CPU as before, and what the ranks return is loaded onto
the CPU, so the tests compare host tensors as they do on a machine without a GPU.

Unset, or ``cpu``, nothing is patched. Rank functions that build their own ``nn.Module``
instead of a workload stay on the CPU; ``tests/test_gpu.py`` covers the device-specific paths.
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
    """Patch the workloads and the result loading when ``GRADSYNC_RANK_DEVICE`` names a device."""
    device = requested()
    if device is None:
        return
    import torch

    import gradsync.testing
    from gradsync.workloads import charlm, mlp

    for cls in (mlp.TeacherStudentMLP, charlm.CharLM):
        if getattr(cls, "_rank_device_patched", False):
            continue
        build, batch = cls.build_model, cls.batch

        def build_on_device(self: Any, _build: Any = build) -> torch.nn.Module:
            model = _build(self)
            return model.to(device) if _in_multi_rank_group() else model

        def batch_on_device(self: Any, *args: Any, _batch: Any = batch) -> Any:
            x, y = _batch(self, *args)
            if _in_multi_rank_group():
                return x.to(device), y.to(device)
            return x, y

        cls.build_model = build_on_device  # type: ignore[method-assign]
        cls.batch = batch_on_device  # type: ignore[method-assign]
        cls._rank_device_patched = True  # type: ignore[attr-defined]

    def load_on_cpu(data: bytes) -> Any:
        return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")

    gradsync.testing._from_bytes = load_on_cpu  # type: ignore[attr-defined]


def not_on_device(reason: str) -> Any:
    """A skip mark for a multi-rank test that cannot hold on ``GRADSYNC_RANK_DEVICE``'s device
    by design (a strategy that refuses a GPU model, a comparison with a CPU-made reference at
    a tolerance below the device's rounding); ``reason`` says which."""
    import pytest

    return pytest.mark.skipif(requested() is not None, reason=f"{ENV}: {reason}")
