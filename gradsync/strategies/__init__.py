"""Strategies: when and what replicas exchange. ``parse_strategy`` turns a spec into one.

``base`` is the protocol (every phase of a step is a member), ``factory`` maps spec strings to
the concrete strategies: ``bsp``, ``zero`` (zero:1, zero:2; ``zero_shards`` their ownership
and sharded update), ``local_sgd`` (local:H, diloco:H), the parameter server (``ps`` the
worker role and the strategy, ``ps_server`` the server role, ``ps_wire`` what they share) and
``hogwild`` (lock-free updates of parameters shared in memory on one host).
"""

from gradsync.strategies.base import (
    STRATEGY_FORMS,
    Layout,
    ServerRole,
    StepOutcome,
    StepPlan,
    Strategy,
    StrategySpec,
    SyncContext,
    clip_grad_norm,
    parse_strategy_spec,
)
from gradsync.strategies.bsp import BSP
from gradsync.strategies.factory import parse_strategy, uses_servers
from gradsync.strategies.hogwild import Hogwild, HogwildStats
from gradsync.strategies.local_sgd import DiLoCo, LocalSGD
from gradsync.strategies.ps import ParameterServer, ServerStats
from gradsync.strategies.zero import ZeroStage1, ZeroStage2

__all__ = [
    "STRATEGY_FORMS",
    "Layout",
    "ServerRole",
    "StepOutcome",
    "StepPlan",
    "Strategy",
    "StrategySpec",
    "SyncContext",
    "clip_grad_norm",
    "parse_strategy",
    "parse_strategy_spec",
    "uses_servers",
    "BSP",
    "DiLoCo",
    "Hogwild",
    "HogwildStats",
    "LocalSGD",
    "ParameterServer",
    "ServerStats",
    "ZeroStage1",
    "ZeroStage2",
]
