"""The workload contract: a model, a loss, and deterministic global batches sliced per rank."""

from __future__ import annotations

from typing import Protocol

import torch

from gradsync.errors import UsageError

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}") from None


def step_generator(seed: int, step: int) -> torch.Generator:
    """A generator for one step's global batch: the same on every rank, independent of how many
    ranks there are, so any slicing of the global batch sees the same samples."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class Workload(Protocol):
    name: str
    default_lr: float

    def build_model(self) -> torch.nn.Module: ...
    def make_optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer: ...
    def batch(
        self, step: int, global_batch: int, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``start:stop`` of step ``step``'s global batch of ``global_batch`` samples."""
        ...

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


def check_slice(global_batch: int, start: int, stop: int) -> None:
    if not 0 <= start <= stop <= global_batch:
        raise UsageError(f"batch slice {start}:{stop} is outside a global batch of {global_batch}")
