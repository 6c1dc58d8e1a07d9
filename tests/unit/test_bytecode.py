"""The bytecode the session writes up front (tests/support/bytecode.py): written once per
source, and never run in place of a source edited since."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.support.bytecode import compile_tree, is_current

pytestmark = pytest.mark.unit


def test_each_source_is_compiled_once_and_again_after_an_edit(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    a, b = tmp_path / "pkg" / "a.py", tmp_path / "pkg" / "b.py"
    a.write_text("X = 1\n")
    b.write_text("Y = 1\n")
    assert compile_tree(tmp_path) == 2
    assert all(is_current(s, Path(importlib.util.cache_from_source(str(s)))) for s in (a, b))
    assert compile_tree(tmp_path) == 0
    a.write_text("X = 2\n")
    assert compile_tree(tmp_path) == 1


def test_a_source_edited_since_is_imported_as_edited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit of the same size with the same modification time (within the second of the
    compile, say), where a timestamp pyc would still be taken for current: the edit runs."""
    name = f"bytecode_probe_{os.getpid()}"
    source = tmp_path / f"{name}.py"
    source.write_text("X = 1\n")
    assert compile_tree(tmp_path) == 1
    stat = source.stat()
    source.write_text("X = 2\n")
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        assert importlib.import_module(name).X == 2
    finally:
        sys.modules.pop(name, None)


def test_a_file_that_does_not_compile_is_left_for_the_import(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("def f(:\n")  # mid-edit
    (tmp_path / "fine.py").write_text("X = 1\n")
    assert compile_tree(tmp_path) == 1
    assert not Path(importlib.util.cache_from_source(str(tmp_path / "broken.py"))).exists()
