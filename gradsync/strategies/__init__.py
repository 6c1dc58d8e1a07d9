"""Strategies: when and what replicas exchange. ``parse_strategy`` turns a spec into one."""

from gradsync.strategies.base import (
    STRATEGY_FORMS,
    StepOutcome,
    Strategy,
    StrategySpec,
    SyncContext,
    parse_strategy,
    parse_strategy_spec,
    uses_servers,
)
from gradsync.strategies.bsp import BSP
from gradsync.strategies.local_sgd import DiLoCo, LocalSGD
from gradsync.strategies.ps import ParameterServer, ServerStats

__all__ = [
    "STRATEGY_FORMS",
    "StepOutcome",
    "Strategy",
    "StrategySpec",
    "SyncContext",
    "parse_strategy",
    "parse_strategy_spec",
    "uses_servers",
    "BSP",
    "DiLoCo",
    "LocalSGD",
    "ParameterServer",
    "ServerStats",
]
