"""Goodput under failures (issue 45): restart-from-checkpoint against live membership.

Our own model rather than a published one, because the question is gradsync's: its two ways
of surviving a lost GPU, priced with the costs gradsync itself measures (its forked restarts,
RELIABILITY.md; its replica groups' healing, docs/simulator.md), at cluster sizes no test can
run. *Goodput* is the expected share of wall time that ends up as committed training, against
the same cluster with no failures.

Assumptions (docs/simulator.md, "Goodput under failures", has the derivation):

- every GPU fails independently at a constant rate (failures a GPU-hour; by default the one
  the Llama 3 paper's 419 unexpected interruptions in 54 days on 16,384 GPUs give), so the
  cluster's failures are a Poisson process of rate ``gpus * rate``; a failure counts once,
  whatever it takes down, and none arrives during the recovery from another;
- **restart from checkpoint**: every rank stops, is relaunched, meets again and loads the
  newest committed checkpoint, ``restart_s`` from the death to training again; the work since
  that checkpoint (a checkpoint every ``checkpoint_every`` steps of ``step_s``) is lost;
- **live membership**: the survivors stall ``stall_s`` (the quorum's bound on noticing the
  loss, and the replacement's rejoining), then go on; the step in flight, which the quorum
  does not commit, is lost, and no other; the lost replica group (``group_gpus`` GPUs) is away
  ``heal_s`` from the death until it trains again (its own relaunch and the healing transfer
  from a peer), and while the others train without it their throughput is short of its share;
- the cost of writing checkpoints, which both paths pay, is left out.

Both expectations are closed forms (no sampling): renewal-reward over the cycles between
failures, with the exact expectation of the work lost to periodic checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradsync.errors import UsageError

__all__ = [
    "LLAMA3",
    "FailureCosts",
    "Goodput",
    "failures_per_day",
    "goodput",
    "live_goodput",
    "restart_goodput",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Published:
    """A published count of interruptions on one cluster over a period."""

    interruptions: int
    days: float
    gpus: int
    source: str

    @property
    def per_day(self) -> float:
        return self.interruptions / self.days

    @property
    def rate(self) -> float:
        """Failures a GPU-hour, if every interruption is one GPU's failure."""
        return self.interruptions / (self.days * 24.0 * self.gpus)


#: The published reference: "The Llama 3 Herd of Models" (Llama Team, AI @ Meta, 2024,
#: arXiv:2407.21783), section 3.3.4: 419 unexpected interruptions in a 54-day snapshot of
#: pre-training on 16,384 H100 GPUs (466 in all, 47 of them planned).
LLAMA3 = Published(
    interruptions=419,
    days=54.0,
    gpus=16_384,
    source="Llama 3 (arXiv:2407.21783, section 3.3.4)",
)

# gradsync's own measurements, the defaults (docs/simulator.md says where each comes from):
#: RELIABILITY.md, BSP on 2 ranks of charlm: kill to the next completed step, median (forked)
RESTART_S = 0.4
#: the same runs' step period with a checkpoint every step (17.94 ms), and that interval
STEP_S = 0.018
CHECKPOINT_EVERY = 1
#: ``gradsync run --replica-groups 2`` of charlm, a kill: the survivor's step took about 2.1 s
#: (median of 3 runs), torchft's 2 s heartbeat timeout and the quorum; the replacement was
#: relaunched, healed from the survivor and trained that same step with it, 2.1 s after the kill
STALL_S = 2.1
HEAL_S = 2.1
#: GPUs a failure takes out of training under live membership: one 8-GPU host
GROUP_GPUS = 8

# The ranges the flags take. Past them the figures are nonsense rather than wrong (a step of
# more than a day; failures/day printed as 300 digits), and far past them the closed forms
# overflow a float: every GPU failing once a minute is a cluster that never trains.
#: failures a GPU-hour: each GPU failing once a minute
MAX_FAILURE_RATE = 60.0
#: --step-s, --restart-s, --stall-s and --heal-s: a day
MAX_SECONDS = 86_400.0
#: --checkpoint-every: steps
MAX_CHECKPOINT_EVERY = 10**9
#: --gpus and --group-gpus: ten million GPUs, a hundred times the largest clusters of 2024
MAX_GPUS = 10**7


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureCosts:
    """What a failure costs each path; every field is a flag of ``gradsync simulate
    --failures`` (named in the refusals). Seconds, and failures a GPU-hour."""

    failure_rate: float = LLAMA3.rate
    step_s: float = STEP_S
    checkpoint_every: int = CHECKPOINT_EVERY
    restart_s: float = RESTART_S
    stall_s: float = STALL_S
    heal_s: float = HEAL_S
    group_gpus: int = GROUP_GPUS

    def __post_init__(self) -> None:
        for name, value, low, strict, high in (
            ("--failure-rate", self.failure_rate, 0.0, False, MAX_FAILURE_RATE),
            ("--step-s", self.step_s, 0.0, True, MAX_SECONDS),
            ("--restart-s", self.restart_s, 0.0, False, MAX_SECONDS),
            ("--stall-s", self.stall_s, 0.0, False, MAX_SECONDS),
            ("--heal-s", self.heal_s, 0.0, False, MAX_SECONDS),
        ):
            if not math.isfinite(value) or value < low or (strict and value == low) or value > high:
                bound = "> 0" if strict else ">= 0"
                raise UsageError(
                    f"{name} must be a number {bound} and at most {high:g}"
                    f"{' (a day)' if high == MAX_SECONDS else ''}, got {value}"
                )
        if not 1 <= self.checkpoint_every <= MAX_CHECKPOINT_EVERY:
            # "never" has no steady state: each failure would go back to step 0.
            raise UsageError(
                f"--checkpoint-every must be a whole number of steps from 1 to "
                f"{MAX_CHECKPOINT_EVERY:,}, got {self.checkpoint_every}"
            )
        if not 1 <= self.group_gpus <= MAX_GPUS:
            raise UsageError(
                f"--group-gpus must be a whole number from 1 to {MAX_GPUS:,}, got {self.group_gpus}"
            )


def failures_per_day(gpus: int, rate: float) -> float:
    """Expected failures a day on ``gpus`` GPUs failing ``rate`` times a GPU-hour each."""
    return gpus * rate * 24.0


def _kept_share(x: float) -> float:
    """The share of running time kept when a failure, arriving at rate L, loses the work since
    the last of periodic commits T apart (x = L T): x / (e^x - 1), about 1 - x/2 for short T,
    half an interval lost per failure. From renewal-reward: a run of Exp(L) length keeps
    T * floor(run / T), whose mean is T q / (1 - q), q = e^-x."""
    # x e^-x / (1 - e^-x), the same ratio: e^x overflows a float past x of about 709 (a
    # failure rate or checkpoint interval far out), where e^-x goes smoothly to 0.
    return 1.0 if x == 0 else x * math.exp(-x) / -math.expm1(-x)


def _per_second(gpus: int, costs: FailureCosts) -> float:
    return failures_per_day(gpus, costs.failure_rate) / 86_400.0


def restart_goodput(gpus: int, costs: FailureCosts) -> float:
    """Restart from checkpoint: each cycle runs until a failure, keeps the work up to the last
    committed checkpoint, then the whole cluster is down ``restart_s``."""
    lam = _per_second(gpus, costs)
    interval = costs.checkpoint_every * costs.step_s
    return _kept_share(lam * interval) / (1.0 + lam * costs.restart_s)


def live_goodput(gpus: int, costs: FailureCosts) -> float:
    """Live membership: each cycle runs until a failure and loses only the step in flight, then
    every survivor stalls ``stall_s``; the lost group is away ``heal_s`` from the death, of
    which what outlasts the stall is time the others train without its share. By Little's
    law that share is missing for ``lam * (heal_s - stall_s) * group_gpus / gpus`` of the
    running time, overlapping absences included."""
    _check_groups(gpus, costs.group_gpus)
    lam = _per_second(gpus, costs)
    away = max(0.0, costs.heal_s - costs.stall_s) * costs.group_gpus / gpus
    kept = _kept_share(lam * costs.step_s) - lam * away
    return max(0.0, kept) / (1.0 + lam * costs.stall_s)


def _check_groups(gpus: int, group_gpus: int) -> None:
    if gpus < 1:
        raise UsageError(f"--gpus takes whole numbers of GPUs >= 1, got {gpus}")
    if group_gpus * 2 > gpus:
        # A lost group heals from a live peer: with one group there is none.
        raise UsageError(
            f"--group-gpus {group_gpus} leaves fewer than 2 replica groups on {gpus} GPUs; "
            f"live membership needs a peer: give --group-gpus <= {gpus // 2} or more --gpus"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Goodput:
    """One cluster size's row of ``simulate --failures``."""

    gpus: int
    failures_per_day: float
    restart: float
    live: float

    @property
    def hours_between(self) -> float:
        """Mean hours between failures (inf without any)."""
        return math.inf if self.failures_per_day == 0 else 24.0 / self.failures_per_day


def goodput(gpus: int, costs: FailureCosts) -> Goodput:
    """Both paths' goodput on ``gpus`` GPUs."""
    _check_groups(gpus, costs.group_gpus)
    return Goodput(
        gpus=gpus,
        failures_per_day=failures_per_day(gpus, costs.failure_rate),
        restart=restart_goodput(gpus, costs),
        live=live_goodput(gpus, costs),
    )


def describe(costs: FailureCosts) -> str:
    """The costs a table was priced with, in one line."""
    every = f"{costs.checkpoint_every} step{'s' if costs.checkpoint_every != 1 else ''}"
    return (
        f"restart: {costs.restart_s:g} s down + the work since the last checkpoint (every "
        f"{every} of {costs.step_s:g} s); live: the survivors stall {costs.stall_s:g} s and "
        f"lose the step in flight, a group of {costs.group_gpus} GPUs away {costs.heal_s:g} s"
    )


def format_table(rows: list[Goodput], costs: FailureCosts) -> str:
    """``simulate --failures``: one row per cluster size, the costs, the published figure."""
    header = ["gpus", "failures/day", "hours between", "restart-from-checkpoint", "live membership"]
    cells = [
        [
            f"{r.gpus:,}",
            f"{r.failures_per_day:.2f}",
            f"{r.hours_between:.2f}",
            f"{r.restart:.4%}",
            f"{r.live:.4%}",
        ]
        for r in rows
    ]
    widths = [max(len(c) for c in col) for col in zip(header, *cells, strict=True)]
    lines = [
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [header, *cells]
    ]
    return "\n".join(
        [
            "goodput under failures (expected share of wall time that is committed training)",
            *lines,
            describe(costs),
            reference_line(costs),
        ]
    )


def reference_line(costs: FailureCosts) -> str:
    """The published interruptions beside what the rate in use gives on that cluster."""
    ours = failures_per_day(LLAMA3.gpus, costs.failure_rate)
    return (
        f"{LLAMA3.source}: {LLAMA3.interruptions} unexpected interruptions in {LLAMA3.days:g} "
        f"days on {LLAMA3.gpus:,} GPUs, {LLAMA3.per_day:.2f} a day; --failure-rate "
        f"{costs.failure_rate:.4g} a GPU-hour gives {ours:.2f} a day there"
    )
