"""``gradsync.runner.worker``: a script run in a rank ends as ``python train.py`` would (its
files left open are flushed, its exit handlers run, after a raise too), and it sees
multiprocessing's start method unset, as in a fresh interpreter. In this process: the exit
handlers are a stand-in (the real ones here are pytest's); the end-to-end run of both is
``tests/e2e/test_script_exit.py``."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradsync import compat
from gradsync.runner import worker

pytestmark = pytest.mark.unit

SCRIPT = """
import sys
log = open(sys.argv[1] + "/global.txt", "w")   # never closed, as many scripts do
log.write("every step\\n")

def train():
    inner = open(sys.argv[1] + "/local.txt", "w")
    inner.write("a local file\\n")
    if sys.argv[2] == "raise":
        raise RuntimeError("the script failed")
    if sys.argv[2] == "exit":
        sys.exit(3)

train()
"""


@pytest.fixture
def as_a_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """``sys.argv`` and ``sys.path`` restored after ``_run_main``; the exit handlers a
    recorded stand-in."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    ran: list[str] = []
    monkeypatch.setattr(compat, "run_exit_handlers", lambda: ran.append("handlers") or True)
    for name in ("last_type", "last_value", "last_traceback"):
        monkeypatch.delattr(sys, name, raising=False)
    yield ran


@pytest.mark.parametrize("end", ["return", "raise", "exit"])
def test_files_the_script_left_open_are_written_at_its_exit(
    tmp_path: Path, as_a_rank: list[str], end: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ending = worker._ScriptExit()
    # In a rank the exception still propagates through multiprocessing's code while the exit
    # runs (its traceback holds the script's frames): held here as long.
    propagating: BaseException | None = None
    try:
        worker._run_main([str(script), str(tmp_path), end], ending)
    except RuntimeError as exc:
        assert end == "raise"
        ending.failed(exc)
        propagating = exc
        assert sys.last_value is exc  # as Python sets it: gradsync's own handler reads it
    except SystemExit as exc:
        assert end == "exit" and exc.code == 3
    # Nothing flushed yet: the writes are still in the files' buffers.
    assert (tmp_path / "global.txt").read_text() == ""
    ending()
    assert as_a_rank == ["handlers"]
    assert (tmp_path / "global.txt").read_text() == "every step\n"
    if end != "return":  # a returned function's locals are freed at once
        assert (tmp_path / "local.txt").read_text() == "a local file\n"
    assert getattr(sys, "last_value", None) is None
    del propagating


def test_the_script_runs_as_main_with_its_own_globals(tmp_path: Path, as_a_rank: list[str]) -> None:
    script = tmp_path / "main.py"
    script.write_text(
        "import sys, __main__\n"
        "x: undefined_name = 1\n"  # evaluated: no ``from __future__ import annotations`` here
        "sys.modules['__main__'].seen = (__name__, __file__, __main__.x)\n"
    )
    before = sys.modules["__main__"]
    ending = worker._ScriptExit()
    with pytest.raises(NameError, match="undefined_name"):
        worker._run_main([str(script)], ending)
    script.write_text(script.read_text().replace("undefined_name", "int"))
    worker._run_main([str(script)], ending)
    assert ending.namespace["seen"] == ("__main__", str(script), 1)
    assert sys.modules["__main__"] is before


def test_the_script_sees_the_start_method_unset_as_in_a_fresh_interpreter() -> None:
    previous = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("spawn", force=True)  # as multiprocessing sets a child's
    try:
        with worker._start_method_as_python():
            # unset: a process it starts gets the platform's default (fork on Linux before
            # Python 3.14), and the script's own choice is not refused
            assert multiprocessing.get_start_method(allow_none=True) is None
            multiprocessing.set_start_method("spawn")
        assert multiprocessing.get_start_method(allow_none=True) == "spawn"
    finally:
        multiprocessing.set_start_method(previous, force=True)


def test_a_process_that_is_no_multiprocessing_child_leaves_its_exit_to_python() -> None:
    assert multiprocessing.parent_process() is None
    assert worker._ends_without_exit() is False
