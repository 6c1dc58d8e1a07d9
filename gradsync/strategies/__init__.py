"""Strategies: when and what replicas exchange. ``parse_strategy`` turns a spec into one."""

from gradsync.strategies.base import (
    STRATEGY_FORMS,
    StepOutcome,
    Strategy,
    StrategySpec,
    SyncContext,
    parse_strategy,
    parse_strategy_spec,
)

__all__ = [
    "STRATEGY_FORMS",
    "StepOutcome",
    "Strategy",
    "StrategySpec",
    "SyncContext",
    "parse_strategy",
    "parse_strategy_spec",
]
