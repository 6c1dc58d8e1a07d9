"""Small real training jobs that ship with the package: ``charlm`` and ``mlp``."""

from __future__ import annotations

from gradsync.errors import UsageError
from gradsync.workloads.base import Workload
from gradsync.workloads.charlm import CharLM
from gradsync.workloads.mlp import TeacherStudentMLP

WORKLOADS = ("charlm", "mlp")

__all__ = ["WORKLOADS", "CharLM", "TeacherStudentMLP", "Workload", "make_workload"]


def make_workload(
    name: str,
    *,
    seed: int = 0,
    data: str | None = None,
    params: int | None = None,
    dtype: str = "float32",
) -> Workload:
    if name == "charlm":
        return CharLM(seed=seed, data=data, dtype=dtype)
    if name == "mlp":
        return TeacherStudentMLP(seed=seed, params=params or 100_000, dtype=dtype)
    raise UsageError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
