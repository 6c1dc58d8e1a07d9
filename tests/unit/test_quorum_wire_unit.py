"""fp16/bf16 through the torchft quorum (``TorchftMembership.allreduce(tensor, wire)``), on a
stand-in Manager: each participant sends its share cast to the wire dtype, the Manager sums
(not averages) the shares, and the sum comes back into the fp32 tensor. The run through a real
lighthouse is tests/e2e/test_replica_groups.py's kill/heal test (``--compress fp16``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.unit

pytest.importorskip("torchft", reason="the quorum's exchange is torchft's")


class Manager:
    """Two participants: the peer's share equals this one's, so the sum is twice the share."""

    def __init__(self) -> None:
        self.sent: list[tuple[torch.dtype, Any, torch.Tensor]] = []

    def num_participants(self) -> int:
        return 2

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> Any:
        self.sent.append((tensor.dtype, reduce_op, tensor.clone()))
        tensor.mul_(2)  # the peer's equal share added

        class Done:
            def wait(self) -> bool:
                return True

        return Done()


def _membership(manager: Manager) -> Any:
    from gradsync.membership.ft_manager import TorchftMembership

    # The parts allreduce uses, without a lighthouse, store or process group to start.
    membership = object.__new__(TorchftMembership)
    membership.manager = manager
    membership._waiter = ThreadPoolExecutor(max_workers=1)
    return membership


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_each_participant_sends_its_share_cast_and_the_sum_comes_back(wire: torch.dtype) -> None:
    manager = Manager()
    # 60000: under fp16's largest (65504), but two of it summed are not; shares sum to it
    grad = torch.tensor([1.0, -3.0, 1e-3, 60000.0])
    mean = _membership(manager).allreduce(grad, wire).wait()
    assert mean is grad and grad.dtype == torch.float32
    [(dtype, op, share)] = manager.sent
    assert dtype == wire and op == dist.ReduceOp.SUM
    assert torch.equal(share, torch.tensor([0.5, -1.5, 5e-4, 30000.0]).to(wire))
    assert torch.equal(grad, (share * 2).float())  # the sum of the shares, cast back
    assert torch.allclose(grad, torch.tensor([1.0, -3.0, 1e-3, 60000.0]), rtol=1e-2)


def test_without_a_wire_dtype_the_tensor_goes_as_it_is_and_torchft_averages() -> None:
    manager = Manager()
    grad = torch.tensor([1.0, 2.0])
    _membership(manager).allreduce(grad).wait()
    [(dtype, op, _)] = manager.sent
    assert dtype == torch.float32 and op is None  # torchft's default: its mean
