"""Use a gradsync compressor as a ``DistributedDataParallel`` communication hook.

    state, hook = gradsync.compression.ddp_comm_hook("powersgd:4")
    ddp_model.register_comm_hook(state, hook)

``state`` is the compressor's own state (``state.bytes_sent``, ``state.state_dict()``), so a DDP
user checkpoints error feedback and PowerSGD factors the same way gradsync does.
"""

# No ``from __future__ import annotations`` here: DDP inspects the hook's signature and accepts
# only the real ``dist.GradBucket`` / ``Future[Tensor]`` objects as annotations, not strings.

from typing import Any

import torch
import torch.distributed as dist

from gradsync.compression.base import Compressor, Group
from gradsync.compression.spec import parse_compression


def ddp_comm_hook(
    compressor: "Compressor | str | None", group: "Group" = None
) -> "tuple[Any, Any]":
    """Return ``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``.

    ``compressor`` is a spec string (``"topk:0.01"``), a ``Compressor``, or None for a plain
    all-reduce; ``group`` is the process group to reduce over (DDP's default group if None).
    Bucket state is keyed by DDP's bucket index; DDP rebuilds its buckets after the first
    iteration, and a bucket index whose layout changed restarts its residual / warm start.
    """
    chosen = parse_compression(compressor)
    state = chosen.make_state(group)
    inner = chosen.hook

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return inner(state, bucket)

    # DDP logs the hook's __qualname__; name it after the spec so logs say what ran.
    hook.__qualname__ = hook.__name__ = f"gradsync_{chosen.spec.replace(':', '_')}_hook"
    return state, hook
