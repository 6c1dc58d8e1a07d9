"""The two accumulation conventions: gradsync's mean over micro-batches, and DDP scripts' sum of
losses already divided by the micro-batch count (``accumulation="sum"``)."""

from __future__ import annotations

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import gradient_ready_ranks as gr

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("strategy", "ranks"), [("bsp", 2), ("local:2", 2), ("ssp:0", 3)])
def test_a_ddp_style_script_with_accumulation_sum_equals_the_mean_convention(
    strategy: str, ranks: int
) -> None:
    mean, ddp_style, unported = run_ranks(gr.accumulate_each_way, ranks, strategy)[0]
    torch.testing.assert_close(ddp_style, mean, rtol=1e-10, atol=1e-12)
    # The trap the option exists for: DDP's convention under the mean halves every gradient.
    assert not torch.allclose(unported, mean, rtol=1e-6, atol=1e-8)
