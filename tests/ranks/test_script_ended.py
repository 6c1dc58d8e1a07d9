"""A rank whose script ends early (returned, or ``sys.exit(0)``) with its Synchronizer open:
under ``gradsync run`` its process lingers until the others finish, heartbeat and all, and a
peer at the next step's gate took it for a rank busy between steps and waited up to 1800 s (a
tester's finding: 7 of 7 runs hung). The worker now leaves word as the script ends
(``synchronizer.scripts_ended``), and the peer fails at once, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync.testing import run_ranks
from tests.support import script_ended_ranks

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(90)
def test_a_peer_fails_at_once_naming_a_rank_whose_script_ended(tmp_path: Path) -> None:
    r0, r1 = run_ranks(script_ended_ranks.ends_early, 2, str(tmp_path / "run"), timeout_s=80)
    assert r1 == {"ended": True}
    error = r0["error"]
    assert error is not None and error.startswith("step 3: the step (waiting"), error
    assert "Rank 1's script ended (sys.exit(0)) after step 2" in error, error
    # the heartbeat's silence, not the 60 s timeout, nor the ended rank's linger
    assert r0["waited"] < script_ended_ranks.LINGER_S / 2, r0
