"""``gradsync bench allreduce``: time real all-reduces on the live backend, like nccl-tests.

Each size is timed over many repeats, each repeat starting behind a barrier so every rank
enters the collective together; a repeat's time is the slowest rank's (the collective is done
when the last rank has the result), and the reported time is the median repeat.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from gradsync.errors import UsageError
from gradsync.sim.model import Fit, algbw, busbw, fit_alpha_beta

DEFAULT_SIZES = tuple(4096 * 4**i for i in range(8))  # 4 KiB .. 64 MiB, x4 steps
WARMUP = 3


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    nproc: int = 2
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 20

    def __post_init__(self) -> None:
        if self.nproc < 2:
            raise UsageError(f"--nproc must be at least 2 for an all-reduce, got {self.nproc}")
        bad = [s for s in self.sizes if s < 4 or s % 4]
        if not self.sizes or bad:
            raise UsageError(
                "--sizes must be positive multiples of 4 bytes (float32 values), got "
                f"{', '.join(map(str, bad)) or 'none'}"
            )
        if self.repeats < 1:
            raise UsageError(f"--repeats must be at least 1, got {self.repeats}")

    def repeats_for(self, nbytes: int) -> int:
        # Big messages are slow and steady: fewer repeats keep the default run short.
        return max(3, min(self.repeats, int(self.repeats * (4 << 20) / nbytes)))


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchRow:
    nbytes: int
    time_s: float
    algbw: float
    busbw: float
    #: every repeat's time (the slowest rank's), so the simulator can sample the spread
    samples_s: tuple[float, ...] = ()


def _worker(sizes: tuple[int, ...], repeats: tuple[int, ...]) -> list[list[float]]:
    """Runs in every rank: per size, the list of this rank's repeat times in seconds."""
    import torch
    import torch.distributed as dist

    import gradsync.runtime as rt

    rt.init()
    out: list[list[float]] = []
    try:
        for nbytes, reps in zip(sizes, repeats, strict=True):
            buf = torch.ones(nbytes // 4, dtype=torch.float32, device=rt.device())
            for _ in range(WARMUP):
                dist.all_reduce(buf)
            times = []
            for _ in range(reps):
                dist.barrier()
                if buf.is_cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                if buf.is_cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out.append(times)
    finally:
        dist.destroy_process_group()
    return out


def run_bench(cfg: BenchConfig) -> tuple[list[BenchRow], Fit]:
    """Measure, then fit alpha and beta of a ring all-reduce to the median times."""
    from gradsync.processes.launch import launch

    repeats = tuple(cfg.repeats_for(s) for s in cfg.sizes)
    per_rank = launch(_worker, (cfg.sizes, repeats), nproc=cfg.nproc)
    rows = []
    for i, nbytes in enumerate(cfg.sizes):
        slowest = [max(r[i][k] for r in per_rank.values()) for k in range(repeats[i])]
        t = statistics.median(slowest)
        rows.append(
            BenchRow(
                nbytes=nbytes,
                time_s=t,
                algbw=algbw(nbytes, t),
                busbw=busbw("allreduce", cfg.nproc, nbytes, t),
                samples_s=tuple(slowest),
            )
        )
    fit = fit_alpha_beta([r.nbytes for r in rows], [r.time_s for r in rows], n=cfg.nproc)
    return rows, fit


def describe_fit(fit: Fit) -> tuple[str, list[str]]:
    """The fit's one-line summary, and warnings for parameters the timings did not resolve.

    A least-squares fit to noisy times can give beta <= 0 (or alpha < 0): the times did not
    grow with size (or shrink to a floor) beyond their noise. That is not an infinitely fast
    link; the simulator clamps such a value to 0 when it loads the file.
    """
    warnings = []
    if fit.beta > 0:
        link = f"{8 / fit.beta / 1e9:.2f} Gbit/s link"
    else:
        link = "link bandwidth not resolved"
        warnings.append(
            f"the fitted beta is {fit.beta * 1e9:.4f} ns/byte (<= 0): the measured times do not "
            "grow with message size beyond their noise, so they say nothing about the link's "
            "bandwidth (it is not infinite); use more --repeats, or larger --sizes (MiB and "
            "up) where transfer time dominates, on a quieter machine"
        )
    if fit.alpha < 0:
        warnings.append(
            f"the fitted alpha is {fit.alpha * 1e6:.1f} us (< 0): the small-message times are "
            "too noisy to resolve the latency (it is treated as 0); use more --repeats, or "
            "add smaller --sizes"
        )
    line = (
        f"fit ({fit.algorithm} {fit.op}, {fit.n} ranks): alpha = {fit.alpha * 1e6:.1f} us, "
        f"beta = {fit.beta * 1e9:.4f} ns/byte ({link}), "
        f"worst relative error {fit.max_rel_error:.1%}"
    )
    return line, warnings


def format_table(rows: list[BenchRow], nproc: int, backend: str) -> str:
    lines = [
        f"# all-reduce, {nproc} ranks, backend {backend}, float32, in-place",
        f"{'size(B)':>12} {'count':>10} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}",
    ]
    for r in rows:
        lines.append(
            f"{r.nbytes:>12d} {r.nbytes // 4:>10d} {r.time_s * 1e6:>11.1f} "
            f"{r.algbw / 1e9:>12.3f} {r.busbw / 1e9:>12.3f}"
        )
    return "\n".join(lines)
