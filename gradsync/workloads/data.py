"""Text for ``charlm``: a deterministic sample of the standard library's own source files.

Every machine with Python has them, so the default workload trains on real text without a
download. Bytes are the tokens (values above 127 fold into one symbol), so no vocabulary has
to be built or shipped.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from gradsync.errors import UsageError

VOCAB = 128
DEFAULT_BYTES = 1_000_000
#: the smallest text worth training on: room for many distinct 64-character windows
MIN_BYTES = 1024
_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in sorted(root.rglob("*.py"))
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts)
    ]
    if not files:
        raise UsageError(f"no Python sources found under {root}: pass a text file with --data")
    return files


def _valid_data() -> str:
    return (
        f"pass an existing text file of at least {MIN_BYTES} bytes, or omit --data to train "
        "on the standard-library sample"
    )


def check_data_file(path: str) -> None:
    """Raise ``UsageError`` unless ``path`` is a readable file holding enough text: called
    before any worker starts, so a bad ``--data`` costs no launch."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--data file {path!r} does not exist or is not a file; {_valid_data()}")
    size = p.stat().st_size
    if size < MIN_BYTES:
        raise UsageError(f"--data file {path!r} holds {size} bytes; {_valid_data()}")


def load_text(path: str | None = None, max_bytes: int = DEFAULT_BYTES) -> torch.Tensor:
    """Token ids (int64) of ``path``, or of a stdlib sample when ``path`` is None."""
    if path is not None:
        check_data_file(path)
        raw = Path(path).read_bytes()[:max_bytes]
    else:
        files = stdlib_sources()
        # Every k-th file in sorted order spreads the sample across the whole library.
        stride = max(1, len(files) // 200)
        chunks, total = [], 0
        for f in files[::stride]:
            data = f.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        raw = b"\n".join(chunks)[:max_bytes]
    if len(raw) < MIN_BYTES:  # only a truncated read or a tiny stdlib can get here
        raise UsageError(f"--data file {path!r} holds {len(raw)} bytes; {_valid_data()}")
    ids = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
    return ids.clamp_(max=VOCAB - 1)
