"""Rank function for test_ps_wire.py (module level, so spawned ranks can import it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsync.strategies.ps_wire import CHECKPOINT, ShardPlan

PUSH = 10_000  # the receive a server posts: a push's size


def control_into_a_push_sized_receive(rank: int, world: int) -> list[float] | None:
    # What a parameter server does with every message: receive it into a buffer of a push's
    # size. A control message is the header alone (ShardPlan.control).
    if rank == 1:
        plan = ShardPlan.__new__(ShardPlan)  # only ``wire`` is needed: a fixed layout
        plan.wire = lambda s: (torch.float32, 4, PUSH - 4)  # type: ignore[method-assign]
        message = plan.control(0, CHECKPOINT, torch.tensor([0.25], dtype=torch.float64))
        assert message.numel() == 4
        dist.send(message, dst=0)
        return None
    buf = torch.full((PUSH,), -7.0)
    dist.recv(buf, src=1)
    return [buf[0].item(), buf[2:4].view(torch.float64).item(), buf[4].item(), buf[-1].item()]
