"""What a launched worker reports about how it was started (importable by the workers), and a
script that launches it several times from one process (``test_forkserver``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def seen() -> dict[str, str | bool]:
    """This worker's thread setting and mark, and whether its parent is a forkserver."""
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    return {
        "threads": os.environ["OMP_NUM_THREADS"],
        "mark": os.environ.get("GRADSYNC_TEST_MARK", ""),
        "forked": b"multiprocessing.forkserver" in parent,
    }


def main() -> None:
    from gradsync.launch import launch

    rounds = []
    for threads, mark in ((1, "a"), (2, "a"), (1, "a"), (1, "b")):
        os.environ["GRADSYNC_TEST_MARK"] = mark
        rounds.append(launch(seen, nproc=2, threads=threads))
    json.dump([[r[rank] for rank in sorted(r)] for r in rounds], sys.stdout)


if __name__ == "__main__":
    main()
