"""What a launched worker reports about how it was started (importable by the workers), and a
script that launches it several times from one process (tests/ranks/test_forkserver_ranks.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def seen() -> dict[str, Any]:
    """This worker's thread setting and mark, whether its parent is a forkserver, and the first
    draws of its unseeded global generators."""
    import random

    import numpy as np
    import torch

    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    return {
        "threads": os.environ["OMP_NUM_THREADS"],
        "mark": os.environ.get("GRADSYNC_TEST_MARK", ""),
        "forked": b"multiprocessing.forkserver" in parent,
        "draws": [torch.rand(1).item(), float(np.random.rand()), random.random()],
    }


def main() -> None:
    from gradsync.processes.launch import launch

    rounds = []
    for threads, mark in ((1, "a"), (2, "a"), (1, "a"), (1, "b")):
        os.environ["GRADSYNC_TEST_MARK"] = mark
        rounds.append(launch(seen, nproc=2, threads=threads))
    json.dump([[r[rank] for rank in sorted(r)] for r in rounds], sys.stdout)


if __name__ == "__main__":
    main()
