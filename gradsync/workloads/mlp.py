"""``mlp``: synthetic teacher-student regression whose size is set by ``--params``.

A fixed random teacher network labels Gaussian inputs; the student (same input and output
sizes, a hidden width chosen to hit the requested parameter count) learns to imitate it. The
data are generated from the seed and the step, so there is nothing to load.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.errors import UsageError
from gradsync.workloads.base import check_slice, parse_dtype, step_generator

IN_DIM, OUT_DIM, TEACHER_HIDDEN = 64, 16, 32


def hidden_for(params: int) -> int:
    """Width h of the student ``IN -> h -> h -> OUT`` closest to ``params`` parameters:
    h^2 + (IN + OUT + 2) h + OUT = params."""
    b = IN_DIM + OUT_DIM + 2
    return max(1, round((-b + math.sqrt(b * b + 4 * max(params - OUT_DIM, 0))) / 2))


def parameter_count(params: int) -> int:
    """Exact parameter count of the student built for ``--params``."""
    h = hidden_for(params)
    return h * h + (IN_DIM + OUT_DIM + 2) * h + OUT_DIM


class TeacherStudentMLP:
    name = "mlp"
    default_lr = 0.05

    def __init__(self, *, seed: int = 0, params: int = 100_000, dtype: str = "float32") -> None:
        if params < 1000:
            raise UsageError(f"--params must be at least 1000, got {params}")
        self.seed = seed
        self.dtype = parse_dtype(dtype)
        self.hidden = hidden_for(params)
        g = torch.Generator().manual_seed(seed + 7919)
        self.w1 = torch.randn(IN_DIM, TEACHER_HIDDEN, generator=g, dtype=self.dtype) / 8.0
        self.w2 = torch.randn(TEACHER_HIDDEN, OUT_DIM, generator=g, dtype=self.dtype) / 4.0

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        h = self.hidden
        model = nn.Sequential(
            nn.Linear(IN_DIM, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, OUT_DIM)
        )
        return model.to(self.dtype)

    def make_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def batch(
        self, step: int, global_batch: int, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_slice(global_batch, start, stop)
        g = step_generator(self.seed, step)
        x = torch.randn(global_batch, IN_DIM, generator=g, dtype=self.dtype)[start:stop]
        y = torch.tanh(x @ self.w1) @ self.w2
        return x, y

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)
