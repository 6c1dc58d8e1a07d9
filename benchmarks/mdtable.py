"""Write a benchmark's markdown into its own marked section of BENCHMARKS.md."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import torch

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def machine() -> str:
    import os

    return (
        f"{os.cpu_count()} cores ({platform.machine()}), Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def write_section(name: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = (
        pattern.sub(lambda _: block, text) if pattern.search(text) else text + "\n" + block + "\n"
    )
    path.write_text(text)
