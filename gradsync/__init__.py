"""gradsync: synchronization for data-parallel PyTorch training.

import gradsync as gs
gs.init()
sync = gs.Synchronizer(model, optimizer, strategy="bsp")
for x, y in loader:
    with sync.step():
        loss_fn(model(x), y).backward()
report = sync.report()
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

# Only the errors are imported eagerly. Every other public name is loaded on first use
# (PEP 562), so that torch-free parts such as ``gradsync.sim`` (pure Python and numpy) can be
# imported, and ``gradsync simulate`` run, on a machine without torch.
from gradsync import logs as _logs  # noqa: F401 - the gradsync logger's handler and level
from gradsync.errors import DivergenceError, SyncTimeoutError, UsageError

if TYPE_CHECKING:  # the static view of the lazy names below, for mypy and editors
    from gradsync.balance import ShardBalancer
    from gradsync.compression import Compressor, parse_compression
    from gradsync.ddp import DistributedDataParallel
    from gradsync.inject import Slowdown
    from gradsync.lr import scaled_lr, warmup
    from gradsync.options import Checks, Exchange, Limits, Telemetry
    from gradsync.runtime import init, is_main, rank, world_size
    from gradsync.strategies import (
        BSP,
        DiLoCo,
        LocalSGD,
        ParameterServer,
        Strategy,
        ZeroStage1,
        ZeroStage2,
        parse_strategy,
    )
    from gradsync.synchronizer import StepHandle, Synchronizer
    from gradsync.telemetry.records import StepRecord
    from gradsync.telemetry.report import RankTotals, RunReport
    from gradsync.telemetry.trackers import make_tracker

__version__ = "0.1.0"

_LAZY = {
    "BSP": "gradsync.strategies",
    "Checks": "gradsync.options",
    "Exchange": "gradsync.options",
    "Limits": "gradsync.options",
    "Telemetry": "gradsync.options",
    "Compressor": "gradsync.compression",
    "DiLoCo": "gradsync.strategies",
    "DistributedDataParallel": "gradsync.ddp",
    "LocalSGD": "gradsync.strategies",
    "ParameterServer": "gradsync.strategies",
    "RankTotals": "gradsync.telemetry.report",
    "RunReport": "gradsync.telemetry.report",
    "ShardBalancer": "gradsync.balance",
    "Slowdown": "gradsync.inject",
    "StepHandle": "gradsync.synchronizer",
    "StepRecord": "gradsync.telemetry.records",
    "Strategy": "gradsync.strategies",
    "Synchronizer": "gradsync.synchronizer",
    "init": "gradsync.runtime",
    "is_main": "gradsync.runtime",
    "make_tracker": "gradsync.telemetry.trackers",
    "parse_compression": "gradsync.compression",
    "parse_strategy": "gradsync.strategies",
    "rank": "gradsync.runtime",
    "scaled_lr": "gradsync.lr",
    "warmup": "gradsync.lr",
    "world_size": "gradsync.runtime",
    "ZeroStage1": "gradsync.strategies",
    "ZeroStage2": "gradsync.strategies",
}

__all__ = [
    "BSP",
    "Checks",
    "Compressor",
    "DiLoCo",
    "DistributedDataParallel",
    "Exchange",
    "Limits",
    "LocalSGD",
    "ParameterServer",
    "ShardBalancer",
    "DivergenceError",
    "RankTotals",
    "RunReport",
    "Slowdown",
    "StepHandle",
    "StepRecord",
    "Strategy",
    "SyncTimeoutError",
    "Synchronizer",
    "Telemetry",
    "UsageError",
    "ZeroStage1",
    "ZeroStage2",
    "init",
    "is_main",
    "make_tracker",
    "parse_compression",
    "parse_strategy",
    "rank",
    "scaled_lr",
    "warmup",
    "world_size",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # A subpackage or module (``gradsync.compression.ddp_comm_hook`` after a plain
        # ``import gradsync``): loaded on first use like the names above.
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module 'gradsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
