"""Hang diagnosis of the waits outside the BSP exchange: local SGD's averaging, and report().

Each test has one rank stay away, in its own code between steps, from a collective; the others
must fail at the gate before it within the Synchronizer's between_steps_timeout_s (3 s here,
the process group's timeout is 30 s) with the step, the collective, the absent rank and where
it is named, instead of a raw backend error after the group's timeout.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import guard_ranks
from tests.support.overlap import Overlapped, overlapped, ranks

pytestmark = pytest.mark.ranks

TIMEOUT_S = 3  # the Synchronizer's, in guard_ranks
GROUP_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def launched() -> Iterator[Overlapped]:
    """Both tests' launches, which mostly wait out the 3 s, started at once so that the waits
    overlap (tests/support/overlap.py)."""
    with overlapped(
        {
            "averaging": ranks(
                guard_ranks.hang_before_averaging,
                2,
                "local:4",
                collective_timeout_s=GROUP_TIMEOUT_S,
                timeout_s=90,
            ),
            "report": ranks(
                guard_ranks.skips_report, 3, collective_timeout_s=GROUP_TIMEOUT_S, timeout_s=90
            ),
        }
    ) as out:
        yield out


@pytest.mark.timeout(120)
def test_rank_missing_a_local_sgd_averaging_is_named(launched: Overlapped) -> None:
    r0, r1 = launched.result("averaging")
    assert r1 == {"stayed_away": True}
    assert r0["error"] is not None
    assert r0["error"].startswith("step 7: averaging of local:4 (waiting"), r0["error"]
    assert "never arrived: ranks [1]" in r0["error"]
    assert "Rank 1 is still in its own code between steps 6 and 7" in r0["error"]
    assert f"{TIMEOUT_S}s for a rank in its own code" in r0["error"]
    assert r0["waited"] < TIMEOUT_S + 3, r0


@pytest.mark.timeout(120)
def test_rank_that_never_calls_report_is_named(launched: Overlapped) -> None:
    r0, r1, r2 = launched.result("report")
    # Rank 2 did wait at the last step's exchange long enough to record that arrival...
    assert r2 == {"stayed_away": True, "recorded": "5:0"}
    for r in (r0, r1):
        assert r["error"] is not None
        # ...which does not count as arriving at report(), a later gate.
        assert r["error"].startswith("end of run: report() (waiting"), r["error"]
        assert "never arrived: ranks [2]" in r["error"], r["error"]
        assert "Rank 2 is still in its own code between steps 5 and 6" in r["error"]
        assert r["waited"] < TIMEOUT_S + 3, r
