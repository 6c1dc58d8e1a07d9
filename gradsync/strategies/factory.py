"""Spec string -> ``Strategy``: the one place that knows every concrete strategy.

It lives apart from the protocol (``strategies.base``) so that the concrete strategies, which
import the protocol, are never imported by it: no import cycle.
"""

from __future__ import annotations

import math

from gradsync.compression.base import Compressor
from gradsync.errors import UsageError
from gradsync.spec import SPLITS, outer_settings, parse_strategy_spec
from gradsync.strategies.base import Strategy
from gradsync.strategies.bsp import BSP
from gradsync.strategies.gossip import (
    Gossip,
    NoLoCo,
    pair_compression_refusal,
    takes_pair_compression,
)
from gradsync.strategies.hogwild import Hogwild, refusal_of_compression
from gradsync.strategies.local_sgd import DiLoCo, LocalSGD
from gradsync.strategies.ps import ParameterServer
from gradsync.strategies.zero import ZeroStage1, ZeroStage2, refuse_compression
from gradsync.strategies.zero3 import ZeroStage3


def parse_strategy(spec: str | Strategy, *, servers: int = 1, timeout_s: float = 300.0) -> Strategy:
    """A ``Strategy`` from a spec string (or the object itself, passed through).

    ``servers`` and ``timeout_s`` apply to the parameter-server strategies (``ssp:S``, ``async``);
    ``servers`` other than 1 with another strategy is refused rather than ignored.
    """
    if servers != 1 and not uses_servers(spec):
        name = spec if isinstance(spec, str) else spec.name
        raise UsageError(
            f"servers={servers} is for the parameter-server strategies (ssp:S, async); "
            f"strategy {name} runs no servers"
        )
    if isinstance(spec, Strategy):
        return spec
    parsed = parse_strategy_spec(spec)
    if parsed.kind == "bsp":
        return BSP()
    if parsed.kind == "hogwild":
        return Hogwild()
    if parsed.kind == "gossip":
        assert parsed.period is not None
        return Gossip(parsed.period)
    if parsed.kind == "noloco":
        assert parsed.period is not None
        return NoLoCo(parsed.period, **outer_settings(parsed))
    if parsed.kind == "zero":
        stages = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}
        return stages[parsed.stage or 1]()
    if parsed.kind in ("local", "diloco"):
        assert parsed.period is not None
        if parsed.kind == "local":
            return LocalSGD(parsed.period)
        return DiLoCo(
            parsed.period,
            **outer_settings(parsed),
            fragments=parsed.fragments or 1,
            delay=parsed.delay or 0,
            alpha=parsed.alpha or 0.0,
            split=parsed.split or SPLITS[0],
            eager=parsed.eager,
            keep_local=parsed.keep,
        )
    bound = math.inf if parsed.kind == "async" else float(parsed.staleness or 0.0)
    return ParameterServer(bound, servers=servers, timeout_s=timeout_s)


def check_compression(spec: str | Strategy, compression: str) -> None:
    """Refuse a strategy spec with a compression spec its exchange cannot carry, before any
    rank starts (the strategy's ``setup`` refuses the same, with the same message)."""
    if isinstance(spec, str):
        parsed = parse_strategy_spec(spec)
        if parsed.kind == "zero":
            assert parsed.stage is not None
            refuse_compression(parsed.stage, compression)
        if parsed.kind == "hogwild" and compression != "none":
            raise UsageError(refusal_of_compression(compression))
        pair = parsed.kind in ("gossip", "noloco")
        if pair and compression != "none" and not takes_pair_compression(compression):
            spec_text = f"{parsed.kind}:{parsed.period}"
            raise UsageError(pair_compression_refusal(spec_text, compression))


def check_compressor(strategy: Strategy, compressor: Compressor) -> None:
    """Refuse a compressor whose state is the outer momentum of a periodic average
    (``sparseloco``) under a strategy without one, in one line naming where it runs."""
    if compressor.replaces_momentum and not isinstance(strategy, LocalSGD | DiLoCo):
        raise UsageError(
            f"compression {compressor.spec} needs local:H or diloco:H, not {strategy.name}: its "
            "decaying accumulator is the outer momentum of a periodic average (diloco then "
            "takes its outer step without momentum); to compress gradients use topk:F"
        )


def uses_servers(spec: str | Strategy) -> bool:
    """Whether a strategy runs parameter-server ranks (which take no part in training)."""
    if isinstance(spec, str):
        return parse_strategy_spec(spec).uses_servers
    return spec.servers > 0


__all__ = ["check_compression", "check_compressor", "parse_strategy", "uses_servers"]
