"""local:H, diloco:H and streaming DiLoCo under live membership with replica groups of several
ranks, without torchft or processes: 2 groups of 2 ranks, each rank a thread with its own
strategy, its own data and stand-ins for its group's sum (``local_sgd.group_sum``) and for its
torchft Manager (rank R meets rank R of the other group). A period's exchange is the mean over
all four ranks, and every rank of every group ends it with the same bits
(docs/membership.md, "Replica groups of several ranks"); the e2e run is
tests/e2e/test_replica_groups.py's."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from gradsync.compression import parse_compression
from gradsync.strategies import local_sgd
from gradsync.strategies.base import StepPlan, SyncContext
from gradsync.strategies.local_sgd import DiLoCo, GroupSum, LocalSGD, Periodic

pytestmark = pytest.mark.unit

GROUPS, RANKS = 2, 2
#: the last ``_train``'s stand-in Managers, by (group, rank)
quorums: dict[tuple[int, int], Quorum] = {}


class Meeting:
    """Threads that sum a tensor each, in place, in a fixed order: every one gets the same
    bits, as from gloo's all-reduce."""

    def __init__(self, size: int) -> None:
        self._barrier = threading.Barrier(size, timeout=30)
        self._held: list[torch.Tensor] = [torch.empty(0)] * size

    def sum(self, slot: int, tensor: torch.Tensor) -> None:
        self._held[slot] = tensor.clone()
        self._barrier.wait()
        total = self._held[0].clone()
        for other in self._held[1:]:
            total += other
        self._barrier.wait()  # everyone has read before anyone's next sum writes
        tensor.copy_(total)


class Quorum:
    """One rank's torchft Manager: the group's own sum first (``after``), then the mean with
    the same rank of the other groups, every exchange committed."""

    def __init__(self, meeting: Meeting, group: int) -> None:
        self.meeting, self.group = meeting, group
        self.started: list[int] = []
        self.wires: list[torch.dtype | None] = []  # each exchange's ``wire``

    def start_step(self, step: int) -> None:
        self.started.append(step)

    def allreduce(
        self,
        tensor: torch.Tensor,
        wire: torch.dtype | None = None,
        after: Callable[[], object] | None = None,
    ) -> torch.futures.Future[torch.Tensor]:
        self.wires.append(wire)
        if after is not None:
            after()
        if wire is None:
            self.meeting.sum(self.group, tensor)
            tensor.div_(GROUPS)  # torchft's mean: a sum, then 1/participants
        else:  # as ``TorchftMembership.allreduce``: the shares cast, summed, cast back
            sent = tensor.div(GROUPS).to(wire)
            self.meeting.sum(self.group, sent)
            tensor.copy_(sent)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(tensor)
        return done

    def commit(self, step: int) -> bool:
        return True


def _group_sums() -> list[GroupSum]:
    """Each rank's stand-in for ``group_sum``, in the order (group, rank)."""
    meetings = [Meeting(RANKS) for _ in range(GROUPS)]

    def of(group: int, rank: int) -> GroupSum:
        def launch(flat: torch.Tensor) -> Callable[[], object]:
            return lambda: meetings[group].sum(rank, flat)

        return GroupSum(RANKS, launch)

    return [of(g, r) for g in range(GROUPS) for r in range(RANKS)]


def _train(
    make: Callable[[], Periodic],
    steps: int,
    monkeypatch: pytest.MonkeyPatch,
    compression: str | None = None,
) -> tuple[list[nn.Module], list[list[list[torch.Tensor]]]]:
    """``steps`` steps on every rank of every group, each rank in a thread: the models, and
    each rank's parameters after each of its local steps (before any exchange)."""
    sums = iter(_group_sums())
    monkeypatch.setattr(local_sgd, "group_sum", lambda group: next(sums))
    meetings = [Meeting(GROUPS) for _ in range(RANKS)]  # rank R of each group meets there
    models, stepped, runs = [], [], []
    quorums.clear()
    for group in range(GROUPS):
        for rank in range(RANKS):
            torch.manual_seed(0)  # one start everywhere, as after the initial broadcast
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            own: list[list[torch.Tensor]] = []
            optimizer.register_step_post_hook(
                lambda *_, m=model, o=own: o.append([p.detach().clone() for p in m.parameters()])
            )
            strategy = make()
            ctx = SyncContext(
                model=model,
                optimizer=optimizer,
                group=None,
                compressor=parse_compression(compression),
                bucket_mb=25.0,
                membership=quorums.setdefault((group, rank), Quorum(meetings[rank], group)),
            )
            strategy.setup(ctx)  # in this thread: the stand-in sums are taken in order
            data = torch.Generator().manual_seed(10 * group + rank)
            models.append(model)
            stepped.append(own)
            runs.append((strategy, model, data))

    def run(strategy: Periodic, model: nn.Module, data: torch.Generator) -> None:
        for step in range(steps):
            strategy.begin_step(StepPlan(step=step))
            model(torch.randn(8, 4, generator=data)).square().mean().backward()
            strategy.update(step, strategy.gradients_ready(step))

    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        for done in [pool.submit(run, *r) for r in runs]:
            done.result(timeout=60)
    return models, stepped


def _assert_every_rank_holds_the_mean(
    tensors: list[list[torch.Tensor]], own: list[list[torch.Tensor]], atol: float = 1e-6
) -> None:
    """Every rank's ``tensors`` are the same bits, and the mean of the ranks' ``own`` (within
    ``atol``; ``rtol`` 1e-6 where ``atol`` is the default, 0 otherwise)."""
    for held in tensors[1:]:
        for a, b in zip(tensors[0], held, strict=True):
            assert torch.equal(a, b)
    for i, value in enumerate(tensors[0]):
        mean = torch.stack([o[i] for o in own]).mean(0)
        torch.testing.assert_close(value, mean, rtol=1e-6 if atol == 1e-6 else 0, atol=atol)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "make",
    # DiLoCo's outer SGD at lr 1 without momentum lands on the mean of the ranks' parameters
    [lambda: LocalSGD(2), lambda: DiLoCo(2, outer_lr=1.0, outer_momentum=0.0)],
    ids=["local", "diloco"],
)
def test_a_periods_exchange_is_the_mean_over_every_rank_of_every_group(
    make: Callable[[], Periodic], monkeypatch: pytest.MonkeyPatch
) -> None:
    models, stepped = _train(make, 2, monkeypatch)
    # the ranks trained apart during the period (their own data) ...
    assert not torch.equal(stepped[0][-1][0], stepped[1][-1][0])
    # ... and its exchange leaves every rank with the mean of their last local steps
    params = [[p.detach() for p in m.parameters()] for m in models]
    _assert_every_rank_holds_the_mean(params, [own[-1] for own in stepped])


@pytest.mark.timeout(60)
def test_a_streaming_fragments_exchange_is_the_mean_over_every_rank_of_every_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``diloco:4:2:1`` split by layers: fragment 0 (the first layer) starts its exchange after
    step 1 and is applied after step 2, replaced by the mean of the ranks' step-1 values."""

    def make() -> Periodic:
        return DiLoCo(4, outer_lr=1.0, outer_momentum=0.0, fragments=2, delay=1, split="layers")

    models, stepped = _train(make, 3, monkeypatch)
    first = [[p.detach() for p in m[0].parameters()] for m in models]  # type: ignore[index]
    _assert_every_rank_holds_the_mean(first, [own[1][:2] for own in stepped])
    # the other fragment is still each rank's own
    assert not torch.equal(models[0][1].weight, models[1][1].weight)  # type: ignore[index]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "make",
    [lambda: LocalSGD(2), lambda: DiLoCo(2, outer_lr=1.0, outer_momentum=0.0)],
    ids=["local", "diloco"],
)
def test_through_fp16_a_periods_exchange_travels_cast_and_lands_on_the_mean(
    make: Callable[[], Periodic], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compression='fp16'``: each replica's share of the quorum's mean goes as fp16 (local:H
    sends its change since the last synchronization, as it does through any lossy
    compressor), every rank of every group ends with the same bits, within fp16's rounding
    of the mean of the ranks' last local steps."""
    models, stepped = _train(make, 2, monkeypatch, compression="fp16")
    assert {w for q in quorums.values() for w in q.wires} == {torch.float16}
    params = [[p.detach() for p in m.parameters()] for m in models]
    _assert_every_rank_holds_the_mean(params, [own[-1] for own in stepped], atol=1e-4)
    mean = torch.stack([own[-1][0] for own in stepped]).mean(0)
    assert not torch.equal(params[0][0], mean)  # it did go through fp16
