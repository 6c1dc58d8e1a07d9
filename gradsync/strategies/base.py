"""The strategy protocol and the spec strings shared by the API and the CLI.

A strategy decides when and what replicas exchange. The ``Synchronizer`` owns the step loop and
telemetry; it calls ``begin_step`` before the user's block runs and ``finish_step`` after it
exits, and ``finish_step`` returns once the update has been applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gradsync.compression.base import Compressor
from gradsync.errors import UsageError
from gradsync.telemetry.records import Span

STRATEGY_FORMS = (
    "bsp, local:H, diloco:H, ssp:S, async (H an integer >= 1, S an integer >= 0 or inf)"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategySpec:
    kind: str
    period: int | None = None  # H for local/diloco
    staleness: float | None = None  # S for ssp (inf for async)

    def __str__(self) -> str:
        if self.kind in ("local", "diloco"):
            return f"{self.kind}:{self.period}"
        if self.kind == "ssp":
            s = self.staleness
            return "ssp:inf" if s is not None and math.isinf(s) else f"ssp:{int(s or 0)}"
        return self.kind


def parse_strategy_spec(spec: str) -> StrategySpec:
    """Parse ``bsp``, ``local:H``, ``diloco:H``, ``ssp:S`` or ``async`` (else ``ValueError``)."""
    if not isinstance(spec, str):
        raise UsageError(f"strategy must be a spec string or a Strategy, got {type(spec).__name__}")
    text = spec.strip().lower()
    kind, _, arg = text.partition(":")
    if kind in ("bsp", "async") and not arg:
        return StrategySpec(kind=kind)
    if kind in ("local", "diloco") and arg:
        try:
            period = int(arg)
        except ValueError:
            period = 0
        if period >= 1:
            return StrategySpec(kind=kind, period=period)
        raise UsageError(f"strategy {spec!r}: H must be an integer >= 1; valid: {STRATEGY_FORMS}")
    if kind == "ssp" and arg:
        if arg == "inf":
            return StrategySpec(kind="ssp", staleness=math.inf)
        try:
            bound = int(arg)
        except ValueError:
            bound = -1
        if bound >= 0:
            return StrategySpec(kind="ssp", staleness=float(bound))
        raise UsageError(
            f"strategy {spec!r}: S must be an integer >= 0 or inf; valid: {STRATEGY_FORMS}"
        )
    raise UsageError(f"unknown strategy {spec!r}; valid: {STRATEGY_FORMS}")


@dataclass(slots=True)
class StepOutcome:
    """What a strategy reports about one step, for telemetry."""

    bytes_sent: int = 0
    skipped: bool = False
    #: whether the step ended at a barrier with the other ranks (see telemetry.records)
    barrier: bool = True
    #: measured wait imposed by others, for steps without a barrier (SSP's bound)
    idle: float = 0.0
    spans: list[Span] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class SyncContext:
    """The runtime objects a strategy works on (config lives in the strategy itself)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    group: dist.ProcessGroup | None
    compressor: Compressor
    bucket_mb: float
    record_spans: bool = False
    #: skip (on every rank together) a step whose mean gradient is not finite
    skip_nonfinite: bool = True
    #: turns a failed wait into an error naming the ranks that never arrived
    watch: Any = None


@runtime_checkable
class Strategy(Protocol):
    name: str
    #: True when ranks must not be made to wait for each other outside the strategy's own
    #: exchanges (asynchronous strategies): telemetry then gathers only at the end.
    barrier_free: bool

    def setup(self, ctx: SyncContext) -> None: ...
    def begin_step(self, step: int, micro_batches: int) -> None: ...
    def finish_step(self, step: int) -> StepOutcome: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...
    def replicas_identical(self, step: int, final: bool) -> bool:
        """Whether replicas must match after ``step`` (the same answer on every rank)."""
        ...


def compressor_state_dict(state: Any) -> dict[str, Any]:
    """The ``{"compressor": ...}`` part of a strategy's state dict (residuals, factors)."""
    return {"compressor": state.state_dict() if state is not None else {}}


def load_compressor_state(state: Any, saved: dict[str, Any]) -> None:
    if state is not None:
        state.load_state_dict(saved.get("compressor", {}))


def parse_strategy(spec: str | Strategy, *, servers: int = 1, timeout_s: float = 300.0) -> Strategy:
    """A ``Strategy`` from a spec string (or the object itself, passed through).

    ``servers`` and ``timeout_s`` apply to the parameter-server strategies (``ssp:S``, ``async``);
    ``servers`` other than 1 with another strategy is refused rather than ignored.
    """
    if servers != 1 and not uses_servers(spec):
        name = spec if isinstance(spec, str) else getattr(spec, "name", type(spec).__name__)
        raise UsageError(
            f"servers={servers} is for the parameter-server strategies (ssp:S, async); "
            f"strategy {name} runs no servers"
        )
    if isinstance(spec, Strategy):
        return spec
    parsed = parse_strategy_spec(spec)
    if parsed.kind == "bsp":
        from gradsync.strategies.bsp import BSP

        return BSP()
    if parsed.kind in ("local", "diloco"):
        from gradsync.strategies.local_sgd import DiLoCo, LocalSGD

        assert parsed.period is not None
        return LocalSGD(parsed.period) if parsed.kind == "local" else DiLoCo(parsed.period)
    from gradsync.strategies.ps import ParameterServer

    bound = math.inf if parsed.kind == "async" else float(parsed.staleness or 0.0)
    return ParameterServer(bound, servers=servers, timeout_s=timeout_s)


def uses_servers(spec: str | Strategy) -> bool:
    """Whether a strategy runs parameter-server ranks (which take no part in training)."""
    if isinstance(spec, str):
        return parse_strategy_spec(spec).kind in ("ssp", "async")
    return hasattr(spec, "serve")
