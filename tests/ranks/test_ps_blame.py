"""A parameter server whose wait for the workers times out names the worker that is actually
absent (issue 42, trap 5: rank 0 was evaluating, and the server reported 'lost worker rank 1'):
a worker waiting for a reply the staleness bound holds is not absent, even when it gives up."""

from __future__ import annotations

import re

import pytest

from gradsync.testing import run_ranks
from tests.support import ps_blame_ranks as pb

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(90)
def test_the_server_names_the_worker_that_is_evaluating() -> None:
    out = run_ranks(pb.one_worker_busy_between_steps, 3, 0, timeout_s=60, allow_failures=True)
    error = out[2]["error"]
    assert error is not None and error.startswith("parameter server rank 2: "), error
    # Worker 0 is the one that sent nothing, and its heartbeat says where it was. Which wait
    # gives up first is timing: the server's wait for any worker ("worker rank 0 sent
    # nothing ...") or its receive from worker 0 ("lost worker rank 0 (sent nothing ...").
    assert re.search(
        r"worker rank 0 \(?sent nothing for [\d.]+s, its last heartbeat: in its own "
        r"code between steps 1 and 2",
        error,
    ), error
    # Worker 1 only waited for its held reply: never blamed as absent or lost.
    assert "worker rank 1 sent nothing" not in error, error
    assert "lost worker rank 1" not in error, error
    assert "worker rank 1 wait" in error and "ssp:0" in error, error
    # Worker 1's own error, its reply not coming, says where the other worker is.
    waited = out[1]["error"]
    assert waited is not None and "the reply of parameter server rank 2" in waited, waited
    assert "worker rank 0 is in its own code between steps 1 and 2" in waited, waited
