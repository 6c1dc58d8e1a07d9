"""The example runs as its first line says: under plain torchrun, not gradsync's launcher."""

from __future__ import annotations

import os
import re

import pytest

from tests.support.torchrun import ROOT, torchrun

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "examples" / "train_charlm.py"


@pytest.mark.timeout(180)
def test_example_trains_under_plain_torchrun() -> None:
    # --standalone: a c10d rendezvous on localhost with a free port, so runs cannot collide.
    args = ["--standalone", "--nproc_per_node=2", str(EXAMPLE), "--steps", "3"]
    out = torchrun(args, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout_s=150)
    first = re.search(r"^step 0 loss (\d+\.\d+)$", out, re.MULTILINE)
    final = re.search(r"^final loss: (\d+\.\d+)$", out, re.MULTILINE)
    assert first and final, out[-3000:]
    # Three AdamW steps from a fresh model: the loss must have moved down.
    assert float(final.group(1)) < float(first.group(1))
    assert "pace-setter: rank" in out
