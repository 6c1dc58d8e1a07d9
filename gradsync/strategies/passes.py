"""How many backward passes a step's block ran, for the strategies whose gradient is the
rank's own (``local:H``, ``diloco:H``, gossip, the parameter-server workers, hogwild).

``sync.step(micro_batches=K)`` divides the accumulated gradient by K: a block that ran another
number of passes would silently scale the update (half of it for one pass under K=2). ``bsp``
and ``zero:1/2`` count the passes in their bucket hooks; these strategies have no hooks of
their own, so each parameter gets a post-accumulate-grad hook that counts, and the step's
count is the most any parameter saw (a parameter unused in a pass sees fewer), as under
``bsp``. About a microsecond per parameter per pass on the training thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradsync.errors import UsageError


class PassCounter:
    """Counts each parameter's accumulated gradients between ``arm`` and ``check``."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._seen: dict[int, int] = {}
        self._expected = 1
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def arm(self, passes: int) -> None:
        self._seen, self._expected = {}, passes

    def _on_grad(self, param: torch.Tensor) -> None:
        self._seen[id(param)] = self._seen.get(id(param), 0) + 1

    def check(self) -> None:
        """Raise when the block ran another number of passes than ``arm`` announced."""
        passes = max(self._seen.values(), default=0)
        if passes != self._expected:
            raise wrong_passes(self._expected, passes)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def wrong_passes(micro_batches: int, passes: int) -> UsageError:
    """The block ran another number of backward passes than ``sync.step`` announced."""
    return UsageError(
        f"sync.step(micro_batches={micro_batches}) but the block ran {passes} "
        f"backward pass(es); run exactly {micro_batches}"
    )
