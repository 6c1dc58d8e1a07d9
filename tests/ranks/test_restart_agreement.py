"""Across hosts, each host's elastic agent counts only its own workers' failures: the ranks of
``gradsync run``'s built-in workloads take the most any of them counted, so that all of them
load the newest checkpoint after a restart (on the emulated cluster, host 0's workers started
afresh while host 1's loaded it, and both waited for the other at the step gate)."""

from __future__ import annotations

import pytest

from gradsync.testing import run_ranks
from tests.support import restart_agreement_ranks

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(60)
def test_every_rank_takes_the_restart_any_agent_counted() -> None:
    assert run_ranks(restart_agreement_ranks.agreed, 2, timeout_s=50) == [(1, "1"), (1, "1")]
