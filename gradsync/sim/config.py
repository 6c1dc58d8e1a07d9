"""Inputs of a simulation: the strategy spec, the compute model and the communication model.

Times in the simulator are milliseconds (what users type and read); the alpha-beta model in
``gradsync.sim.model`` is in SI seconds and bytes, converted once in ``CommModel``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import numpy as np

from gradsync.errors import UsageError
from gradsync.sim.gate import StoreGate
from gradsync.sim.model import (
    AlphaBeta,
    flat_allreduce_time,
    flat_collective_time,
    hierarchical_allreduce_time,
)
from gradsync.spec import EAGER, KEEP, SPLITS, STRATEGY_TABLE, StrategySpec, parse_strategy_spec

#: The strategies the simulator models (a subset of ``gradsync.spec.STRATEGY_TABLE``).
#: workers x steps the simulator takes (--workers, --sweep-workers, --steps): about 1.4 GiB
MAX_WORKER_STEPS = 2**24
# The ranges of the step model's inputs. Past them the figures are nonsense (a step of days)
# and far past them a float overflows: --jitter 1e308 drew inf, and inf - inf printed nan.
#: --compute, --jitter and --comm-ms, in ms: an hour
MAX_MS = 3_600_000.0
#: a --straggler or --transient factor: a worker a thousand times slower
MAX_FACTOR = 1000.0
SIMULATED = ("bsp", "zero", "ssp", "async", "local", "diloco", "hogwild", "gossip", "noloco")
#: The ZeRO stages the simulator models.
ZERO_STAGES = (1, 2, 3)


def modelled() -> str:
    """The strategies the simulator models, as a user types them (for its messages)."""
    return ", ".join(
        ", ".join(f"zero:{n}" for n in ZERO_STAGES) if k == "zero" else STRATEGY_TABLE[k].usage
        for k in SIMULATED
    )


def _check_spec(text: str) -> StrategySpec:
    """``parse_strategy_spec``; a refused ``zero:N`` also says what the simulator models."""
    try:
        return parse_strategy_spec(text)
    except UsageError as exc:
        if text.strip().lower().startswith("zero:"):
            raise UsageError(f"{exc}; the simulator models {modelled()}") from None
        raise


@dataclass(frozen=True, kw_only=True, slots=True)
class SimStrategy:
    """A strategy as the simulator reads it: ``param`` is S for ssp (``math.inf`` allowed), H
    for local/diloco, 0 for the others. Streaming DiLoCo (``diloco:H:F:TAU:ALPHA[:SPLIT]``)
    also sets ``fragments``, ``delay``, ``alpha`` and ``split`` (how the fragments are cut,
    ``gradsync.spec.SPLITS``: "rows" by default); plain ``diloco:H`` is F=1, TAU=0, ALPHA=0.

    Checked by ``gradsync.spec``, the parser of every spec string, so a SimStrategy built directly
    is refused with the same message as the spec string it stands for.
    """

    kind: str
    param: float = 0.0
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    split: str = SPLITS[0]
    #: eager outer updates (``diloco:H:F:eager``): each fragment's exchange is waited for a
    #: period after it started, where its next one starts (``gradsync.strategies.eager``)
    eager: bool = False
    #: ``diloco:H:F:TAU:keep``: a merge keeps the local steps taken while its exchange was in
    #: flight, so even one fragment's merge leaves the replicas differing (the end then costs
    #: one more exchange of every fragment, as ``DiLoCo.finalize`` does)
    keep: bool = False

    def __post_init__(self) -> None:
        _check_spec(self.spec)
        if self.kind not in SIMULATED:
            raise UsageError(f"the simulator does not model {self.spec!r}; it models {modelled()}")
        if self.kind != "diloco" and (
            (self.fragments, self.delay, self.alpha, self.split, self.eager, self.keep)
            != (1, 0, 0.0, SPLITS[0], False, False)
        ):
            raise UsageError(
                f"fragments, delay, alpha and split are streaming DiLoCo's "
                f"(diloco:H:F:TAU:ALPHA:SPLIT), not {self.spec}'s"
            )
        if self.keep and (self.eager or self.alpha or not self.delay):
            raise UsageError(
                f"keep takes ALPHA's place and needs TAU >= 1 (got delay={self.delay}, "
                f"alpha={self.alpha}, eager={self.eager}): diloco:H:F:TAU:keep"
            )
        if self.eager and (self.delay or self.alpha):
            raise UsageError(
                f"eager takes no delay or alpha (got delay={self.delay}, alpha={self.alpha}): "
                "each fragment's exchange is applied a period after it starts"
            )
        if self.fragments == 1 and self.split != SPLITS[0]:
            # One fragment is the whole model whatever the split (the parser drops it too), so
            # that a SimStrategy equals the one its spec string parses to.
            object.__setattr__(self, "split", SPLITS[0])

    @property
    def streaming(self) -> bool:
        """Whether this is streaming DiLoCo, priced fragment by fragment (plain diloco:H is
        the one-fragment, undelayed, unmixed case, and the spec parser gives it back as such);
        eager outer updates are priced as streaming, whatever F."""
        return self.kind == "diloco" and (
            self.eager or (self.fragments, self.delay, self.alpha) != (1, 0, 0.0)
        )

    @classmethod
    def from_spec(cls, spec: StrategySpec) -> SimStrategy:
        """The simulator's view of a parsed spec string."""
        if spec.fragments is not None:
            assert spec.period is not None
            return cls(
                kind=spec.kind,
                param=spec.period,
                fragments=spec.fragments,
                delay=spec.delay or 0,
                alpha=spec.alpha or 0.0,
                split=spec.split or SPLITS[0],
                eager=spec.eager,
                keep=spec.keep,
            )
        if spec.period is not None:
            return cls(kind=spec.kind, param=spec.period)
        if spec.staleness is not None:
            return cls(kind=spec.kind, param=spec.staleness)
        if spec.stage is not None:  # zero:N, N the ZeRO stage
            return cls(kind=spec.kind, param=spec.stage)
        return cls(kind=spec.kind)

    @property
    def spec(self) -> str:
        """The spec string this stands for (canonical, ``"ssp:inf"``, once it is valid)."""
        form = STRATEGY_TABLE.get(self.kind)
        p = float(self.param)
        if (form is None or form.parse is None) and p == 0:
            return self.kind
        text = f"{self.kind}:{int(p) if p.is_integer() else p!r}"
        if self.eager and self.kind == "diloco":  # the parser's form (spec._show_diloco)
            split = f":{self.split}" if self.split != SPLITS[0] and self.fragments > 1 else ""
            return f"{text}:{self.fragments}:{EAGER}{split}"
        if self.streaming:
            # The parser's canonical form (gradsync.spec._show_diloco): TAU always, ALPHA if set,
            # SPLIT if not the default.
            merge = f":{KEEP}" if self.keep else f":{self.alpha!r}" if self.alpha else ""
            text += f":{self.fragments}:{self.delay}{merge}"
        if self.kind == "diloco" and self.split != SPLITS[0]:
            # After F (the parser reads SPLIT only there); with one fragment it parses away.
            text += ("" if self.streaming else ":1:0") + f":{self.split}"
        return text


def parse_sim_strategy(text: str) -> SimStrategy:
    """Parse ``bsp``, ``zero:1``, ``zero:2``, ``zero:3``, ``ssp:S``, ``async``, ``local:H``,
    ``diloco:H`` or ``diloco:H:F[:TAU[:ALPHA]][:SPLIT]`` (``gradsync.spec``)."""
    return SimStrategy.from_spec(_check_spec(text))


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeModel:
    """Per-worker compute time of every step, in milliseconds.

    ``compute[t, w] = max(0, base[w] * straggler[w] + jitter) * (transient factor or 1)``.
    Jitter comes from ``random.Random(seed)``, drawn step by step and worker by worker in
    worker order with ``uniform(-jitter_ms, jitter_ms)``, so a run can be reproduced by hand;
    transient slowdowns use ``numpy.random.default_rng(seed)`` so they never shift the jitter.
    ``base_ms`` holds one value per worker, or one for all; it is cycled to fill ``workers``.
    """

    workers: int
    steps: int
    base_ms: tuple[float, ...]
    jitter_ms: float = 0.0
    stragglers: tuple[tuple[int, float], ...] = ()
    transient_prob: float = 0.0
    transient_factor: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise UsageError(f"--workers must be at least 1, got {self.workers}")
        if self.steps < 1:
            raise UsageError(f"--steps must be at least 1, got {self.steps}")
        if self.workers * self.steps > MAX_WORKER_STEPS:
            # Every worker-step is a cell of the compute matrix and of each strategy's
            # timeline (about 90 bytes in all): refused before numpy's MemoryError.
            fewer = (
                f"--steps {MAX_WORKER_STEPS // self.workers} or fewer"
                if self.steps > self.workers
                else f"--workers {MAX_WORKER_STEPS // self.steps} or fewer"
            )
            raise UsageError(
                f"--workers {self.workers} x --steps {self.steps} is "
                f"{self.workers * self.steps:,} worker-steps, more than the simulator's "
                f"{MAX_WORKER_STEPS:,} (about {MAX_WORKER_STEPS * 90 / 2**30:.1f} GiB): use {fewer}"
            )
        # Written as "not (ok)" so that nan, which fails every comparison, is rejected too.
        if not self.base_ms or any(not 0 <= b <= MAX_MS for b in self.base_ms):
            raise UsageError(
                f"--compute needs finite times from 0 to {MAX_MS:.0f} ms (an hour), got "
                f"{list(self.base_ms)}"
            )
        if not any(b > 0 for b in self.base_ms):
            # every share of the compute split, and every strategy's speed, would be 0 / 0
            raise UsageError(
                f"--compute needs a time > 0 ms for at least one worker, got {list(self.base_ms)}"
            )
        if not 0 <= self.jitter_ms <= MAX_MS:
            raise UsageError(
                f"--jitter must be a finite number from 0 to {MAX_MS:.0f} ms (an hour), got "
                f"{self.jitter_ms}"
            )
        for rank, factor in self.stragglers:
            if not 0 <= rank < self.workers:
                raise UsageError(f"straggler rank {rank} is not in 0..{self.workers - 1}")
            if not 0 < factor <= MAX_FACTOR:
                raise UsageError(
                    f"straggler factor must be a finite number > 0 and at most {MAX_FACTOR:g}, got "
                    f"{factor}"
                )
        if not 0 <= self.transient_prob <= 1:
            raise UsageError(f"transient probability must be in [0, 1], got {self.transient_prob}")
        if not 0 < self.transient_factor <= MAX_FACTOR:
            raise UsageError(
                f"transient factor must be a finite number > 0 and at most {MAX_FACTOR:g}, got "
                f"{self.transient_factor}"
            )

    def base(self) -> np.ndarray:
        """Each worker's base compute in ms, with persistent stragglers applied."""
        reps = -(-self.workers // len(self.base_ms))
        base = np.tile(np.asarray(self.base_ms, dtype=float), reps)[: self.workers]
        for rank, factor in self.stragglers:
            base[rank] *= factor
        return base

    def with_workers(self, workers: int) -> ComputeModel:
        """The same model at another scale; stragglers beyond the new world are dropped."""
        kept = tuple((r, f) for r, f in self.stragglers if r < workers)
        return replace(self, workers=workers, stragglers=kept)

    def draw(self) -> np.ndarray:
        """The ``(steps, workers)`` matrix of compute times in ms."""
        shape = (self.steps, self.workers)
        compute = np.broadcast_to(self.base(), shape).copy()
        if self.jitter_ms > 0:
            uniform, j = random.Random(self.seed).uniform, self.jitter_ms
            draws = [uniform(-j, j) for _ in range(self.steps * self.workers)]
            compute += np.asarray(draws).reshape(shape)
            np.maximum(compute, 0.0, out=compute)
        if self.transient_prob > 0 and self.transient_factor != 1:
            hit = np.random.default_rng(self.seed).random(shape) < self.transient_prob
            compute[hit] *= self.transient_factor
        return compute


#: ``--allreduce``'s choices, as ``gradsync run`` names them (``gradsync.topology``, which needs
#: torch, has the same tuple).
ALLREDUCE_CHOICES = ("ring", "hierarchical")
#: The strategies whose exchange goes through the hierarchical all-reduce (the runtime's
#: ``SimStrategy.takes_hierarchy``): bsp's and zero:1's gradient, local SGD's and DiLoCo's averages.
HIERARCHICAL = ("bsp", "zero:1", "local:H", "diloco:H")


def takes_hierarchy(strategy: SimStrategy) -> bool:
    """Whether ``strategy`` exchanges through the hierarchical all-reduce at run time."""
    return strategy.kind in ("bsp", "local", "diloco") or strategy.spec == "zero:1"


@dataclass(frozen=True, kw_only=True, slots=True)
class Hosts:
    """The workers spread evenly over ``hosts`` hosts: the comm model's link runs between hosts,
    ``intra`` inside one; ``allreduce`` is ``ring`` (one flat ring over every rank, paced by
    the slower link) or ``hierarchical`` (``gradsync.topology``: reduce in the host, all-reduce
    among one leader per host, broadcast back). Priced by ``gradsync.sim.model``'s
    ``flat_allreduce_time`` and ``hierarchical_allreduce_time``."""

    hosts: int
    intra: AlphaBeta
    allreduce: str = "ring"

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise UsageError(f"--hosts must be at least 1, got {self.hosts}")
        if self.allreduce not in ALLREDUCE_CHOICES:
            raise UsageError(
                f"--allreduce must be one of {', '.join(ALLREDUCE_CHOICES)}, got {self.allreduce!r}"
            )

    def per_host(self, workers: int) -> int:
        """Ranks per host; every host holds as many (as ``gradsync run --hosts`` requires)."""
        if workers % self.hosts:
            raise UsageError(
                f"{workers} workers do not split evenly over --hosts {self.hosts}; use a number "
                "of workers that is a multiple of the hosts"
            )
        return workers // self.hosts


@dataclass(frozen=True, kw_only=True, slots=True)
class CommModel:
    """Cost of one exchange (an all-reduce of the gradient or the parameters), in ms.

    Either a fixed ``comm_ms``, or the alpha-beta cost of all-reducing ``nbytes`` on the
    simulated number of workers, so that it grows with the world size. ``nbytes`` is also the
    size of the parameters (a gradient has its parameter's dtype), which ``zero:N``
    all-gathers. ``ratio`` is a compressor's: an exchange carries ``nbytes / ratio`` (a fixed
    ``comm_ms`` shrinks in proportion); zero:N's collectives are never compressed.
    ``hosts`` (alpha-beta only) puts the workers on hosts, ``link`` then being the link between
    them. ``gate``: the step gate's store, priced under the strategies that pass it every step
    (``gradsync.sim.gate``); None leaves it out, as ``between_steps_timeout_s=None`` does.
    """

    comm_ms: float | None = None
    link: AlphaBeta | None = None
    nbytes: float = 0.0
    ratio: float = 1.0
    hosts: Hosts | None = None
    gate: StoreGate | None = None

    def __post_init__(self) -> None:
        if (self.comm_ms is None) == (self.link is None):
            raise UsageError("give either a fixed --comm-ms or an alpha-beta link, not both")
        if self.comm_ms is not None and not 0 <= self.comm_ms <= MAX_MS:
            raise UsageError(
                f"--comm-ms must be a finite number from 0 to {MAX_MS:.0f} ms (an hour), got "
                f"{self.comm_ms}"
            )
        if not (self.nbytes >= 0 and math.isfinite(self.nbytes)):
            raise UsageError(f"message size must be a finite number >= 0 bytes, got {self.nbytes}")
        if not (self.ratio >= 1 and math.isfinite(self.ratio)):
            raise UsageError(f"--compression-ratio must be a finite number >= 1, got {self.ratio}")
        if self.hosts is not None and self.link is None:
            raise UsageError(
                "--hosts needs the alpha-beta model (--message-mb, --link-gbps between hosts, "
                "--intra-gbps inside one), not a fixed --comm-ms"
            )

    def exchange_ms(self, workers: int, fraction: float = 1.0) -> float:
        """One all-reduce of ``fraction`` of the message among ``workers`` ranks, compressed."""
        if self.comm_ms is not None:
            return self.comm_ms * fraction / self.ratio
        assert self.link is not None
        nbytes = self.nbytes * fraction
        if self.hosts is None:
            return 1000.0 * self.link.time("allreduce", workers, nbytes / self.ratio)
        per_host, inter, intra = self.hosts.per_host(workers), self.link, self.hosts.intra
        if self.hosts.allreduce == "hierarchical":
            # The runtime compresses what crosses hosts only; the host sums are exact.
            return 1000.0 * hierarchical_allreduce_time(
                self.hosts.hosts, per_host, nbytes, inter, intra, inter_nbytes=nbytes / self.ratio
            )
        return 1000.0 * flat_allreduce_time(
            self.hosts.hosts, per_host, nbytes / self.ratio, inter, intra
        )

    def pair_ms(self, workers: int) -> float:
        """One pair exchange of gossip (a model each way between two ranks, compressed by the
        ratio) while every rank exchanges with its own partner. On hosts: across the inter-host
        link, which a host's ranks share (each of them sends a model through it at once); a
        fixed ``comm_ms`` is one all-reduce, as for a broadcast."""
        if self.hosts is None or self.comm_ms is not None:
            return self.collective_ms("broadcast", 2, 1.0 / self.ratio)
        assert self.link is not None
        sharing = self.hosts.per_host(workers)
        return 1000.0 * self.link.time("broadcast", 2, self.nbytes * sharing / self.ratio)

    def collective_ms(self, op: str, workers: int, fraction: float = 1.0) -> float:
        """One ``op`` (``gradsync.sim.model.OPS``) of ``fraction`` of the message, uncompressed.

        Alpha-beta: the link's formula for ``op`` (on hosts: the all-reduce as ``hosts.allreduce``
        says, the others a flat ring paced by the slower link). Fixed ``comm_ms``: that is one
        all-reduce, so a reduce-scatter or an all-gather is half of it (the ring all-reduce is
        exactly one of each, ``model.cost_terms``); a broadcast is priced as an all-reduce.
        """
        if self.comm_ms is not None:
            half = op in ("reducescatter", "allgather")
            return self.comm_ms * fraction * (0.5 if half else 1.0)
        assert self.link is not None
        if self.hosts is None:
            return 1000.0 * self.link.time(op, workers, self.nbytes * fraction)
        if op == "allreduce":
            return replace(self, ratio=1.0).exchange_ms(workers, fraction)
        per_host = self.hosts.per_host(workers)
        return 1000.0 * flat_collective_time(
            op, self.hosts.hosts, per_host, self.nbytes * fraction, self.link, self.hosts.intra
        )
