"""Text for ``charlm``: a deterministic sample of the standard library's own source files.

Every machine with Python has them, so the default workload trains on real text without a
download. Bytes are the tokens (values above 127 fold into one symbol), so no vocabulary has
to be built or shipped.
"""

from __future__ import annotations

import codecs
import os
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
    """The standard library's ``.py`` files outside ``_SKIP_DIRS``, sorted.

    Walked with the skipped directories pruned, not listed whole and filtered: the stdlib
    directory may hold a large ``site-packages``, and listing it all took 0.3 s of every
    worker's start here, a restarted one's included (half of a restart's time to its first
    step). Symbolic links to directories are not followed, as ``Path.rglob`` does not."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        found += [Path(top, n) for n in names if n.endswith(".py")]
    files = sorted(found)
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
    with open(p, "rb") as fh:
        found = not_text(fh.read(DEFAULT_BYTES))  # what load_text trains on
    if found:
        encoding = "UTF-32" if "UTF-32" in found else "UTF-16"
        fix = (
            f"convert it (iconv -f {encoding} -t UTF-8)"
            if encoding in found
            else "pass a text file"
        )
        raise UsageError(
            f"--data file {path!r} is not UTF-8 or ASCII text: {found}; charlm trains on a "
            f"text file's bytes as characters: {fix}"
        )


#: Byte-order marks of the encodings whose text is not its bytes as characters (UTF-32's
#: little-endian mark begins with UTF-16's, so it comes first).
_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)


def not_text(raw: bytes) -> str | None:
    """What makes ``raw`` unfit for charlm, which takes bytes as characters, or None for text.

    UTF-16 (with or without a byte-order mark) would teach the model that every other character
    is NUL, binary data that characters mean nothing. Other 8-bit text (Latin-1) passes: its
    bytes above 127 fold into one symbol, as UTF-8's do.
    """
    for bom, encoding in _BOMS:
        if raw.startswith(bom):
            return f"it starts with a {encoding} byte-order mark"
    nul = raw.find(b"\0")
    if nul >= 0:
        even, odd = raw[0::2], raw[1::2]
        if max(even.count(0) / max(len(even), 1), odd.count(0) / max(len(odd), 1)) > 0.4:
            return "every other byte is NUL, as in UTF-16 text without a byte-order mark"
        return f"it holds NUL bytes, as binary files do (the first at byte {nul})"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(raw, final=False)
        return None
    except UnicodeDecodeError:
        pass
    controls = sum(raw.count(c) for c in _CONTROLS)
    if controls * 10 > len(raw):
        return (
            f"it is not UTF-8 and {controls} of its first {len(raw)} bytes are control "
            "characters, as in binary files"
        )
    return None


#: bytes that no text holds (tab, newlines and form feed aside)
_CONTROLS = [c for c in range(1, 32) if chr(c) not in "\t\n\r\f\v"] + [127]


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
