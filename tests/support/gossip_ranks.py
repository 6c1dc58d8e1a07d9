"""Rank bodies for gossip averaging (``gossip:H``), importable by spawned ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.workloads import make_workload
from tests.support.ranks import flat_params

PER_RANK = 4
#: the group-wide collectives a gossip step must not post (its pair exchange is send/recv)
GROUP_WIDE = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "barrier")


class _Counted:
    """Counts calls of torch.distributed's group-wide collectives while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[str] = []
        self._originals = {name: getattr(dist, name) for name in GROUP_WIDE}
        for name, original in self._originals.items():
            setattr(dist, name, self._wrap(name, original))

    def restore(self) -> None:
        """torch.distributed's own functions back (another run in this process counts anew)."""
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _wrap(self, name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.calls.append(name)
            return original(*args, **kwargs)

        return counted


def train(
    rank: int,
    world: int,
    period: int,
    steps: int,
    piece_bytes: int | None = None,
    strategy: str | None = None,
) -> dict[str, Any]:
    """SGD on the float64 mlp, each rank its own shard; the parameters after every step, the
    group-wide collectives posted during the steps, and the final parameters and summary.
    ``piece_bytes``: the pair exchange's pieces (small: the 24 KB model goes in several);
    ``strategy``: ``gossip:{period}`` unless given (``noloco:...``)."""
    if piece_bytes is not None:
        from gradsync.strategies import gossip

        gossip.PIECE_BYTES = piece_bytes
    w = make_workload("mlp", seed=5, params=3000, dtype="float64")
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    counted = _Counted()
    sync = gs.Synchronizer(model, opt, strategy=strategy or f"gossip:{period}", timeout_s=20)
    after: list[torch.Tensor] = []
    counted.on = True
    for step in range(steps):
        with sync.step(samples=PER_RANK):
            x, y = w.batch(step, PER_RANK * world, rank * PER_RANK, (rank + 1) * PER_RANK)
            w.loss(model, x, y).backward()
        after.append(flat_params(model))
    counted.on = False
    counted.restore()
    report = sync.report()
    sync.close()
    return {
        "after": after,
        "collectives": counted.calls,
        "final": flat_params(model),
        "summary": sync.strategy.summary(),
        "bytes": [r.bytes for r in report.records if r.rank == rank],
    }


def train_each(
    rank: int, world: int, period: int, steps: int, strategies: list[str]
) -> list[dict[str, Any]]:
    """``train`` under each strategy in turn, in one process group (one start-up for all)."""
    return [train(rank, world, period, steps, None, strategy) for strategy in strategies]


def checkpointed(
    rank: int,
    world: int,
    directory: str,
    resume: bool,
    strategy: str = "gossip:3",
    compression: str = "none",
) -> torch.Tensor:
    """8 steps of ``strategy`` saving after step 4 (or resumed from that checkpoint for steps
    4-7); the parameters before the final average (a round after step 8 leaves pairs alike)."""
    w = make_workload("mlp", seed=5, params=3000, dtype="float64")
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sync = gs.Synchronizer(model, opt, strategy=strategy, compression=compression, timeout_s=20)
    first = 0
    if resume:
        loaded = sync.load(directory)
        assert loaded is not None
        first = loaded["step"]
    for step in range(first, 8):
        with sync.step(samples=PER_RANK):
            x, y = w.batch(step, PER_RANK * world, rank * PER_RANK, (rank + 1) * PER_RANK)
            w.loss(model, x, y).backward()
        if step == 3 and not resume:
            sync.save(directory)
    params = flat_params(model)
    sync.close()
    return params


def partner_asleep(rank: int, world: int, spec: str, sleep_s: float) -> dict[str, Any]:
    """``spec`` (gossip:1, zero:2) with ``timeout_s=2``: rank 1 sleeps ``sleep_s`` inside its
    second step's block; what each rank's step raised, and after how long."""
    import time

    import gradsync as gs
    from gradsync.errors import SyncTimeoutError

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), spec, timeout_s=2.0)
    out: dict[str, Any] = {"raised": None}
    started = time.monotonic()
    try:
        for step in range(3):
            with sync.step():
                if rank == 1 and step == 1:  # before backward: zero:2's rounds go in it
                    time.sleep(sleep_s)
                model(torch.ones(2, 4)).sum().backward()
    except SyncTimeoutError as exc:
        out["raised"] = str(exc)
    out["seconds"] = time.monotonic() - started
    sync.close()
    return out


def slow_partner(rank: int, world: int, sleep_s: float) -> list[tuple[int, float, float]]:
    """gossip:2, 4 steps; rank 1 sleeps ``sleep_s`` in every step's block. Each of this rank's
    report records as (step, idle, comm)."""
    import time

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "gossip:2")
    for _ in range(4):
        with sync.step():
            if rank == 1:
                time.sleep(sleep_s)
            model(torch.ones(2, 4)).sum().backward()
    report = sync.report()
    sync.close()
    return [(r.step, r.idle, r.comm) for r in report.records if r.rank == rank]


def compressed_round(rank: int, world: int, compression: str, dtype: str) -> dict[str, Any]:
    """gossip:2 with ``compression``: step 0 at lr 0.05 (the ranks drift apart; no round), step
    1 at lr 0 (the parameters stay as they were) and its round; the parameters before and after
    that round, its bytes, and the final model after ``report()``."""
    w = make_workload("mlp", seed=5, params=3000, dtype=dtype)
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = gs.Synchronizer(model, opt, strategy="gossip:2", compression=compression, timeout_s=20)
    after = []
    for step in range(2):
        if step == 1:
            opt.param_groups[0]["lr"] = 0.0
        with sync.step(samples=PER_RANK):
            x, y = w.batch(step, PER_RANK * world, rank * PER_RANK, (rank + 1) * PER_RANK)
            w.loss(model, x, y).backward()
        after.append(flat_params(model))
    report = sync.report()
    sync.close()
    return {
        "before": after[0],
        "after": after[1],
        "bytes": [r.bytes for r in report.records if r.rank == rank],
        "final": flat_params(model),
    }


def compressed_noloco(rank: int, world: int, steps: int) -> dict[str, Any]:
    """noloco:2 with int4 on float32 parameters: each step's bytes and the final model."""
    w = make_workload("mlp", seed=5, params=3000)
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = gs.Synchronizer(model, opt, strategy="noloco:2", compression="int4", timeout_s=20)
    for step in range(steps):
        with sync.step(samples=PER_RANK):
            x, y = w.batch(step, PER_RANK * world, rank * PER_RANK, (rank + 1) * PER_RANK)
            w.loss(model, x, y).backward()
    report = sync.report()
    sync.close()
    return {
        "bytes": [r.bytes for r in report.records if r.rank == rank],
        "final": flat_params(model),
        "numel": flat_params(model).numel(),
    }
