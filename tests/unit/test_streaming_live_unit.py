"""Streaming DiLoCo under live membership, without torchft: one quorum per fragment exchange,
joined with nothing in flight (at the run's first step and the step after each exchange was
applied), committed at the step the exchange is applied (TAU steps after it started); an
exchange not committed leaves its fragment as the local steps left it (global copy and outer
momentum too); a replacement that heals from a peer at a quorum takes its whole streaming
state, and the replicas' fragments are bitwise equal after each applied exchange.
docs/membership.md ("Streaming DiLoCo"); the e2e run is tests/e2e/test_replica_groups.py's."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gradsync.checks.diagnose import END
from gradsync.compression import parse_compression
from gradsync.flat import flatten
from gradsync.strategies.base import StepPlan, SyncContext
from gradsync.strategies.local_sgd import DiLoCo

pytestmark = pytest.mark.unit

#: H=6, F=2, TAU=1: fragment 0 starts after steps 2, 8, ... (applied at 3, 9, ...), fragment 1
#: after steps 5, 11, ... (applied at 6, 12, ...)
SPEC = {"period": 6, "fragments": 2, "delay": 1}


class Replica:
    """One replica group: a small model, its inner optimizer and its streaming DiLoCo."""

    def __init__(
        self, membership: object, weights: int = 0, data: int = 0, *, keep_local: bool = False
    ) -> None:
        torch.manual_seed(weights)
        self.model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.strategy = DiLoCo(**SPEC, keep_local=keep_local)
        self.strategy.setup(
            SyncContext(
                model=self.model,
                optimizer=self.optimizer,
                group=None,
                compressor=parse_compression(None),
                bucket_mb=25.0,
                membership=membership,  # type: ignore[arg-type]
            )
        )
        self.data = torch.Generator().manual_seed(100 + data)  # its own data

    def step(self, step: int) -> None:
        self.strategy.begin_step(StepPlan(step=step))
        x = torch.randn(8, 4, generator=self.data)
        self.model(x).square().mean().backward()
        self.strategy.update(step, self.strategy.gradients_ready(step))

    def fragment(self, index: int) -> torch.Tensor:
        return flatten(self.strategy._fragment_params[index]).clone()

    def heal_from(self, donor: Replica) -> None:
        """What torchft's healing loads (``ft_manager.ReplicaState``), copied: a donor's
        tensors must not become this replica's."""
        self.model.load_state_dict(copy.deepcopy(donor.model.state_dict()))
        self.optimizer.load_state_dict(copy.deepcopy(donor.optimizer.state_dict()))
        self.strategy.load_state_dict(copy.deepcopy(donor.strategy.state_dict()))


class Quorum:
    """torchft's Manager as the strategy sees it, holding one quorum at a time (as torchft 0.2
    does: ``start_quorum`` forgets an undecided one), for one replica (``pair=None``: its
    all-reduce hands back half of what it was given, a mean that differs from its own) or
    for one of two replicas stepped in lockstep (the real mean, once both have sent)."""

    def __init__(self, commits: bool = True, pair: list[Replica] | None = None) -> None:
        self.commits, self.pair = commits, pair
        self.started: list[int] = []
        self.decided: list[int] = []
        self.open = False
        self.sent: list[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]]] = []
        #: set by a test: the replica this quorum belongs to, and a donor to heal it from
        self.replica: Replica | None = None
        self.heal_from: Replica | None = None

    def start_step(self, step: int) -> None:
        assert not self.open, f"a quorum joined at {step} while one was undecided"
        if self.replica is not None:
            # what this replica would send a replacement: nothing in flight
            assert self.replica.strategy.state_dict()["streaming"]["pending"] == []
        if self.heal_from is not None:
            assert self.replica is not None
            self.replica.heal_from(self.heal_from)
            self.heal_from = None
        self.started.append(step)
        self.open = True

    def allreduce(
        self,
        tensor: torch.Tensor,
        wire: torch.dtype | None = None,
        after: Callable[[], object] | None = None,
    ) -> torch.futures.Future[torch.Tensor]:
        assert wire is None and after is None  # uncompressed, groups of one rank
        assert self.open, "an exchange with no quorum joined"
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        if self.pair is None:
            tensor.mul_(0.5)
            done.set_result(tensor)
        else:
            self.sent.append((tensor, done))
        return done

    def commit(self, step: int) -> bool:
        assert self.open, f"a commit at {step} with no quorum joined"
        self.open = False
        self.decided.append(step)
        return self.commits


class PairedQuorums:
    """Two replicas' quorums: an exchange completes once both replicas sent it."""

    def __init__(self) -> None:
        self.quorums = [Quorum(pair=[]), Quorum(pair=[])]

    def settle(self) -> None:
        a, b = (q.sent for q in self.quorums)
        while a and b:
            (ta, fa), (tb, fb) = a.pop(0), b.pop(0)
            mean = (ta + tb) / 2
            for tensor, future in ((ta, fa), (tb, fb)):
                tensor.copy_(mean)
                future.set_result(tensor)


def test_one_quorum_an_exchange_joined_with_nothing_in_flight() -> None:
    quorum = Quorum()
    replica = Replica(quorum)
    quorum.replica = replica
    for step in range(12):
        replica.step(step)
    # joined at the first step and after each exchange was applied (3, 6, 9); decided where
    # each is applied, TAU=1 after its start
    assert quorum.started == [0, 4, 7, 10]
    assert quorum.decided == [3, 6, 9]
    # the end: the exchange started at 11 is applied (due 12), then every fragment at once,
    # through a quorum of its own (none was open: the run ended at an exchange)
    replica.strategy.finalize()
    assert quorum.started == [0, 4, 7, 10, END]
    assert quorum.decided == [3, 6, 9, 12, END]


@pytest.mark.parametrize("commits", [False, True])
def test_an_exchange_not_committed_leaves_its_fragment_as_the_local_steps_did(
    commits: bool,
) -> None:
    quorum = Quorum(commits=commits)
    replica = Replica(quorum)
    for step in range(3):  # fragment 0's exchange starts after step 2
        replica.step(step)
    start = copy.deepcopy(replica.strategy.state_dict())
    stepped: list[torch.Tensor] = []
    hook = replica.optimizer.register_step_post_hook(lambda *_: stepped.append(replica.fragment(0)))
    replica.step(3)  # its local step, then the exchange applied (or not) at its due step
    hook.remove()
    state = replica.strategy.state_dict()
    kept = torch.equal(replica.fragment(0), stepped[-1])
    same_global = torch.equal(state["global"], start["global"])
    assert kept == same_global == (not commits)
    assert (state["outer_optimizer"]["state"] == {}) == (not commits)
    assert quorum.decided == [3]


@pytest.mark.parametrize("commits", [False, True])
def test_under_keep_a_committed_exchange_adds_the_local_steps_taken_while_in_flight(
    commits: bool,
) -> None:
    quorum = Quorum(commits=commits)
    replica = Replica(quorum, keep_local=True)
    for step in range(3):  # fragment 0's exchange starts after step 2's local step
        replica.step(step)
    sent = replica.fragment(0)
    stepped: list[torch.Tensor] = []
    hook = replica.optimizer.register_step_post_hook(lambda *_: stepped.append(replica.fragment(0)))
    replica.step(3)  # the local step taken while it was in flight, then its due step
    hook.remove()
    new_global = replica.strategy.state_dict()["global"][: sent.numel()]
    # committed: the new global copy plus that local step; not committed: the local steps
    expected = (stepped[-1] - sent) + new_global if commits else stepped[-1]
    assert torch.equal(replica.fragment(0), expected)
    assert not torch.equal(replica.fragment(0), new_global)  # the local step is not dropped
    assert quorum.decided == [3]


def test_a_replacement_heals_at_a_quorum_and_applied_fragments_stay_bitwise_equal() -> None:
    """Replica 1 is replaced at step 7 (a quorum's first step) by a fresh one, built from
    other weights, which heals from replica 0 there; after every applied exchange the two
    replicas' fragment and global copy agree bitwise, before and after the healing."""
    paired = PairedQuorums()
    # the same weights at the start (torchft's first quorum, or the initial broadcast), each
    # replica its own data
    replicas = [Replica(q, data=i) for i, q in enumerate(paired.quorums)]
    for quorum, replica in zip(paired.quorums, replicas, strict=True):
        quorum.replica = replica
    checked = 0
    for step in range(20):
        if step == 7:
            fresh = Replica(paired.quorums[1], weights=5, data=7)
            paired.quorums[1].replica, paired.quorums[1].heal_from = fresh, replicas[0]
            replicas[1] = fresh
        for replica in replicas:
            replica.step(step)
            paired.settle()
        if step in (3, 9, 15):  # fragment 0 applied
            checked += 1
            assert torch.equal(replicas[0].fragment(0), replicas[1].fragment(0)), step
        if step in (6, 12, 18):  # fragment 1 applied
            checked += 1
            assert torch.equal(replicas[0].fragment(1), replicas[1].fragment(1)), step
        if step in (3, 6, 9, 12, 15, 18):
            states = [r.strategy.state_dict() for r in replicas]
            assert torch.equal(states[0]["global"], states[1]["global"]), step
    assert checked == 6
    assert paired.quorums[0].started == [0, 4, 7, 10, 13, 16, 19]
    assert paired.quorums[1].started == [0, 4, 7, 10, 13, 16, 19]
