import pytest

import gradsync as gs

pytestmark = pytest.mark.unit

FROZEN_API = {
    "BSP",
    "Checks",
    "Exchange",
    "Limits",
    "Telemetry",
    "Compressor",
    "DiLoCo",
    "DistributedDataParallel",
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
    "is_main",
    "make_tracker",
    "parse_compression",
    "parse_strategy",
    "rank",
    "scaled_lr",
    "warmup",
    "world_size",
}


def test_public_api_is_frozen() -> None:
    """Removing or renaming a public name breaks users: extend this set, never shrink it."""
    assert set(gs.__all__) >= FROZEN_API
    for name in gs.__all__:
        assert hasattr(gs, name), name
