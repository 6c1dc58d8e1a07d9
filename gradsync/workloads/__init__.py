"""Small real training jobs that ship with the package: ``charlm`` and ``mlp``."""

from __future__ import annotations

import os

from gradsync.errors import UsageError
from gradsync.workloads.base import Workload
from gradsync.workloads.charlm import CharLM
from gradsync.workloads.data import VOCAB
from gradsync.workloads.mlp import IN_DIM, OUT_DIM, TeacherStudentMLP, hidden_for

WORKLOADS = ("charlm", "mlp")
#: the workloads whose model ``--params`` sizes (charlm's size is its own, fixed)
SIZED_BY_PARAMS = ("mlp",)

__all__ = [
    "SIZED_BY_PARAMS",
    "WORKLOADS",
    "CharLM",
    "TeacherStudentMLP",
    "Workload",
    "make_workload",
    "physical_memory",
    "step_bytes",
]


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


def step_bytes(name: str, params: int, batch: int, global_batch: int) -> int:
    """A lower bound of the memory one worker's step takes for a built-in workload's batch
    (float32): the activations backward keeps, and for ``mlp`` the global batch's inputs, which
    every worker draws whole before taking its slice (see ``TeacherStudentMLP.batch``)."""
    if name == "mlp":
        h = hidden_for(params)
        # Per sample: the input, both hidden layers before and after tanh, the output.
        return 4 * (batch * (IN_DIM + 4 * h + OUT_DIM) + global_batch * IN_DIM)
    if name == "charlm":
        c = CharLM.__init__.__kwdefaults__ or {}
        context, dim, layers = c["context"], c["dim"], c["layers"]
        # Per token, each block keeps at least 16 x dim values (norms, qkv, attention
        # output, projection, the 4 x dim MLP before and after GELU); the head, logits.
        return 4 * batch * context * (layers * 16 * dim + 2 * VOCAB)
    raise UsageError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
