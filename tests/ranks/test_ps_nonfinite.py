"""One worker's NaN gradient under a parameter server stays that worker's skipped step: it never
reaches the parameters every worker pulls."""

from __future__ import annotations

import pytest

from gradsync.testing import run_ranks
from tests.support import gradient_ready_ranks as gr

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compression", [None, "topk:0.1"])
def test_a_nan_push_is_skipped_and_poisons_no_worker(compression: str | None) -> None:
    workers = run_ranks(gr.nan_on_one_parameter_server_worker, 3, compression, timeout_s=110)
    server = workers.pop()["server"]
    for rank, out in enumerate(workers):
        assert out["finite"], rank
        assert out["skipped"] == [rank == 1 and step == 2 for step in range(6)], out["skipped"]
    assert server.skipped_pushes == 1 and server.refused_pushes == 0
    assert server.clocks == [6, 6]  # the skipped push still moved worker 1's clock
