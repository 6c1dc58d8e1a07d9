import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

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
