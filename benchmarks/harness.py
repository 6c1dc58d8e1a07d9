"""What every benchmark shares: its command line (``Harness``: ``--write``, ``--md``, ``--quick``,
``--repeats``, the quoted command, the write-out), the interleaved run order (``interleave``,
``order``, ``time_interleaved``), the statistics of per-repeat ratios (``median_of_ratios``,
``median_iqr``), the machine line and markdown tables. Benchmarks run as modules from the
repository root: ``python -m benchmarks.NAME``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"

K = TypeVar("K")
R = TypeVar("R")

# The orders a repeat runs its configurations in. Either way no configuration always runs
# first, or always right after the same other one (a fixed order showed the first one up to
# 10% slower), and a drift of the machine's speed over the run falls on all of them alike.
ROTATE = "rotate"  # A B C, B C A, C A B, ...
REVERSE = "reverse"  # A B C, C B A, A B C, ...

# Options that say where output or scratch files go: not part of the quoted command.
_NOT_QUOTED = ("--workdir", "--md")


# The command line -------------------------------------------------------------------------------


class Harness:
    """One benchmark's options, quoted command and write-out. ``section`` names the marked
    section of ``md`` that ``--write`` replaces (default: the module's name; None: the whole
    file); ``repeats`` is the default of ``--repeats`` (None: no such flag); ``python`` starts
    the quoted command (the cluster benchmark runs as root, outside the virtual environment).
    """

    def __init__(
        self,
        module: str,
        doc: str | None,
        *,
        repeats: int | None,
        section: str | None = "",
        md: Path = BENCHMARKS_MD,
        python: str = "python",
    ) -> None:
        self.module = module
        self.section = module.rpartition(".")[2] if section == "" else section
        self.python = python
        self.parser = argparse.ArgumentParser(
            prog=f"python -m {module}",
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self.where = f"section '{self.section}' of " if self.section else ""
        p = self.parser
        p.add_argument("--write", action="store_true", help=f"update {self.where}the --md file")
        p.add_argument("--md", type=Path, default=md, help="file --write updates (%(default)s)")
        p.add_argument(
            "--quick", action="store_true", help="smoke run: small and short, not for tables"
        )
        if repeats is not None:
            p.add_argument("--repeats", type=int, default=repeats, help="default %(default)s")
        self.args = argparse.Namespace()
        self.argv: list[str] = []

    def parse(self, argv: Sequence[str] | None = None, **quick: Any) -> argparse.Namespace:
        """Parse the command line; with ``--quick``, ``quick`` replaces the defaults (flags
        given explicitly still win, and names that are no flag become attributes too)."""
        self.argv = list(sys.argv[1:] if argv is None else argv)
        if quick and self.parser.parse_known_args(self.argv)[0].quick:
            self.parser.set_defaults(**quick)
        self.args = self.parser.parse_args(self.argv)
        if getattr(self.args, "repeats", 1) < 1:
            self.parser.error("--repeats must be at least 1")
        return self.args

    def error(self, message: str) -> NoReturn:
        self.parser.error(message)

    def command(self, argv: Sequence[str] | None = None) -> str:
        """The command that reproduces this run, as the markdown quotes it: the arguments
        given (or ``argv``), less where output and scratch files went."""
        rest, shown = list(self.argv if argv is None else argv), []
        while rest:
            arg = rest.pop(0)
            if arg in _NOT_QUOTED:
                rest = rest[1:]
            elif not arg.startswith(tuple(f"{o}=" for o in _NOT_QUOTED)):
                shown.append(arg)
        return " ".join([self.python, "-m", self.module, *shown])

    def finish(self, text: str, skip: str | None = None) -> None:
        """Print the markdown; with ``--write``, put it into the file, unless ``skip`` says why
        not (a part failed, a partial run)."""
        print(text, flush=True)
        if not self.args.write:
            return
        md: Path = self.args.md
        if skip:
            print(f"{self.where}{md.name} left as it was: {skip}", file=sys.stderr)
        elif self.section is None:
            md.write_text(text)
        else:
            write_section(self.section, text, md)


# Markdown ---------------------------------------------------------------------------------------


def machine() -> str:
    return (
        f"{os.cpu_count()} cores ({platform.machine()}), Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


#: /proc/stat's cpu line, the fields that count as busy: user, nice, system, irq, softirq, steal
#: (idle and iowait do not); guest time is already inside user
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def busy_ticks(cpu_line: bytes) -> int:
    """The busy clock ticks of /proc/stat's ``cpu`` line (``_BUSY_FIELDS``)."""
    fields = cpu_line.split()[1:]
    return sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot, every core and process together,
    the kernel's network work (softirqs) included; None where /proc/stat is not there. Its
    difference across a run, over the cores (``os.cpu_count()``, the cores that line counts),
    is the least wall time that run's work could take on this machine. Counted in clock ticks
    (10 ms on Linux): a difference is good to about that much a core. A CPU quota (a cgroup's
    ``cpu.max``) is not seen."""
    try:
        with open("/proc/stat", "rb") as f:
            ticks = busy_ticks(f.readline())
    except (OSError, ValueError, IndexError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def table(header: str | list[str], rows: list[list[str]]) -> str:
    """A markdown table; ``header`` may be written as it prints, ``"a | b | c"``."""
    if isinstance(header, str):
        header = header.split(" | ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """``count`` processes spinning on a core each while the block runs: a loaded machine for
    the stress benchmarks (``exit_stress``, ``load_stress``)."""
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]
    for p in spinners:
        p.start()
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.join()


def write_section(name: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace the text between ``<!-- name:start -->`` and ``<!-- name:end -->`` in ``path``
    (appended if absent), so each benchmark rewrites only its own part of the file."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = (
        pattern.sub(lambda _: block, text) if pattern.search(text) else text + "\n" + block + "\n"
    )
    path.write_text(text)


# Run order --------------------------------------------------------------------------------------


def order(names: Sequence[K], repeat: int, style: str = ROTATE) -> list[K]:
    """The order of ``names`` in repeat ``repeat`` (from 0): ROTATE or REVERSE."""
    names = list(names)
    if style == ROTATE:
        k = repeat % len(names) if names else 0
        return names[k:] + names[:k]
    if style == REVERSE:
        return names if repeat % 2 == 0 else names[::-1]
    raise ValueError(f"unknown order {style!r}")


def interleave(
    names: Sequence[K],
    repeats: int,
    run: Callable[[K, int], R],
    style: str = ROTATE,
    progress: str | None = None,
) -> list[dict[K, R]]:
    """``run(name, repeat)`` for every name in every repeat, in ``order``: per repeat, the
    results by name. Ratios are then taken within a repeat, where the configurations ran
    minutes apart at most, so slow drifts of the machine cancel. With ``progress``, a line
    per repeat goes to stderr."""
    results = []
    for r in range(repeats):
        now = order(names, r, style)
        if progress is not None:
            line = f"{progress}repeat {r + 1}/{repeats}: {', '.join(map(str, now))}"
            print(line, file=sys.stderr, flush=True)
        got = {n: run(n, r) for n in now}
        results.append({n: got[n] for n in names})
    return results


def time_block(step: Callable[[int], Any], steps: int, first: int = 0) -> float:
    """Mean seconds of ``step(i)`` for i in [first, first + steps), on every rank, between two
    barriers so that every rank's block covers the same steps."""
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(first, first + steps):
        step(i)
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def time_calls(fn: Callable[[], Any], calls: int) -> list[float]:
    """Seconds of each of ``calls`` calls of ``fn``, on this thread alone (no barrier)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def time_interleaved(
    steps: dict[K, Callable[[int], Any]],
    repeats: int,
    block: int,
    *,
    warmup: int = 2,
    first: int = 0,
    style: str = ROTATE,
) -> dict[K, list[float]]:
    """Mean step time of every block, by configuration, in repeat order: after ``warmup``
    untimed steps of each (allocator, first buckets, connections), one block of ``block``
    steps per configuration and repeat, steps ``first + r * block`` on in repeat r."""
    for step in steps.values():
        time_block(step, warmup)
    runs = interleave(
        list(steps), repeats, lambda n, r: time_block(steps[n], block, first + r * block), style
    )
    return {n: [run[n] for run in runs] for n in steps}


# Statistics -------------------------------------------------------------------------------------


def median(values: Iterable[float | None]) -> float | None:
    """Median of the known values; None if there are none (a target never reached)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def pair_ratios(num: Iterable[float | None], den: Iterable[float | None]) -> list[float]:
    """The per-repeat ratios; a repeat where either figure is missing (or the denominator is
    0) is left out."""
    return [a / b for a, b in zip(num, den, strict=True) if a is not None and b]


def median_of_ratios(num: Iterable[float | None], den: Iterable[float | None]) -> float | None:
    """Median of ``pair_ratios``; None if none is left."""
    return median(pair_ratios(num, den))


def median_iqr(values: Sequence[float]) -> tuple[float, float, float]:
    """Median and interquartile range (the middle half of the values): (median, q1, q3)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return med, q1, q3


def fmt_iqr(values: Sequence[float], spec: str = ".3f", unit: str = "", sep: str = "-") -> str:
    """``median (q1-q3)``: the figure and how far to trust it."""
    med, q1, q3 = median_iqr(values)
    return f"{med:{spec}}{unit} ({q1:{spec}}{sep}{q3:{spec}})"


def span(values: Sequence[float], fmt: str = "{:+.1%}") -> str:
    """``lo to hi``, or one figure where both print the same."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo} to {hi}"
