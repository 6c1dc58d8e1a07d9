"""--data for charlm: a file that is not text (binary, UTF-16) is refused before any launch."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

import gradsync.processes.launch
from gradsync.errors import UsageError
from gradsync.runner.cli import main
from gradsync.runner.config import RunConfig
from gradsync.workloads import data

pytestmark = pytest.mark.unit

TEXT = "def f(x):\n    return x + 1  # café\n" * 100  # UTF-8, one non-ASCII character


@pytest.mark.parametrize(
    ("name", "content", "found"),
    [
        ("utf16.txt", TEXT.encode("utf-16"), "UTF-16 byte-order mark"),
        ("utf16le.txt", TEXT.encode("utf-16-le"), "every other byte is NUL"),
        ("utf32.txt", TEXT.encode("utf-32"), "UTF-32 byte-order mark"),
        ("model.bin", bytes(range(256)) * 8, "NUL bytes, as binary files do (the first at byte 0)"),
        ("controls.bin", bytes([1, 2, 200, 3, 201, 4]) * 400, "control characters"),
    ],
)
def test_what_is_not_text_is_refused_naming_the_file_and_what_was_found(
    tmp_path: Path, name: str, content: bytes, found: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UsageError) as refused:
        RunConfig(data=str(path), out=str(tmp_path / "run"))
    message = str(refused.value)
    assert repr(str(path)) in message and found in message
    fix = "iconv -f UTF-" if name.startswith("utf") else "pass a text file"
    assert fix in message


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1", "ascii"])
def test_text_passes(tmp_path: Path, encoding: str) -> None:
    path = tmp_path / "text.txt"
    path.write_bytes(TEXT.encode(encoding, errors="replace"))
    RunConfig(data=str(path), out=str(tmp_path / "run"))


def test_cli_refuses_it_in_one_line_without_launching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    launched: list[object] = []
    monkeypatch.setattr(gradsync.processes.launch, "launch", lambda *a, **k: launched.append(a))
    path = tmp_path / "utf16.txt"
    path.write_bytes(TEXT.encode("utf-16"))
    code = main(["run", f"--data={path}", f"--out={tmp_path / 'run'}"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and not launched
    assert len(err) == 1 and err[0].startswith(f"gradsync: error: --data file '{path}'")


def test_the_stdlib_sample_lists_what_a_full_walk_would() -> None:
    # The walk prunes the skipped directories instead of listing everything and filtering:
    # the same files, in the same order, so charlm trains on the same text.
    root = Path(sysconfig.get_paths()["stdlib"])
    listed = [
        p
        for p in sorted(root.rglob("*.py"))
        if not data._SKIP_DIRS.intersection(p.relative_to(root).parts)
    ]
    assert data.stdlib_sources() == listed
