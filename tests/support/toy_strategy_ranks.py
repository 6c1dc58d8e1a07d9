"""A strategy written against the protocol alone, and rank functions that run it (module level,
so spawned ranks can import them). It averages the parameters after every local step: with
plain SGD that is BSP's trajectory, since the mean of ``p - lr * g_r`` is ``p - lr * mean(g)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.strategies import StepOutcome, StepPlan, Strategy, SyncContext
from gradsync.workloads import make_workload


class AverageEveryStep(Strategy):
    name = "average-every-step"

    def setup(self, ctx: SyncContext) -> None:
        self.ctx, self.averages = ctx, 0
        self.params = [p for p in ctx.model.parameters() if p.requires_grad]

    def begin_step(self, plan: StepPlan) -> None:
        self.ctx.optimizer.zero_grad(set_to_none=True)

    def update(self, step: int, outcome: StepOutcome) -> StepOutcome:
        self.ctx.optimizer.step()
        world = dist.get_world_size(self.ctx.group)
        with torch.no_grad():
            for p in self.params:
                dist.all_reduce(p, group=self.ctx.group)
                p.div_(world)
                outcome.bytes_sent += p.numel() * p.element_size()
        self.averages += 1
        return outcome

    def state_dict(self) -> dict[str, Any]:
        return {"averages": self.averages}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averages = int(state["averages"])


PER_RANK = 4


def _train(
    rank: int, world: int, strategy: Any, steps: range, ckpt: str | None, save_at: int = -1
) -> tuple[gs.Synchronizer, list[float]]:
    w = make_workload("mlp", seed=3, params=5000, dtype="float64")
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = gs.Synchronizer(model, opt, strategy=strategy, check_every=2)
    if ckpt is not None and steps.start > 0:
        resumed = sync.load(ckpt)
        assert resumed is not None and resumed["step"] == steps.start, resumed
    losses = []
    for step in steps:
        with sync.step() as s:
            x, y = w.batch(step, PER_RANK * world, rank * PER_RANK, (rank + 1) * PER_RANK)
            loss = w.loss(model, x, y)
            loss.backward()
            s.loss = loss
        losses.append(float(loss))
        if ckpt is not None and step + 1 == save_at:
            sync.save(ckpt)
    return sync, losses


def _params(sync: gs.Synchronizer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in sync.model.parameters()])


def toy_lifecycle(rank: int, world: int, ckpt: str, steps: int, save_at: int) -> dict[str, Any]:
    """The toy strategy straight through (saving on the way), then resumed from that save,
    and BSP for reference; each with its report."""
    straight, losses = _train(rank, world, AverageEveryStep(), range(steps), ckpt, save_at)
    straight_report = straight.report()
    toy_state = straight.strategy.state_dict()
    straight.close()
    resumed, _ = _train(rank, world, AverageEveryStep(), range(save_at, steps), ckpt)
    resumed_report = resumed.report()
    resumed_state = resumed.strategy.state_dict()
    resumed.close()
    bsp, _ = _train(rank, world, "bsp", range(steps), None)
    bsp.report()
    bsp.close()
    return {
        "losses": losses,
        "straight": _params(straight),
        "resumed": _params(resumed),
        "bsp": _params(bsp),
        "toy_state": toy_state,
        "resumed_state": resumed_state,
        "steps_reported": [r.steps for r in (straight_report, resumed_report)],
        "ranks_reported": len(straight_report.ranks),
        "bytes": straight_report.ranks[rank].bytes,
        "final_loss": straight_report.final_loss,
        "checkpoints": sorted(p.name for p in Path(ckpt).iterdir()),
    }
