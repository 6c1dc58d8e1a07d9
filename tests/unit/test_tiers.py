"""Every test chooses a tier: the markers are registered, the collection check holds, a test
lives in its tier's folder, and a unit test cannot start a process."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import STARTED, TIERS, folder_errors, refusing_start, tier_errors

pytestmark = pytest.mark.unit


@dataclass
class FakeItem:
    nodeid: str
    marks: list[str] = field(default_factory=list)
    path: Path = Path("/nowhere/t.py")

    def iter_markers(self) -> Any:
        return iter(getattr(pytest.mark, name).mark for name in self.marks)


def test_a_test_without_exactly_one_tier_is_named() -> None:
    items = [
        FakeItem("t.py::fine", ["unit", "timeout"]),
        FakeItem("t.py::none", ["timeout"]),
        FakeItem("t.py::two", ["ranks", "e2e"]),
    ]
    assert tier_errors(items) == ["t.py::none: none", "t.py::two: e2e, ranks"]  # type: ignore[arg-type]


def test_a_test_outside_its_tier_s_folder_is_named(tmp_path: Path) -> None:
    root = tmp_path / "tests"
    items = [
        FakeItem("unit/t.py::fine", ["unit", "timeout"], root / "unit" / "t.py"),
        FakeItem("e2e/sub/t.py::fine", ["e2e"], root / "e2e" / "sub" / "t.py"),
        FakeItem("unit/t.py::ranks", ["ranks"], root / "unit" / "t.py"),
        FakeItem("ranks/t.py::e2e", ["timeout", "e2e"], root / "ranks" / "t.py"),
        FakeItem("t.py::top", ["unit"], root / "t.py"),
        FakeItem("support/t.py::helper", ["unit"], root / "support" / "t.py"),
        FakeItem("unit/t.py::none", [], root / "unit" / "t.py"),  # tier_errors names it
        FakeItem("elsewhere.py::x", ["e2e"], tmp_path / "elsewhere.py"),  # not the suite's
    ]
    assert folder_errors(items, root) == [  # type: ignore[arg-type]
        "unit/t.py::ranks: marked ranks, in tests/unit",
        "ranks/t.py::e2e: marked e2e, in tests/ranks",
        "t.py::top: in tests/, not in a tier's folder",
        "support/t.py::helper: in tests/support, not in a tier's folder",
    ]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_the_tiers_are_registered_and_markers_are_strict() -> None:
    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    options = tomllib.loads(pyproject.read_text())["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in options["addopts"].split()
    assert [m.split(":")[0] for m in options["markers"]] == list(TIERS)


def test_a_refused_start_names_the_test_and_what_it_called() -> None:
    started: list[str] = []
    refuse = refusing_start("tests/unit/t.py::x", "subprocess.Popen", started)
    with pytest.raises(pytest.fail.Exception, match=r"t\.py::x is a unit test.*subprocess\.Popen"):
        refuse("self", ["true"])
    assert started == ["subprocess.Popen"]
    # what pytest.fail raises is no Exception: an `except Exception` does not hide it
    assert not issubclass(pytest.fail.Exception, Exception)


def test_a_unit_test_cannot_start_a_process(request: pytest.FixtureRequest) -> None:
    with pytest.raises(pytest.fail.Exception, match="subprocess.Popen"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(pytest.fail.Exception, match="Process.start"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(pytest.fail.Exception, match="os.fork"):
        os.fork()
    assert request.node.stash[STARTED] == [
        "subprocess.Popen",
        "multiprocessing's Process.start",
        "os.fork",
    ]
    request.node.stash[STARTED].clear()  # else the report fails this test, as it should
    # A reference to os.system still pickles by its name (a crafted checkpoint's test does).
    assert pickle.loads(pickle.dumps(os.system)) is os.system
