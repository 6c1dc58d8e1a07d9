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


def small_shards(rank: int, world: int) -> dict[str, object] | None:
    """One worker and two servers for ``Linear(8, 2)``: one server's shard is the 2-element
    bias, fewer elements than a control message's words, so its receive buffer is longer than
    a push (a tester's crash: "flat tensor has 4 elements, the shapes hold 2"). Plain SGD
    under ssp:0 is one process's SGD: the final parameters are compared with it."""
    import gradsync as gs

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    reference = torch.nn.Linear(8, 2)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = gs.Synchronizer(model, opt, strategy="ssp:0", servers=2, timeout_s=30)
    if sync.is_server:
        sync.serve()
        sync.close()
        return None
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        with sync.step():
            model(x).square().mean().backward()
        ref_opt.zero_grad()
        reference(x).square().mean().backward()
        ref_opt.step()
    sync.report()
    sync.close()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "reference": [p.detach().clone() for p in reference.parameters()],
    }
