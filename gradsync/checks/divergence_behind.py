"""The periodic divergence check, behind the steps: posted at its step, compared a period later.

A check that gathers the replicas' fingerprints and compares them at once makes the host wait
for the device to finish every step queued so far, and then for the gather: on a GPU the host
stops queueing work each time. So the periodic check only posts: the fingerprints are computed
where the parameters are, gathered without waiting (``async_op``), and on CUDA copied to
pinned host memory behind an event, all queued after the step. The comparison runs at the next
check, a period later, when the device is long past them (the event has completed, the wait is
none), or at ``report()``, whose own final check stays immediate. A divergence is then raised
one period later than an immediate check would raise it, naming the step it was seen at.

Where the fingerprints cannot be gathered where they are (a GPU model under gloo, which
gathers host memory: reading them is the wait), ``post`` gives None and the caller checks at
once, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradsync import runtime
from gradsync.checks.guards import compare_fingerprints, fingerprint_rows


@dataclass(slots=True)
class PostedCheck:
    """A divergence check posted at ``step`` and not compared yet."""

    step: int
    names: list[str]
    #: the group ranks compared (parameter servers hold no replica)
    ranks: list[int]
    gathered: list[torch.Tensor]
    work: Any
    #: CUDA: the gathered fingerprints in pinned host memory, complete once ``event`` is
    host: torch.Tensor | None = None
    event: Any = None


def post(
    named: list[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup | None,
    step: int,
    ranks: list[int],
) -> PostedCheck | None:
    """Collective over ``group``, without waiting: every rank's fingerprint after ``step``, on
    its way; None where it cannot be gathered without a wait here (check at once instead)."""
    rows = fingerprint_rows(named)
    if rows.device != runtime.device():
        return None
    gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(gathered, rows, group=group, async_op=True)
    posted = PostedCheck(step, [name for name, _ in named], ranks, gathered, work)
    if rows.is_cuda:
        # NCCL: the current stream waits for the gather, the host does not; the copy to pinned
        # memory follows it on the stream, and the event says when it has landed.
        work.wait()
        stacked = torch.stack(gathered)
        posted.host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        posted.host.copy_(stacked, non_blocking=True)
        posted.event = torch.cuda.Event()
        posted.event.record()
    return posted


def fingerprints(posted: PostedCheck) -> list[torch.Tensor]:
    """The gathered fingerprints on the host, by group rank (waits for the gather if it has not
    completed: the wait a timeout diagnosis watches)."""
    if posted.event is not None and posted.host is not None:
        if not posted.event.query():  # asked first: a wait, even for nothing, is a sync call
            posted.event.synchronize()
        return list(posted.host.unbind(0))
    posted.work.wait()
    return posted.gathered


def compare(posted: PostedCheck, prints: list[torch.Tensor]) -> None:
    """Raise ``DivergenceError`` if the replicas differed at the posted step."""
    compare_fingerprints(posted.names, prints, posted.ranks, f"at step {posted.step}")
