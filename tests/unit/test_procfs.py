"""``gradsync.procfs``: /proc/PID/stat read one way (was parsed in six modules)."""

from __future__ import annotations

import os
import sys

import pytest

from gradsync import procfs

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's"),
]

#: a stat line whose command name holds spaces and parentheses (any process may name itself so)
LINE = b"4242 (a) b (c)) S 17 4242 4242 0 -1 4194560 " + b" ".join([b"0"] * 12) + b" 987654 0"


def test_a_command_name_with_spaces_and_parentheses_leaves_the_fields_in_place() -> None:
    fields = procfs.parse_stat(LINE)
    assert fields is not None
    assert (fields[0], fields[1], fields[19]) == ("S", "17", "987654")


@pytest.mark.parametrize("text", [b"", b"4242 (cut", b"4242 (x) S 1 2 3"])
def test_a_line_that_is_not_whole_is_none(text: bytes) -> None:
    assert procfs.parse_stat(text) is None


@pytest.mark.timeout(30)
def test_this_process_as_proc_says_it() -> None:
    here = os.getpid()
    assert procfs.state(here) == "R"  # it is running: it reads its own stat
    seen = procfs.state_and_start(here)
    assert seen is not None and seen[1].isdigit()
    assert procfs.parents()[here] == os.getppid()


def test_a_pid_that_does_not_exist_is_none() -> None:
    gone = 2**22 + 1  # above the kernel's largest pid (pid_max is at most 2**22)
    assert procfs.state(gone) is None and procfs.state_and_start(gone) is None
