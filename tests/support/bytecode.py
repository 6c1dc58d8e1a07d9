"""Bytecode for the processes the suite starts, where the environment says to write none.

With ``PYTHONDONTWRITEBYTECODE`` set (the shells on this project's 2-core machine set it) no
process writes ``__pycache__``, so every process the suite starts (each rank of
``run_ranks``, each ``gradsync run`` and its workers, each torchrun worker) compiled every
gradsync and tests.support module it imported from source: about 0.2 s of a core per process,
and a full run starts several hundred. A process still reads the bytecode it finds, so the
session writes it once, up front (``tests/conftest.py``), for gradsync/ and tests/.

The files are PEP 552's checked-hash pycs: at every import Python hashes the source and uses
the bytecode only if it was compiled from exactly that source. A file edited since (other work
in the same tree, during the run) is compiled from source, as without this; never run stale,
as a timestamp pyc could be after an edit of the same size within the same second.
"""

from __future__ import annotations

import importlib.util
import py_compile
from pathlib import Path

#: PEP 552's flags word: hash-based (bit 0), checked against the source at import (bit 1)
CHECKED_HASH_FLAGS = (0b11).to_bytes(4, "little")


def is_current(source: Path, cfile: Path) -> bool:
    """Whether ``cfile`` is a checked-hash pyc of ``source`` as it is now, for this Python."""
    try:
        header = cfile.read_bytes()[:16]
        data = source.read_bytes()
    except OSError:
        return False
    return header == importlib.util.MAGIC_NUMBER + CHECKED_HASH_FLAGS + importlib.util.source_hash(
        data
    )


def compile_tree(*roots: Path) -> int:
    """Write a checked-hash pyc for every ``.py`` under ``roots`` whose pyc is missing or not
    of its current source (where the interpreter looks for it: ``__pycache__``, or under
    ``sys.pycache_prefix``); returns how many were written. A file that does not compile (one
    being edited) or cannot be written is left to be compiled at import, as before."""
    written = 0
    for root in roots:
        for source in sorted(root.rglob("*.py")):
            cfile = Path(importlib.util.cache_from_source(str(source)))
            if is_current(source, cfile):
                continue
            try:
                py_compile.compile(
                    str(source),
                    cfile=str(cfile),
                    doraise=True,
                    invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH,
                )
            except (py_compile.PyCompileError, OSError, ValueError):
                continue
            written += 1
    return written
