"""Every test chooses a tier: the markers are registered and the collection check holds."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TIERS, tier_errors

pytestmark = pytest.mark.unit


@dataclass
class FakeItem:
    nodeid: str
    marks: list[str] = field(default_factory=list)

    def iter_markers(self) -> Any:
        return iter(getattr(pytest.mark, name).mark for name in self.marks)


def test_a_test_without_exactly_one_tier_is_named() -> None:
    items = [
        FakeItem("t.py::fine", ["unit", "timeout"]),
        FakeItem("t.py::none", ["timeout"]),
        FakeItem("t.py::two", ["ranks", "e2e"]),
    ]
    assert tier_errors(items) == ["t.py::none: none", "t.py::two: e2e, ranks"]  # type: ignore[arg-type]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_the_tiers_are_registered_and_markers_are_strict() -> None:
    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    options = tomllib.loads(pyproject.read_text())["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in options["addopts"].split()
    assert [m.split(":")[0] for m in options["markers"]] == list(TIERS)
