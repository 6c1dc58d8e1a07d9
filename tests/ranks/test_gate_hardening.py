"""Issue 43: another process in the run's store cannot freeze the ranks at a gate (item 1), and a
rank holding the GIL between steps is waited for, not declared dead (item 5; a rank on another
machine: tests/e2e/test_cluster_liveness.py)."""

from __future__ import annotations

import pytest
import torch

from gradsync.checks import secret
from gradsync.testing import run_ranks
from tests.support import gate_hardening_ranks as ranks
from tests.support.gate_ranks import TIMEOUT_S

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(90)
@pytest.mark.parametrize("given", [True, False], ids=["gradsync-run", "plain-torchrun"])
def test_a_client_of_the_store_cannot_hold_the_ranks_at_a_gate(monkeypatch, given: bool) -> None:
    """gradsync run hands its workers a secret; under plain torchrun the ranks agree on one at
    their first gate. Either way the next gates' counters cannot be named from outside. (Before:
    both ranks waited at the gate for ever.)"""
    if given:
        monkeypatch.setenv(secret.SECRET_ENV, secret.draw())
    else:
        monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    r0, r1 = run_ranks(ranks.trains_beside_an_attacker, 2, timeout_s=60)
    assert r0["steps"] == r1["steps"] == ranks.STEPS
    assert torch.equal(r0["params"], r1["params"])
    if given:
        assert r0["armed"] == []  # no gate of the run is visible under its name
    else:
        # only the first gate, before the secret was agreed, had a name it could read
        assert all("/gate/0/" in key for key in r0["armed"]), r0["armed"]


@pytest.mark.timeout(90)
def test_a_rank_holding_the_gil_between_steps_is_waited_for() -> None:
    r0, r1 = run_ranks(ranks.holds_the_gil_between_steps, 2, timeout_s=60)
    assert r0["error"] is None, r0["error"]  # before: "Rank 1 has not been heard from."
    assert r1["error"] is None, r1["error"]
    assert torch.equal(r0["params"], r1["params"])
    assert r0["longest_step"] > ranks.HOLD_S - 1 > 2 * TIMEOUT_S, r0
    assert not r0["vouching"] and not r1["vouching"]  # one machine: no voucher processes
