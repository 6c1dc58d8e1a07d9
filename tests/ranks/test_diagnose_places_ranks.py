"""A failed wait says where each rank is waiting: ranks that built different models are told
which and where, on real ranks (the placing itself: tests/unit/test_diagnose_places.py)."""

from __future__ import annotations

import pytest

from gradsync.testing import run_ranks
from tests.support import gradient_ready_ranks as gr

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (
            "transposed",
            "parameter '0.weight' [8, 16] float32 on rank 0, parameter '0.weight' "
            "[16, 8] float32 on rank 1",
        ),
        (
            "extra",
            "4 tensors on rank 0, 6 on rank 1; the first one only rank 1 has (6 in all) "
            "is parameter '2.weight' [1, 1] float32",
        ),
    ],
)
def test_ranks_that_built_different_models_are_told_which_and_where(
    kind: str, expected: str
) -> None:
    for message in run_ranks(gr.mismatched_models, 2, kind, timeout_s=50):
        assert message is not None
        assert message.startswith("rank 1 built a different model than rank 0: "), message
        assert expected in message, message
