"""Non-finite verdicts left on the device, read back in batches.

Where the user's optimizer skips its own update on a ``found_inf`` tensor (torch's fused
optimizers; ``gradsync.strategies.base.device_verdict``), a step's verdict never has to reach
the host for the step to be right: the optimizer acts on it on the device. The host still
wants it for what it reports (``StepHandle.skipped``, why a step was skipped, the telemetry
record), and reading one flag per step would make the host wait for the device every step,
which is the cost this path removes. So the flags wait here and are read together: one
stacked copy to the host every ``every`` steps (the telemetry gather's period), or sooner
where something asks for one (``StepHandle.skipped`` read by the script, a checkpoint, the
report). The device is then long past the oldest of them, so the read waits only for the
newest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class PendingVerdicts:
    """Steps' ``found_inf`` flags (0-d tensors, 1.0: skipped) and what to tell once read."""

    def __init__(self, every: int) -> None:
        self.every = max(1, every)
        self._flags: list[torch.Tensor] = []
        self._tell: list[Callable[[bool], None]] = []

    def __len__(self) -> int:
        return len(self._flags)

    def add(self, found_inf: torch.Tensor, tell: Callable[[bool], None]) -> None:
        """Hold ``found_inf`` until the next read; ``tell(skipped)`` then."""
        self._flags.append(found_inf)
        self._tell.append(tell)

    def due(self) -> bool:
        return len(self._flags) >= self.every

    def read(self) -> list[bool]:
        """Every held verdict, in one copy to the host per device; tells each, oldest first.
        Returns them (True: skipped)."""
        flags, tell = self._flags, self._tell
        self._flags, self._tell = [], []
        if not flags:
            return []
        skipped = [v != 0 for v in _to_host(flags)]
        for told, value in zip(tell, skipped, strict=True):
            told(value)
        return skipped


def _to_host(flags: list[torch.Tensor]) -> list[float]:
    try:
        return torch.stack(flags).tolist()
    except RuntimeError:  # flags on several devices (a model across GPUs)
        return [float(f) for f in flags]
