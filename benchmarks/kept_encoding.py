"""What the kept encoding of a checkpoint's replicated share buys: ``sync.save(wait=False)`` on
the training thread with it and without it, side by side in one process (issue 40's trade-off
between the line target of ``gradsync/checkpoint/`` and the every-step cost goal).

The kept encoding (``checkpoint.replicas.share_of`` and ``whole`` take the state's skeleton;
``packing`` then reuses the last snapshot's encoding of a share with the same skeleton, and the
owner list is kept per layout) is about 350 lines that exist only for speed
(docs/checkpoints.md, "What the kept encoding buys"). Without it (``skeleton`` replaced, for the
"walked" blocks only, by one that describes nothing, the path ``pack`` takes for a state it
cannot describe) every save walks and encodes the share afresh and balances its owners anew.

One rank (a one-process gloo group), ``bsp``, AdamW, the workload's own model; blocks of
``--block`` steps, each step followed by ``sync.save(DIR, wait=False)`` (the writer process
writes as in a run). The first ``WARMUP`` saves of a block are not timed (a "kept" block's
first save encodes afresh). The arms alternate, their order reversing repeat by repeat; the
table shows per arm the median over repeats of each block's median save and step, and the
median of the per-repeat differences and ratios.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from benchmarks.harness import REVERSE, Harness, interleave, machine, table
from gradsync.checkpoint import replicas
from gradsync.workloads import make_workload

ARMS = ("kept", "walked")
WARMUP = 5  # saves of a block not timed: the first encodes afresh either way
BATCH = 16  # gradsync run's default samples per worker


@contextmanager
def _walked() -> Iterator[list[int]]:
    """The kept encoding switched off: ``skeleton`` describes no state, so every share is
    walked, encoded and balanced afresh. Yields a counter of the calls it took, so a block can
    show that the saves went through the switch."""
    taken = replicas.skeleton
    calls = [0]

    def describes_nothing(tree: Any) -> None:
        calls[0] += 1

    replicas.skeleton = describes_nothing  # type: ignore[assignment]
    try:
        yield calls
    finally:
        replicas.skeleton = taken


class Block:
    """Steps of the workload, each followed by a save that does not wait for its file."""

    def __init__(self, workload: str, seed: int, directory: Path) -> None:
        self.w = make_workload(workload, seed=seed)
        self.model = self.w.build_model()
        opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.sync = gs.Synchronizer(self.model, opt, strategy="bsp")
        self.directory = directory
        self.step = 0

    def run(self, steps: int) -> tuple[float, float]:
        """Median seconds of a save and of a step (save excluded) over the timed part."""
        saves, computes = [], []
        for i in range(steps):
            t0 = time.perf_counter()
            with self.sync.step(samples=BATCH):
                self.w.loss(self.model, *self.w.batch(self.step, BATCH, 0, BATCH)).backward()
            t1 = time.perf_counter()
            self.sync.save(self.directory, wait=False)
            t2 = time.perf_counter()
            self.step += 1
            if i >= WARMUP:
                computes.append(t1 - t0)
                saves.append(t2 - t1)
        return statistics.median(saves), statistics.median(computes)


def measure(args: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with TemporaryDirectory(prefix="gradsync-kept-", dir=args.workdir) as tmp:
            block = Block(args.workload, args.seed, Path(tmp))
            block.run(WARMUP + 2)  # the first steps' one-off costs (the writer's start)

            def run(arm: str, repeat: int) -> tuple[float, float]:
                if arm == "kept":
                    return block.run(args.block)
                with _walked() as calls:
                    out = block.run(args.block)
                if calls[0] < args.block:  # not every save went through the switch
                    raise RuntimeError(f"walked block: {calls[0]} skeleton calls")
                return out

            rounds = interleave(ARMS, args.repeats, run, REVERSE, progress="kept_encoding: ")
            block.sync.save(block.directory)  # the last write and commit, then close
            block.sync.close()
    finally:
        dist.destroy_process_group()
    return {"rounds": rounds}


def render(args: Any, result: dict[str, Any], command: str) -> str:
    rounds = result["rounds"]

    def med(arm: str, i: int) -> float:
        return statistics.median(r[arm][i] for r in rounds)

    diffs = [r["walked"][0] - r["kept"][0] for r in rounds]
    ratios = [r["walked"][0] / r["kept"][0] for r in rounds]
    step = med("kept", 1)
    rows = [[arm, f"{med(arm, 0) * 1e6:.0f} us", f"{med(arm, 1) * 1e3:.1f} ms"] for arm in ARMS]
    return "\n".join(
        [
            "## What the kept encoding buys (issue 40)",
            "",
            f"`{command}` ({machine()}; {args.workload}, bsp, one rank, AdamW, "
            f"{args.repeats} repeats of {args.block}-step blocks, {WARMUP} saves a block "
            "untimed).",
            "",
            table(["encoding", "sync.save(wait=False), median", "step without the save"], rows),
            "",
            f"Without the kept encoding a save costs the training thread "
            f"**{statistics.median(diffs) * 1e6:.0f} us more** (median of per-repeat "
            f"differences; {min(diffs) * 1e6:.0f} to {max(diffs) * 1e6:.0f} us), "
            f"{statistics.median(ratios):.2f}x the kept save, or "
            f"{statistics.median(diffs) / step:.1%} of a step: what a checkpoint every step "
            "would add to its cost if those lines were deleted.",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    h = Harness("benchmarks.kept_encoding", __doc__, repeats=6)
    p = h.parser
    p.add_argument("--workload", default="charlm", help="charlm | mlp (default %(default)s)")
    p.add_argument("--block", type=int, default=60, help="steps per block (%(default)s)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workdir", default=None, help="where the checkpoints go (a temporary dir)")
    args = h.parse(argv, repeats=2, block=WARMUP + 5)
    if args.block <= WARMUP:
        h.error(f"--block must exceed the {WARMUP} untimed saves, got {args.block}")
    result = measure(args)
    h.finish(render(args, result, h.command()))


if __name__ == "__main__":
    sys.exit(main())
