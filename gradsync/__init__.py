"""gradsync: synchronization for data-parallel PyTorch training.

import gradsync as gs
gs.init()
sync = gs.Synchronizer(model, optimizer, strategy="bsp", bucket_mb=25.0)
for x, y in loader:
    with sync.step():
        loss_fn(model(x), y).backward()
report = sync.report()
"""

from gradsync.balance import ShardBalancer
from gradsync.compression import Compressor, parse_compression
from gradsync.errors import DivergenceError, SyncTimeoutError, UsageError
from gradsync.inject import Slowdown
from gradsync.runtime import init
from gradsync.strategies import (
    BSP,
    DiLoCo,
    LocalSGD,
    ParameterServer,
    Strategy,
    parse_strategy,
)
from gradsync.synchronizer import StepHandle, Synchronizer
from gradsync.telemetry.records import StepRecord
from gradsync.telemetry.report import RankTotals, RunReport

__version__ = "0.1.0"

__all__ = [
    "BSP",
    "Compressor",
    "DiLoCo",
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
    "UsageError",
    "init",
    "parse_compression",
    "parse_strategy",
]
