"""The simulator's public names resolve lazily, so importing it needs no torch (run where torch
cannot be imported: tests/e2e/test_sim_no_torch.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_public_names_still_resolve_lazily() -> None:
    import gradsync as gs

    assert gs.Synchronizer.__name__ == "Synchronizer"
    from gradsync import DiLoCo, init

    assert callable(init) and DiLoCo is gs.DiLoCo
    assert "Synchronizer" in dir(gs)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = gs.nope  # type: ignore[attr-defined]
