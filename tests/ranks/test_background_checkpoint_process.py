"""The background writers' contract (tests/support/background_writers.py) kept by the child
process (``gradsync.checkpoint.writer_process``): two ranks' writers sharing one directory, as
the thread keeps it in tests/unit/test_background_checkpoint.py. What only the process does:
tests/ranks/test_writer_process.py."""

from __future__ import annotations

import pytest

from gradsync.checkpoint.writer_process import process_writer_available
from tests.support.background_writers import WriterContract

pytestmark = [
    pytest.mark.ranks,
    pytest.mark.skipif(not process_writer_available(), reason="needs Linux memfd"),
]


class TestTheProcessWriter(WriterContract):
    """The contract, kept by the writer process."""

    kind = "process"
