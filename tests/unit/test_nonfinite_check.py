"""The divergence check says parameters are not finite rather than calling NaN 'divergence'."""

from __future__ import annotations

import pytest
import torch

from gradsync.checks.guards import check_replicas
from gradsync.errors import DivergenceError

pytestmark = pytest.mark.unit


def test_non_finite_parameters_are_named_as_such(one_rank: None) -> None:
    named = [("a", torch.ones(3)), ("b", torch.tensor([1.0, float("nan")])), ("c", torch.ones(2))]
    with pytest.raises(DivergenceError) as caught:
        check_replicas(named, None, step=7)
    message = str(caught.value)
    assert message.startswith(
        "parameters are not finite at step 7: 'b' holds NaN or Inf on rank(s) [0]"
    )
    assert "diverged" not in message


def test_finite_identical_replicas_pass(one_rank: None) -> None:
    check_replicas([("a", torch.ones(3))], None, step=0)
