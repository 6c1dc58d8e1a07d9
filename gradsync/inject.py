"""Fault and slowness injection, shipped in the library so tests and demos read like scenarios.

Two kinds of injector, one shape each:

- Scheduled faults, installed once on a Synchronizer (or anything shaped like one: ``Target``),
  that fire by themselves inside the step block of ``rank`` at ``step`` (the Synchronizer's
  step index, counted from 0)::

      inject.nan_gradient(sync, rank=1, step=3)       # every gradient of rank 1's step 3 is NaN
      inject.raise_in_block(sync, rank=0, step=5)     # rank 0's step-5 forward pass raises
      inject.slow(sync, rank=1, factor=3, start=10, end=50)   # rank 1 computes 3x as long

  ``nan_gradient`` and ``raise_in_block`` return a ``Fault``: ``remove()`` (or leaving it as a
  ``with`` block) uninstalls it, and ``fired`` says whether it acted.

- Immediate faults, for what a rank does instead of its next step::

      inject.kill()        # SIGKILL this process now
      inject.hang()        # take part in nothing until every peer called release_hang()

The specs of the CLI's ``--slow`` and ``--kill`` (``parse_slow``, ``parse_kill``) build the
same slowdowns and kills. Importing this module does not import torch, so flags are validated
without it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from gradsync.errors import UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "KILL_FORM",
    "MAX_FACTOR",
    "SLOW_FORM",
    "Fault",
    "InjectedError",
    "Kill",
    "Slowdown",
    "Target",
    "apply_slowdowns",
    "check_slowdowns",
    "hang",
    "kill",
    "maybe_kill",
    "nan_gradient",
    "parse_kill",
    "parse_slow",
    "raise_in_block",
    "release_hang",
    "slow",
]

MAX_FACTOR = 1000.0  # beyond this a "slowdown" is a hang; inf would sleep nan seconds
SLOW_FORM = (
    "RANK:FACTOR[@START[-END]] (e.g. 3:2, 1:1.5@100 or 1:3@10-40), comma-separated for several"
)
KILL_FORM = "RANK:STEP (e.g. 1:37), comma-separated for several"


@dataclass(frozen=True, slots=True, kw_only=True)
class Slowdown:
    """Make ``rank``'s compute ``factor`` times as long from step ``start`` on (until ``end``,
    exclusive, when given)."""

    rank: int
    factor: float
    start: int = 0
    end: int | None = None

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise UsageError(f"slowdown rank must be >= 0, got {self.rank}")
        if not 1.0 <= self.factor <= MAX_FACTOR:
            raise UsageError(f"slowdown factor must be in [1, {MAX_FACTOR:g}], got {self.factor}")
        if self.start < 0:
            raise UsageError(f"slowdown start step must be >= 0, got {self.start}")
        if self.end is not None and self.end <= self.start:
            raise UsageError(f"slowdown end step {self.end} must be after its start {self.start}")

    def delay(self, rank: int, step: int, natural_compute: float) -> float:
        """Seconds to sleep: proportional to the rank's own measured compute, so the slowdown
        scales with the workload instead of adding a constant."""
        if rank != self.rank or step < self.start or (self.end is not None and step >= self.end):
            return 0.0
        return (self.factor - 1.0) * natural_compute


def parse_slow(spec: str | None) -> list[Slowdown]:
    if spec is None or not spec.strip():
        return []
    out = []
    for part in spec.split(","):
        head, _, when = part.strip().partition("@")
        rank, sep, factor = head.partition(":")
        start, dash, end = when.partition("-")
        try:
            if not sep or (dash and not (start and end)):
                raise ValueError
            who, times = int(rank), float(factor)
            first, last = int(start) if start else 0, int(end) if end else None
        except ValueError:
            raise UsageError(f"bad --slow value {part.strip()!r}; valid: {SLOW_FORM}") from None
        try:  # well formed: Slowdown says which number is out of range, and what is valid
            out.append(Slowdown(rank=who, factor=times, start=first, end=last))
        except UsageError as exc:
            raise UsageError(
                f"bad --slow value {part.strip()!r}: {exc}; valid: {SLOW_FORM}"
            ) from None
    return out


def check_slowdowns(slowdowns: list[Slowdown], world_size: int) -> None:
    """Refuse a slowdown of a rank the group does not have: ``slow="3:2"`` in a world of two
    slowed nothing, silently (``gradsync run --slow`` refuses it before the run)."""
    for s in slowdowns:
        if not 0 <= s.rank < world_size:
            raise UsageError(
                f"slow names rank {s.rank}, but this group's ranks are 0..{world_size - 1}"
            )


def apply_slowdowns(slowdowns: list[Slowdown], rank: int, step: int, natural: float) -> float:
    """Sleep at block entry for the extra time the slowdown adds to ``natural`` (this rank's own
    compute without injected delay, as last measured); return the seconds slept.

    The sleep comes first in the block so that the rank's whole step, bucket launches
    included, is late: a sleep after backward would only delay the next step's collectives.
    The seconds returned are measured, not the ones asked for: the caller takes them out of
    the step's compute to find ``natural`` again, and a sleep that overran (by the scheduler's
    tick, more on a busy machine) counted as compute and grew every later delay by FACTOR
    times as much (``--slow 1:3`` made a 100k-parameter mlp's rank 5.5x slower).
    """
    delay = sum(s.delay(rank, step, natural) for s in slowdowns)
    if delay <= 0:
        return 0.0
    start = time.perf_counter()
    time.sleep(delay)
    return time.perf_counter() - start


@dataclass(frozen=True, slots=True, kw_only=True)
class Kill:
    """Kill ``rank`` with SIGKILL when it reaches ``step``, once per run directory."""

    rank: int
    step: int

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 0:
            raise UsageError(f"--kill needs a rank and a step >= 0, got {self.rank}:{self.step}")


def parse_kill(spec: str | None) -> list[Kill]:
    if spec is None or not spec.strip():
        return []
    out = []
    for part in spec.split(","):
        rank, sep, step = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            out.append(Kill(rank=int(rank), step=int(step)))
        except ValueError:
            raise UsageError(f"bad --kill value {part.strip()!r}; valid: {KILL_FORM}") from None
    if len({(k.rank, k.step) for k in out}) != len(out):
        raise UsageError(f"--kill lists the same rank and step twice: {spec!r}")
    return out


def kill() -> NoReturn:
    """SIGKILL this process now: no exception, no cleanup, no last word to its peers, as when
    the machine or the OOM killer takes a worker away."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")  # pragma: no cover


def maybe_kill(kills: list[Kill], rank: int, step: int, marker_dir: Path) -> None:
    """``kill()`` this process if one of ``kills`` is due here and has not fired before.

    A marker file, written and synced before the signal, makes each kill fire once: after a
    restart resumes from an earlier checkpoint, the same step comes round again.
    """
    for k in kills:
        if k.rank != rank or k.step != step:
            continue
        marker = marker_dir / f"kill-rank{rank}-step{step}.json"
        if marker.exists():
            continue
        marker_dir.mkdir(parents=True, exist_ok=True)
        with open(marker, "w", encoding="utf-8") as fh:
            json.dump({"rank": rank, "step": step, "time": time.time()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        kill()


# -- scheduled faults ---------------------------------------------------------------------


class Target(Protocol):
    """What a scheduled fault needs of a Synchronizer (a Protocol, so that this module, which
    the Synchronizer imports, does not import it back)."""

    rank: int
    model: nn.Module
    slowdowns: list[Slowdown]

    @property
    def step_count(self) -> int: ...


class InjectedError(RuntimeError):
    """What ``raise_in_block`` raises unless given another exception."""


class Fault:
    """A scheduled fault, installed on a model's hooks: ``remove()`` uninstalls it (so does the
    end of a ``with`` block around it); ``fired`` says whether it has acted."""

    __slots__ = ("fired", "kind", "rank", "step", "_handles")

    def __init__(self, kind: str, rank: int, step: int) -> None:
        if rank < 0 or step < 0:
            raise UsageError(f"inject.{kind} needs a rank and a step >= 0, got {rank}, {step}")
        self.kind, self.rank, self.step = kind, rank, step
        self.fired = False
        self._handles: list[Any] = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> Fault:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "fired" if self.fired else "armed" if self._handles else "idle"
        return f"Fault({self.kind}, rank={self.rank}, step={self.step}, {state})"


def _parameters(sync: Target, kind: str, param: str | None) -> list[nn.Parameter]:
    named = [(n, p) for n, p in sync.model.named_parameters() if p.requires_grad]
    if param is None:
        return [p for _, p in named]
    chosen = [p for n, p in named if n == param]
    if not chosen:
        valid = ", ".join(n for n, _ in named)
        raise UsageError(f"inject.{kind}: no trainable parameter {param!r}; valid: {valid}")
    return chosen


def nan_gradient(
    sync: Target, *, rank: int, step: int, param: str | None = None, value: float = math.nan
) -> Fault:
    """Make ``rank``'s gradients non-finite (``value``: NaN, or an infinity) in every backward
    pass of step ``step``: every trainable parameter's, or only ``param``'s (a name from
    ``model.named_parameters()``), as a loss that overflows or a bad sample would.

    The gradient is replaced as it arrives, before it accumulates into ``.grad``, so the
    Synchronizer's bucket hooks (which run after accumulation) see the poisoned value whatever
    the order in which hooks were registered.
    """
    if math.isfinite(value):
        raise UsageError(f"inject.nan_gradient: value must be NaN or infinite, got {value}")
    fault = Fault("nan_gradient", rank, step)
    if sync.rank != rank:
        return fault

    def poison(grad: torch.Tensor) -> torch.Tensor | None:
        if sync.step_count != step:
            return None
        fault.fired = True
        return grad.new_full(grad.shape, value)

    fault._handles = [p.register_hook(poison) for p in _parameters(sync, "nan_gradient", param)]
    return fault


def raise_in_block(
    sync: Target,
    *,
    rank: int,
    step: int,
    exc: BaseException | None = None,
    during: str = "forward",
) -> Fault:
    """Raise ``exc`` (default: an ``InjectedError`` naming rank and step) once, inside ``rank``'s
    step block at step ``step``: from the model's forward pass (``during="forward"``, before
    any gradient exists) or from the first gradient of its backward pass
    (``during="backward"``), as user code that fails in the middle of a step would.
    """
    if during not in ("forward", "backward"):
        raise UsageError(
            f"inject.raise_in_block: during must be 'forward' or 'backward', got {during!r}"
        )
    fault = Fault("raise_in_block", rank, step)
    if sync.rank != rank:
        return fault
    error = exc if exc is not None else InjectedError(f"injected failure: rank {rank}, step {step}")

    def fire(*_: object) -> None:
        if sync.step_count == step and not fault.fired:
            fault.fired = True  # once: a step run again after the failure goes through
            raise error

    if during == "forward":
        fault._handles = [sync.model.register_forward_pre_hook(fire)]
    else:
        params = _parameters(sync, "raise_in_block", None)
        fault._handles = [p.register_hook(fire) for p in params]
    return fault


def slow(
    sync: Target, *, rank: int, factor: float, start: int = 0, end: int | None = None
) -> Slowdown:
    """Make ``rank``'s compute ``factor`` times as long from step ``start`` (until ``end``,
    exclusive): the Synchronizer sleeps at block entry in proportion to the rank's own measured
    compute (``Slowdown``). The same as ``Synchronizer(slow="RANK:FACTOR@START-END")``, added
    after construction; ``sync.slowdowns.remove(returned)`` ends it early."""
    slowdown = Slowdown(rank=rank, factor=factor, start=start, end=end)
    sync.slowdowns.append(slowdown)
    return slowdown


# -- hangs ----------------------------------------------------------------------------------


def _released_key(name: str, rank: int) -> str:
    return f"gradsync/inject/{name}/released/{rank}"


def _store_and_rank(what: str) -> tuple[Any, int, int]:
    import torch.distributed as dist

    from gradsync.compat import default_store

    store = default_store() if dist.is_available() and dist.is_initialized() else None
    if store is None:
        raise UsageError(f"inject.{what}() needs torch.distributed: call gs.init() first")
    return store, dist.get_rank(), dist.get_world_size()


def hang(
    *,
    peers: Iterable[int] | None = None,
    limit_s: float = 60.0,
    name: str = "hang",
    poll_s: float = 0.1,
) -> bool:
    """Stop taking part in anything, as a hung rank does (stuck in a long computation, a dead
    NFS mount), without a word to the peers: block until every rank in ``peers`` (default:
    every other rank) has called ``release_hang(name=name)``, or ``limit_s`` has passed
    (``math.inf``: forever). Returns whether it was released.

    The peers release it once they have what the scenario waits for (their timeout error),
    so that a test lasts as long as the timeout under test, not as long as ``limit_s``. The
    handshake goes through the default group's store, never through a collective the hung
    rank could be said to have joined.
    """
    store, me, world = _store_and_rank("hang")
    others = sorted({r for r in (range(world) if peers is None else peers) if r != me})
    keys = [_released_key(name, r) for r in others]
    deadline = time.monotonic() + limit_s
    while keys and not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def release_hang(*, name: str = "hang") -> None:
    """Tell a rank in ``hang(name=name)`` that this rank no longer needs it to stay away."""
    store, me, _ = _store_and_rank("release_hang")
    store.set(_released_key(name, me), "1")
