"""local:H and diloco:H under live membership, without torchft: a period's average that the
quorum does not commit leaves this replica's parameters (and DiLoCo's global copy and outer
momentum) as its own local steps left them; a committed one applies the quorum's mean.
docs/membership.md ("A group lost during a period ..."); the e2e run of a group lost
mid-period is tests/e2e/test_replica_groups.py's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from gradsync.compression import parse_compression
from gradsync.strategies.base import StepPlan, SyncContext
from gradsync.strategies.local_sgd import DiLoCo, LocalSGD, Periodic

pytestmark = pytest.mark.unit

PERIOD = 2


class Quorum:
    """A quorum whose all-reduce hands back a mean of its own (a peer's values), and whose
    commit decision is given: what a lost participant makes torchft's ``should_commit`` say."""

    def __init__(self, commits: bool) -> None:
        self.commits = commits
        self.started: list[int] = []

    def start_step(self, step: int) -> None:
        self.started.append(step)

    def allreduce(
        self, tensor: torch.Tensor, wire: torch.dtype | None = None
    ) -> torch.futures.Future[torch.Tensor]:
        assert wire is None  # uncompressed
        tensor.mul_(0.5)  # in place, as torchft's: the "mean" differs from this replica's own
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(tensor)
        return done

    def commit(self, step: int) -> bool:
        return self.commits


def _period(strategy: Periodic, commits: bool) -> tuple[nn.Module, list[torch.Tensor]]:
    """One period of local SGD steps on a small model through ``strategy`` and a ``Quorum``;
    the model, and its parameters as the period's last local step left them (before the
    average: the optimizer's step hook sees them)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stepped: list[list[torch.Tensor]] = []
    optimizer.register_step_post_hook(
        lambda *_: stepped.append([p.detach().clone() for p in model.parameters()])
    )
    quorum = Quorum(commits)
    strategy.setup(
        SyncContext(
            model=model,
            optimizer=optimizer,
            group=None,
            compressor=parse_compression(None),
            bucket_mb=25.0,
            membership=quorum,
        )
    )
    for step in range(PERIOD):
        strategy.begin_step(StepPlan(step=step))
        model(torch.randn(8, 4)).square().mean().backward()
        strategy.update(step, strategy.gradients_ready(step))
    assert quorum.started == [0]  # one quorum a period, at its first step
    assert len(stepped) == PERIOD
    return model, stepped[-1]


@pytest.mark.parametrize("make", [lambda: LocalSGD(PERIOD), lambda: DiLoCo(PERIOD)])
def test_an_average_not_committed_keeps_this_replicas_own_parameters(
    make: Callable[[], Periodic],
) -> None:
    strategy = make()
    model, own = _period(strategy, commits=False)
    for p, mine in zip(model.parameters(), own, strict=True):
        assert torch.equal(p.detach(), mine)
    if isinstance(strategy, DiLoCo):
        # its global copy is still the period's start (the model as built), no outer step
        torch.manual_seed(0)
        start = torch.cat([p.detach().flatten() for p in nn.Linear(4, 3).parameters()])
        state = strategy.state_dict()
        assert torch.equal(state["global"], start)
        assert state["outer_optimizer"]["state"] == {}


@pytest.mark.parametrize("make", [lambda: LocalSGD(PERIOD), lambda: DiLoCo(PERIOD)])
def test_a_committed_average_applies_the_quorums_mean(make: Callable[[], Periodic]) -> None:
    model, own = _period(make(), commits=True)
    assert any(
        not torch.equal(p.detach(), mine) for p, mine in zip(model.parameters(), own, strict=True)
    )
