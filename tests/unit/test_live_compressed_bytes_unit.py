"""A compressor's bytes across the quorum (live membership) are counted at the step that sends
them, under ``diloco:H`` too: there the compressor's hook runs on the exchange thread, after the
strategy has started the exchange, so bytes read right after the start missed them (a tester's
``diloco:2 --compress int8`` over replica groups recorded 0 at half the averaging steps, and
only the group's own sum with groups of two ranks). Stand-ins for torchft: a quorum of one
replica whose exchange runs the hook on a thread of its own, as ``TorchftMembership`` does."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gradsync.compression import parse_compression
from gradsync.compression.base import ReplicaExchange
from gradsync.strategies.base import StepPlan, SyncContext
from gradsync.strategies.local_sgd import DiLoCo, LocalSGD, Periodic

pytestmark = pytest.mark.unit


class _Done:
    """A collective of one replica, complete at once (torch's ``Work`` surface)."""

    def __init__(self, value: list[torch.Tensor]) -> None:
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        self._future.set_result(value)

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future

    def wait(self) -> bool:
        return True


class _Alone(ReplicaExchange):
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> _Done:  # type: ignore[override]
        outputs[0].copy_(tensor)
        return _Done(outputs)

    def all_reduce_sum(self, tensor: torch.Tensor) -> _Done:  # type: ignore[override]
        return _Done([tensor])


class _Quorum:
    """One replica's quorum; its compressed exchange runs the hook on a thread, later."""

    replicas = _Alone()

    def start_step(self, step: int) -> None:
        del step

    def commit(self, step: int) -> bool:
        del step
        return True

    def allreduce(
        self, tensor: torch.Tensor, wire: torch.dtype | None = None, after: object = None
    ) -> torch.futures.Future[torch.Tensor]:
        raise AssertionError("a compressed exchange does not go through the Manager's all-reduce")

    def exchange(
        self,
        run: Callable[[], torch.futures.Future[torch.Tensor]],
        tensor: torch.Tensor,
        after: Callable[[], object] | None = None,
    ) -> torch.futures.Future[torch.Tensor]:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def go() -> None:
            threading.Event().wait(0.05)  # after the strategy has read its bytes, were it early
            done.set_result(run().wait())

        threading.Thread(target=go).start()
        return done


@pytest.mark.parametrize("make", [lambda: DiLoCo(period=2), lambda: LocalSGD(period=2)])
def test_a_compressed_average_across_the_quorum_counts_its_bytes_at_its_step(
    make: Callable[[], Periodic],
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = make()
    strategy.setup(
        SyncContext(
            model=model,
            optimizer=optimizer,
            group=None,
            compressor=parse_compression("int8"),
            bucket_mb=25.0,
            membership=_Quorum(),  # type: ignore[arg-type]
        )
    )
    numel = sum(p.numel() for p in model.parameters())
    sent = []
    for step in range(4):
        strategy.begin_step(StepPlan(step=step))
        model(torch.randn(8, 4)).square().mean().backward()
        sent.append(strategy.update(step, strategy.gradients_ready(step)).bytes_sent)
    # int8: a byte an element and a 4-byte scale per chunk of 1024, at each period's end
    assert sent == [0, numel + 4, 0, numel + 4]
