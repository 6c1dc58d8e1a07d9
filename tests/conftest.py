import contextlib
import functools
import multiprocessing.process
import multiprocessing.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.support.bytecode import compile_tree

# Where no process may write bytecode (PYTHONDONTWRITEBYTECODE), gradsync's and the tests' is
# written here once, checked against the sources at every import, so that the hundreds of
# processes a run starts (and this one, from its next import on) do not each compile them
# again (tests/support/bytecode.py).
if sys.dont_write_bytecode:
    compile_tree(Path(__file__).resolve().parents[1] / "gradsync", Path(__file__).resolve().parent)

from gradsync.checkpoint.writer_process import WRITER_ENV  # noqa: E402

# Every rank and the test process itself use one intra-op thread: the machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

#: The three test tiers, registered in pyproject.toml; each test carries exactly one, and
#: lives in the folder of that name under tests/ (tests/unit, tests/ranks, tests/e2e).
TIERS = ("unit", "ranks", "e2e")
TESTS = Path(__file__).resolve().parent


def tier_errors(items: list[pytest.Item]) -> list[str]:
    """One line per test without exactly one tier marker."""
    errors = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            found = ", ".join(tiers) if tiers else "none"
            errors.append(f"{item.nodeid}: {found}")
    return errors


def folder_errors(items: list[pytest.Item], root: Path = TESTS) -> list[str]:
    """One line per test under ``root`` whose folder is not its tier's: a test of
    tests/unit marked ranks, or a test module outside the three tier folders. (A test without
    exactly one tier is ``tier_errors``'s.)"""
    errors = []
    for item in items:
        try:
            parts = Path(item.path).resolve().relative_to(root).parts
        except ValueError:  # not under tests/: not this suite's
            continue
        folder = parts[0] if len(parts) > 1 else ""
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        if folder not in TIERS:
            errors.append(f"{item.nodeid}: in {root.name}/{folder}, not in a tier's folder")
        elif len(tiers) == 1 and tiers != {folder}:
            errors.append(f"{item.nodeid}: marked {tiers.pop()}, in {root.name}/{folder}")
    return errors


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything: an unmarked test fails any run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    errors = tier_errors(items)
    if errors:
        raise pytest.UsageError(
            f"{len(errors)} test(s) need exactly one tier marker, {' / '.join(TIERS)} "
            "(pytestmark = pytest.mark.unit in the module, or one per test; see the markers "
            "in pyproject.toml):\n  " + "\n  ".join(errors)
        )
    errors = folder_errors(items)
    if errors:
        raise pytest.UsageError(
            f"{len(errors)} test(s) are not in their tier's folder: a test marked unit lives "
            "in tests/unit, ranks in tests/ranks, e2e in tests/e2e:\n  " + "\n  ".join(errors)
        )


# -- a unit test starts no process ------------------------------------------------------------

#: What starts a process, as (owner, attribute, what a message calls it): every subprocess (run,
#: Popen, check_output), every multiprocessing process (spawn, fork and forkserver contexts,
#: torch.multiprocessing and run_ranks among them), the forkserver and resource tracker that
#: multiprocessing starts for itself, and a bare fork, spawn or shell.
PROCESS_STARTS: tuple[tuple[Any, str, str], ...] = (
    (subprocess.Popen, "_execute_child", "subprocess.Popen"),
    (multiprocessing.process.BaseProcess, "start", "multiprocessing's Process.start"),
    (multiprocessing.util, "spawnv_passfds", "multiprocessing.util.spawnv_passfds"),
    *((os, name, f"os.{name}") for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp")),
    (os, "system", "os.system"),
)
#: what the running phase of a unit test tried to start
STARTED = pytest.StashKey[list[str]]()


def refusing_start(nodeid: str, what: str, started: list[str]) -> Callable[..., Any]:
    """A stand-in for ``what`` that starts nothing: it records the attempt in ``started`` and
    fails the test, naming it (``pytest.fail``'s exception is no ``Exception``: an
    ``except Exception`` in the code under test does not hide it, and a caught one is still
    reported, from ``started``)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        started.append(what)
        pytest.fail(
            f"{nodeid} is a unit test, and a unit test starts no process; it called {what}. "
            "Mark it ranks (gloo ranks) or e2e (a command) and move it to tests/ranks or "
            "tests/e2e, or avoid the process (checkpoints that are not about the writer "
            "process: the inline_writer fixture)"
        )

    return refuse


@contextlib.contextmanager
def _no_process_if_unit(item: pytest.Item) -> Iterator[None]:
    """Around each phase of a unit test (the setup and teardown of its fixtures, of any scope,
    included): everything in ``PROCESS_STARTS`` refuses to start a process."""
    if item.get_closest_marker("unit") is None:
        yield
        return
    started = item.stash[STARTED] = []
    with pytest.MonkeyPatch.context() as patch:
        for owner, name, what in PROCESS_STARTS:
            original = getattr(owner, name, None)
            if original is None:  # not on this platform
                continue
            refuse = functools.wraps(original)(refusing_start(item.nodeid, what, started))
            patch.setattr(owner, name, refuse)
            # os.system is posix.system: pickle finds a function by its module and name (a
            # crafted checkpoint pickles a reference to it), so that module gets it too
            home = sys.modules.get(getattr(original, "__module__", None) or "")
            if home is not None and home is not owner and getattr(home, name, None) is original:
                patch.setattr(home, name, refuse)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _no_process_if_unit(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _no_process_if_unit(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with _no_process_if_unit(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A phase that passed though it tried to start a process (the code under test caught the
    refusal) fails all the same."""
    outcome = yield
    report = outcome.get_result()
    started = item.stash.get(STARTED, [])
    if started and report.passed:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} is a unit test, and a unit test starts no process; it called "
            f"{', '.join(sorted(set(started)))} (and the code under test caught the refusal)"
        )


@pytest.fixture(scope="module")
def inline_writer() -> Iterator[None]:
    """A module whose checkpoints are written on the training thread
    (``GRADSYNC_CHECKPOINT_WRITER=inline``) instead of by a writer process, so that its saves
    start no process: for unit tests whose checkpoints are not about the writer process
    (tests/ranks/test_writer_process.py is)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(WRITER_ENV, "inline")
        yield


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A one-rank gloo group in this process for a test module (no other process, no port)."""
    if dist.is_initialized():  # another module already made a (single-process) group
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
