"""What the non-finite guard's three device-side operations cost, before and after issue 44's
rewrite of them (``gradsync/checks/guards.py``), side by side in one run.

Each runs on the hot path of a step: the verdict (``nonfinite_flag``) on every compressed
bucket and on every step of a fused optimizer; the poisoning (``poison_nonfinite_``) on every
compressed bucket; the zeroing (``zero_if_``) on every error-feedback residual of every step
under a fused optimizer with a lossy compressor. Each was replaced by a cheaper operation with
the same bits; the figures were noted in docstrings and commit messages only. Here the code
each replaced is kept as the named baseline (the ``old_*`` functions, each naming the commit
that replaced it) and timed against the library's current function, imported from
``gradsync.checks.guards``.

One thread (``torch.set_num_threads(1)``), float32 tensors of each ``--sizes``, on the CPU.
Timed: the every-step case, a finite tensor (and, for the zeroing, a step that was not
skipped), which both versions leave as it was; the timed buffer's bits are checked unchanged
afterwards. Before timing, old and new are run on the same inputs (finite with -0.0, a
subnormal and the largest float32; NaN, -NaN, +Inf and -Inf at the first, a middle and the
last element; the zeroing set and unset) and must give identical bits, or the run stops: the
two cannot silently be doing different work. In each repeat the cases run in a rotated order
and within a case old and new in an order reversed repeat by repeat; a block is ``--calls``
calls after one untimed, its figure the median call. Per case: the median block of each, the
median (middle half) of the per-repeat ratios new / old, and the minor page faults per call
(memory mapped afresh: the old verdict's float64 copy, where the allocator maps it each call).
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.harness import REVERSE, ROOT, ROTATE, Harness, fmt_iqr, machine, order, table
from gradsync.checks import guards

ARMS = ("old", "new")
MILLION = 1_000_000
#: the zeroing's 0-d verdicts, made once: the library's caller passes one it has already made
_BAD = {False: torch.tensor(False), True: torch.tensor(True)}


# The code the library replaced ------------------------------------------------------------------


def old_nonfinite_flag(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The code the library replaced: ``guards.nonfinite_flag`` as it was before commit 656512b
    (a float64 sum per tensor, which cannot overflow; float64 tensors element by element),
    copied unchanged."""
    if not tensors:
        raise ValueError("nonfinite_flag needs at least one tensor")
    device = tensors[0].device
    sums, exact = [], []
    for t in tensors:
        if t.is_complex():
            t = torch.view_as_real(t)
        if t.dtype == torch.float64:
            exact.append(torch.isfinite(t).all().to(device))
        else:
            sums.append(t.sum(dtype=torch.float64).to(device))
    bad = torch.zeros((), dtype=torch.bool, device=device)
    if sums:
        bad = bad | ~torch.isfinite(torch.stack(sums).sum())
    if exact:
        bad = bad | ~torch.stack(exact).all()
    return bad.to(torch.float32)


def old_poison_nonfinite_(buf: torch.Tensor) -> None:
    """The code the library replaced: ``BucketReducer``'s poisoning of a bucket before commit
    9d3f830 (gradsync/buckets.py), ``masked_fill_`` with the 0-d verdict as its mask. Its
    verdict is the library's ``nonfinite_flag``, as it was then (656512b came first), so the two
    differ by the fill alone."""
    buf.masked_fill_(guards.nonfinite_flag([buf]).to(torch.bool), float("nan"))


def old_zero_if_(t: torch.Tensor, bad: torch.Tensor) -> None:
    """The code the library replaced: ``scrub_nonfinite_on_device``'s zeroing before commit
    cf22953, ``masked_fill_`` with the 0-d bool as its mask."""
    t.masked_fill_(bad, 0)


@dataclass(frozen=True)
class Operation:
    name: str  # as the table names it
    function: str  # the library's, in gradsync.checks.guards
    commit: str  # the one that replaced the old code
    noted: str  # the figure the docstring and the commit message give
    old: Callable[..., Any]
    new: Callable[..., Any]

    def call(self, arm: str, t: torch.Tensor, bad: bool = False) -> torch.Tensor | None:
        """``arm``'s version on ``t``, as the library calls it: a list of tensors for the
        verdict (returned), a 0-d bool for the zeroing; the others change ``t`` in place."""
        fn = self.old if arm == "old" else self.new
        if self.function == "nonfinite_flag":
            return fn([t])
        if self.function == "zero_if_":
            return fn(t, _BAD[bad])
        return fn(t)


OPERATIONS = (
    Operation(
        "non-finite verdict",
        "nonfinite_flag",
        "656512b",
        "43 ms to 1.5 ms for 10M",
        old_nonfinite_flag,
        guards.nonfinite_flag,
    ),
    Operation(
        "poisoning a bucket",
        "poison_nonfinite_",
        "9d3f830",
        "3.6 ms to 0.4 ms for 4.6M, the fill alone",
        old_poison_nonfinite_,
        guards.poison_nonfinite_,
    ),
    Operation(
        "zeroing a residual",
        "zero_if_",
        "cf22953",
        "2.9 ms to 0.3 ms for 4.6M",
        old_zero_if_,
        guards.zero_if_,
    ),
)


# Same bits --------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, as integers of its width: NaN's sign and payload, -0.0."""
    return t.contiguous().view({4: torch.int32, 8: torch.int64}[t.element_size()])


def inputs(size: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Float32 tensors of ``size`` elements to run old and new on: finite with the awkward
    finite values, and each non-finite value at the first, a middle and the last element."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(size, generator=g)
    awkward = (-0.0, 1e-40, torch.finfo(torch.float32).max)  # 1e-40 is a subnormal
    for i, v in enumerate(awkward[:size]):
        base[(1 + i * 7919) % size] = v
    neg_nan = torch.tensor(-0x400000, dtype=torch.int32).view(torch.float32)  # 0xffc00000
    out = [("finite", base)]
    for name, v in (("NaN", float("nan")), ("+Inf", float("inf")), ("-Inf", float("-inf"))):
        for pos in sorted({0, size // 2, size - 1}):
            t = base.clone()
            t[pos] = v
            out.append((f"{name} at {pos}", t))
    t = base.clone()
    t[size // 2] = neg_nan  # the NaN x86 makes of 0 * Inf
    out.append((f"-NaN at {size // 2}", t))
    return out


def check_same_bits(op: Operation, size: int, seed: int) -> int:
    """Run old and new on the same inputs; raise unless they give identical bits (the result
    and the tensor after). Where nothing is to change (a finite tensor, a step not skipped),
    both must also leave the tensor's bits as they were. Returns the comparisons made."""
    compared = 0
    for what, x in inputs(size, seed):
        for bad in (False, True) if op.function == "zero_if_" else (False,):
            a, b = x.clone(), x.clone()
            got_a, got_b = op.call("old", a, bad), op.call("new", b, bad)
            same = torch.equal(bits(a), bits(b))
            if got_a is not None and got_b is not None:
                same = same and got_a.dtype == got_b.dtype and torch.equal(bits(got_a), bits(got_b))
            if what == "finite" and not bad and op.function != "nonfinite_flag":
                same = same and torch.equal(bits(a), bits(x))
            if not same:
                note = ", bad set" if bad else ""
                raise AssertionError(
                    f"{op.function}: old and new differ on {size:,} float32 ({what}{note})"
                )
            compared += 1
    return compared


# Timing -----------------------------------------------------------------------------------------


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_block(op: Operation, arm: str, t: torch.Tensor, calls: int) -> tuple[float, float]:
    """Median seconds of ``calls`` calls of ``arm`` on ``t``, after one untimed, and the minor
    page faults per call (memory the allocator maps afresh, touched page by page)."""
    op.call(arm, t)
    times = []
    faults = _minor_faults()
    for _ in range(calls):
        t0 = time.perf_counter()
        op.call(arm, t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (_minor_faults() - faults) / calls


def measure(sizes: list[int], repeats: int, calls: int, seed: int = 0) -> dict[str, Any]:
    """Per case (operation, size) and arm, the median call of each repeat's block."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compared = sum(check_same_bits(op, n, seed) for op in OPERATIONS for n in sizes)
        tensors = {n: inputs(n, seed)[0][1] for n in sizes}  # finite: nothing changes
        kept = {n: t.clone() for n, t in tensors.items()}
        cases = [(op, n) for n in sizes for op in OPERATIONS]
        blocks: dict[tuple[str, int, str], list[float]] = {
            (op.function, n, arm): [] for op, n in cases for arm in ARMS
        }
        faults: dict[tuple[str, int, str], list[float]] = {key: [] for key in blocks}
        for r in range(repeats):
            for op, n in order(cases, r, ROTATE):
                for arm in order(ARMS, r, REVERSE):
                    seconds, faulted = time_block(op, arm, tensors[n], calls)
                    blocks[op.function, n, arm].append(seconds)
                    faults[op.function, n, arm].append(faulted)
        for n, t in tensors.items():  # the timed work left the tensor as it was
            if not torch.equal(bits(t), bits(kept[n])):
                raise AssertionError(f"the timed {n:,}-element tensor changed")
    finally:
        torch.set_num_threads(threads)
    return {"blocks": blocks, "faults": faults, "compared": compared}


# The write-up -----------------------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{n / MILLION:g}M" if n >= MILLION else f"{n:,}"


def render(
    result: dict[str, Any],
    args: Any,
    sizes: list[int],
    command: str,
    loads: tuple[float, float],
    code: str,
    seconds: float,
) -> str:
    blocks, faults = result["blocks"], result["faults"]

    def ms(function: str, n: int, arm: str) -> float:
        return statistics.median(blocks[function, n, arm]) * 1e3

    rows = []
    for op in OPERATIONS:
        for n in sizes:
            old, new = blocks[op.function, n, "old"], blocks[op.function, n, "new"]
            ratios = [b / a for a, b in zip(old, new, strict=True)]
            rows.append(
                [
                    f"{op.name}: `{op.function}` ({op.commit})",
                    _size(n),
                    f"{ms(op.function, n, 'old'):.3f}",
                    f"{ms(op.function, n, 'new'):.3f}",
                    fmt_iqr(ratios, ".3f"),
                    f"{1 / statistics.median(ratios):.1f}x",
                    " / ".join(
                        f"{statistics.median(faults[op.function, n, arm]):.0f}" for arm in ARMS
                    ),
                ]
            )
    # The poisoning less its verdict, repeat by repeat: the fill alone, as the noted figure.
    fills = []
    for n in sizes:
        verdict = blocks["nonfinite_flag", n, "new"]
        alone = {
            arm: statistics.median(
                (p - v) * 1e3
                for p, v in zip(blocks["poison_nonfinite_", n, arm], verdict, strict=True)
            )
            for arm in ARMS
        }
        fills.append(f"{alone['old']:.3f} ms to {alone['new']:.3f} ms for {_size(n)}")
    noted = "; ".join(f"`{op.function}` {op.noted}" for op in OPERATIONS)
    header = [
        "operation (commit)",
        "float32 elements",
        "old, ms",
        "new, ms",
        "new / old (middle half)",
        "old / new",
        "page faults a call, old / new",
    ]
    return (
        "## The non-finite guard's device-side operations, before and after (issue 44)\n\n"
        f"Command: `{command}` ({args.repeats} repeats, blocks of {args.calls} calls; "
        f"{seconds:.0f} s), {code}. Machine: {machine()}; one thread "
        "(`torch.set_num_threads(1)`), on the CPU. 1-minute load average "
        f"{loads[0]:.2f} at the start and {loads[1]:.2f} at the end.\n\n"
        "Each operation's old code (kept in the benchmark as it was before the commit named, "
        "the commit that replaced it) against the library's current function from "
        "`gradsync.checks.guards`, on the same float32 tensor, finite (and, for the zeroing, a "
        "step not skipped): the every-step case, which leaves the tensor as it was. In each "
        "repeat the cases run in a rotated order, old and new in an order reversed repeat by "
        "repeat; a block's figure is its median call; ms: the median block; new / old: the "
        "median (middle half) of the per-repeat ratios, old / new its inverse; page faults: "
        "minor faults per call, the median block. Before timing, old and new gave identical "
        f"bits in all {result['compared']} comparisons on the same inputs (finite with -0.0, a "
        "subnormal and the largest float32; NaN, -NaN, +Inf and -Inf at the first, a middle "
        "and the last element; the zeroing set and unset), or the run would have stopped.\n\n"
        + table(header, rows)
        + f"\n\nThe figures noted with the change (one thread, medians of 31 or 51): {noted}. "
        "The poisoning includes its verdict (`nonfinite_flag`, the library's in both); less the "
        "verdict's new time of the same repeat, the fill alone went from "
        + "; ".join(fills)
        + " (medians of the per-repeat differences).\n"
    )


def guards_revision() -> str:
    """Which ``gradsync/checks/guards.py`` the run measured: the last commit that changed it,
    and whether the checkout's copy differs from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    path = "gradsync/checks/guards.py"
    last = git("log", "-1", "--format=%h", "--", path)
    if not last:
        return f"`{path}` outside a git checkout"
    dirty = git("status", "--porcelain", "--", path)
    return f"`{path}` as of commit {last}" + (" with uncommitted changes" if dirty else "")


def main(argv: list[str] | None = None) -> None:
    h = Harness("benchmarks.guard_costs", __doc__, repeats=31)
    h.parser.add_argument(
        "--sizes", default="1,4.6,10", help="float32 elements, in millions (%(default)s)"
    )
    h.parser.add_argument("--calls", type=int, default=5, help="timed calls per block")
    args = h.parse(argv, repeats=2, calls=2, sizes="0.001,0.01")
    try:
        sizes = [round(float(s) * MILLION) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        h.error(f"--sizes: {args.sizes!r} is not a list of numbers")
    if not sizes or min(sizes) < 1:
        h.error("--sizes: at least one size of at least one element")
    if args.calls < 1:
        h.error("--calls must be at least 1")
    start, code, t0 = os.getloadavg()[0], guards_revision(), time.monotonic()
    result = measure(sizes, args.repeats, args.calls)
    seconds, end = time.monotonic() - t0, os.getloadavg()[0]
    h.finish(render(result, args, sizes, h.command(), (start, end), code, seconds))


if __name__ == "__main__":
    main()
