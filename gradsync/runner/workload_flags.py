"""The flags of ``gradsync run`` that set what the built-in workloads train, which a user's
script sets itself: a module of their own, torch-free, so that the command line
(``runner.cli``, which imports torch only to run) and the run's config (``runner.config``)
name one list."""

from __future__ import annotations

#: flags that set what the built-in workloads train, which a user's script sets itself
WORKLOAD_ONLY = (
    "workload",
    "steps",
    "batch_size",
    "lr",
    "micro_batches",
    "seed",
    "data",
    "params",
    "bucket_mb",
    "allreduce",
    "balance",
    "check_every",
    "checkpoint_every",
    "keep_checkpoints",
)

__all__ = ["WORKLOAD_ONLY"]
