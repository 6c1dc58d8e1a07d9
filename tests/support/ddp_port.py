"""The DDP example scripts and their gradsync ports, as tests/unit/test_ddp_port_unit.py diffs
them and tests/e2e/test_ddp_port.py runs them."""

from __future__ import annotations

from pathlib import Path

from tests.support.torchrun import ROOT

EXAMPLES = ROOT / "examples"
#: each pair's short run: arguments, and a line rank 0 prints once it evaluated and saved
RUNS = {
    "ddp_lm": (["--steps", "8", "--eval-every", "4"], "step 8 train loss"),
    "ddp_vision": (["--epochs", "2", "--train-size", "256"], "epoch 2 loss"),
}


def pair(name: str) -> tuple[Path, Path]:
    return EXAMPLES / f"{name}.py", EXAMPLES / f"{name}_gradsync.py"
