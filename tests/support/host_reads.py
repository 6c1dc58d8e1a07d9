"""Host reads of tensor data, caught on the CPU: what would make the host wait for a GPU.

On a GPU, ``t.item()``, ``bool(t)``, ``t.tolist()``, ``float(t)``, ``int(t)``, ``t.cpu()`` and
``torch.equal`` on device tensors wait until the device has computed them; on the CPU they
cost nothing and go unseen. ``HostReads`` patches them on ``torch.Tensor`` (and
``torch.equal``) to record each call, with the step it came in and the line that made it, so
a test on the CPU can say which steps of a training loop would have stopped the host.
CUDA's own check is ``torch.cuda.set_sync_debug_mode("error")``, where a GPU is present.
"""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

#: the checkout's root: reads are named by their path in it (``gradsync/checks/verdicts.py``)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the ``torch.Tensor`` members that hand a tensor's values to the host
READS = ("item", "__bool__", "tolist", "__float__", "__int__", "__index__", "cpu", "numpy")


@dataclass
class Read:
    step: int
    name: str
    #: the innermost frame outside this module: the line that asked for the value
    where: str


@dataclass
class HostReads:
    """``step`` is set by the training loop; None: not recording (warm-up, set-up, report)."""

    step: int | None = None
    reads: list[Read] = field(default_factory=list)

    def record(self, name: str) -> None:
        if self.step is None:
            return
        frame = traceback.extract_stack(limit=3)[0]
        where = f"{_relative(frame.filename)}:{frame.lineno} {frame.line}"
        self.reads.append(Read(self.step, name, where))

    def steps(self) -> set[int]:
        return {r.step for r in self.reads}

    def at(self, step: int) -> list[Read]:
        return [r for r in self.reads if r.step == step]

    def describe(self) -> list[str]:
        return [f"step {r.step}: {r.name} at {r.where}" for r in self.reads]


def _relative(filename: str) -> str:
    """``filename`` from the checkout's root where it is inside it (wherever it was cloned)."""
    path = os.path.abspath(filename)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else filename


def _spy(original: Callable[..., Any], name: str, reads: HostReads) -> Callable[..., Any]:
    @functools.wraps(original)
    def spied(*args: Any, **kwargs: Any) -> Any:
        reads.record(name)
        return original(*args, **kwargs)

    return spied


@contextmanager
def host_reads() -> Iterator[HostReads]:
    """Record host reads of tensor data while the block runs (only while ``step`` is set)."""
    reads = HostReads()
    # Members torch.Tensor defines itself are put back; those it inherits from its C base
    # are shadowed by the spy, which is then deleted.
    own = {name: torch.Tensor.__dict__.get(name) for name in READS}
    saved_equal = torch.equal
    try:
        for name in READS:
            setattr(torch.Tensor, name, _spy(getattr(torch.Tensor, name), name, reads))
        torch.equal = _spy(saved_equal, "torch.equal", reads)
        yield reads
    finally:
        for name, original in own.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        torch.equal = saved_equal
