"""Streaming DiLoCo's exchanges posted once the step gate opens, against each posted at its own
step (issue 46).

An exchange with a delay (``diloco:H:F:TAU``, TAU >= 1) is needed only TAU steps after it
starts. Posted at its own step, it waits there for the step gate (every rank back from its own
code), so the rank that arrives first idles until the last arrives. Posted once the gate has
opened (``DiLoCo._posts_when_open``, the default since 2026-12-01), that rank goes on training
and waits, if at all, where the exchange is applied: the TAU steps absorb a peer's lateness
that is made up before then.

Two gloo ranks on loopback train the mlp (1M parameters, 16 samples a rank) under
``diloco:12:2:5`` (outer lr 1, no momentum) with fp16, ``--steps`` steps, in two settings:

- **even**: nothing injected (what posting later costs where nobody is late);
- **stragglers taking turns**: one step in four slowed ``FACTOR`` times (the Synchronizer's
  ``slow``, proportional to the rank's own compute), rank 0 and rank 1 in turn.

The baseline is the same strategy with ``_posts_when_open`` answering no (``PostedAtItsStep``:
the behaviour before 2026-12-01). Per repeat both variants of a setting run one after the other
in rotated order, timed from step ``WARMUP`` to the last on every rank between barriers; the
figure is the median over repeats of the ratio of their times, with the lowest and highest.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from benchmarks.harness import Harness, machine, order, table
from gradsync.strategies import DiLoCo
from gradsync.testing import run_ranks
from gradsync.workloads import make_workload

PER_RANK = 16
PARAMS = 1_000_000
WARMUP = 4
FACTOR = 10.0
SETTINGS = ("even", "stragglers taking turns")
VARIANTS = ("posted at its step", "posted once the gate opens")


class PostedAtItsStep(DiLoCo):
    """The baseline: every exchange posted at the end of the step it starts after, once every
    rank has arrived there (the step gate joined at that step's end)."""

    def _posts_when_open(self, ctx: Any) -> bool:
        return False


def _strategy(variant: str) -> DiLoCo:
    kind = PostedAtItsStep if variant == VARIANTS[0] else DiLoCo
    return kind(12, outer_lr=1.0, outer_momentum=0.0, fragments=2, delay=5)


def _slow(setting: str, steps: int) -> str | None:
    """One step in four slowed, rank 0 and rank 1 in turn."""
    if setting == SETTINGS[0]:
        return None
    return ",".join(f"{(s // 4) % 2}:{FACTOR:g}@{s}-{s + 1}" for s in range(WARMUP, steps, 4))


def _seconds(rank: int, world: int, setting: str, variant: str, steps: int) -> float:
    """One run's time from step ``WARMUP`` to its end, the same span on every rank."""
    w = make_workload("mlp", seed=7, params=PARAMS)
    model = w.build_model()
    opt = w.make_optimizer(model, w.default_lr)
    sync = gs.Synchronizer(
        model, opt, strategy=_strategy(variant), compression="fp16", slow=_slow(setting, steps)
    )
    t0 = 0.0
    for step in range(steps):
        if step == WARMUP:
            dist.barrier()
            t0 = time.perf_counter()
        with sync.step(samples=PER_RANK):
            lo = rank * PER_RANK
            x, y = w.batch(step, PER_RANK * world, lo, lo + PER_RANK)
            w.loss(model, x, y).backward()
    dist.barrier()
    took = time.perf_counter() - t0
    sync.report()
    sync.close()
    return took


def measure(rank: int, world: int, repeats: int, steps: int) -> list[dict[str, float]]:
    """Per repeat, each (setting, variant)'s seconds, keyed ``setting|variant``."""
    torch.set_num_threads(1)
    out = []
    for r in range(repeats):
        got = {}
        for setting in SETTINGS:
            for variant in order(VARIANTS, r):
                got[f"{setting}|{variant}"] = _seconds(rank, world, setting, variant, steps)
        out.append(got)
    return out


def render(reps: list[dict[str, float]], steps: int, command: str) -> str:
    rows = []
    for setting in SETTINGS:
        base = [rep[f"{setting}|{VARIANTS[0]}"] for rep in reps]
        new = [rep[f"{setting}|{VARIANTS[1]}"] for rep in reps]
        ratios = [n / b for n, b in zip(new, base, strict=True)]
        rows.append(
            [
                setting,
                f"{statistics.median(base) * 1000 / (steps - WARMUP):.1f}",
                f"{statistics.median(new) * 1000 / (steps - WARMUP):.1f}",
                f"{statistics.median(ratios):.2f}",
                f"{min(ratios):.2f}-{max(ratios):.2f}",
            ]
        )
    head = (
        "setting | posted at its step, ms/step | posted once the gate opens, ms/step | "
        "time, once open / at its step | lowest-highest"
    )
    return (
        f"`diloco:12:2:5:outer_lr=1:outer_momentum=0` + fp16, 2 gloo ranks on loopback, the "
        f"mlp ({PARAMS / 1e6:g}M parameters, {PER_RANK} samples a rank), steps {WARMUP} to "
        f"{steps}; {len(reps)} repeats, medians; stragglers: one step in four {FACTOR:g}x "
        f"its compute, the ranks in turn.\n\n{table(head, rows)}\n\n{machine()}. "
        f"Command: `{command}`"
    )


def main(argv: list[str] | None = None) -> int:
    h = Harness("benchmarks.posting", __doc__, repeats=5)
    h.parser.add_argument("--steps", type=int, default=120, help="steps a run (%(default)s)")
    args = h.parse(argv, steps=24, repeats=1)
    if args.steps <= WARMUP + 4:
        h.error(f"--steps must be more than {WARMUP + 4}, got {args.steps}")
    reps = run_ranks(measure, 2, args.repeats, args.steps, timeout_s=1200)[0]
    h.finish(render(reps, args.steps, h.command()), skip="a smoke run" if args.quick else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
