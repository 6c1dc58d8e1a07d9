"""Compressor encode and decode speed against a memory copy, and gradsync's PowerSGD against
torch's PowerSGD DDP hook.

Part 1, one process, one thread: every compressor's codec encodes and decodes the same 24 MB
fp32 gradient (the 6M-parameter mlp's: 6,000,835 elements, its parameter shapes for PowerSGD),
beside a copy of the same bytes (``dst.copy_(src)``, the memory-speed limit). Interleaved
rounds, the order rotating; per round each configuration runs ``--calls`` times and keeps its
median; the table shows the median over rounds. GB/s counts the fp32 input bytes over the time
of one encode plus one decode (what a push costs its worker and server together; a collective
hook also decodes every other rank's payload).

Part 2, 2 gloo ranks on loopback: gradsync ``powersgd:4`` under BSP against DDP with torch's
``powerSGD_hook`` (rank 4, both compressing from step 10, both with error feedback and warm
start) on the same mlp, interleaved in blocks in the same processes; median of per-round
ratios.
"""

from __future__ import annotations

import math
import os
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from benchmarks.harness import (
    REVERSE,
    Harness,
    interleave,
    machine,
    median_of_ratios,
    table,
    time_calls,
    time_interleaved,
)
from benchmarks.steps import POWERSGD_START, Trainer
from gradsync.compression import parse_compression
from gradsync.processes.launch import launch
from gradsync.workloads import make_workload

SPECS = ("fp16", "bf16", "int8", "topk:0.01", "randomk:0.01", "sign", "powersgd:4", "sparseloco")
COPY = "memory copy"
MLP_PARAMS = 6_000_000
SEED = 0
#: the issue's goal: encode + decode of a 24 MB gradient at this speed or better, one core.
GOAL_GBS = 1.0


def _shapes(params: int) -> list[list[int]]:
    model = make_workload("mlp", seed=SEED, params=params).build_model()
    return [list(p.shape) for p in model.parameters()]


def _gradient(numel: int) -> torch.Tensor:
    # Gradient-like: both signs, magnitudes spread over decades, no structure to exploit.
    gen = torch.Generator().manual_seed(SEED)
    r = torch.randn(numel, generator=gen)
    return r * torch.rand(numel, generator=gen).mul_(-6).exp_()


def _codec_rounds(params: int, rounds: int, calls: int) -> tuple[int, dict[str, list[Any]]]:
    """Per configuration, per round: (encode times, decode times) of every call, in seconds;
    the copy's times are its encode's."""
    torch.set_num_threads(1)
    shapes = _shapes(params)
    numel = sum(math.prod(s) for s in shapes)
    x = _gradient(numel)
    dst = torch.empty_like(x)
    codecs = {}
    for spec in SPECS:
        with warnings.catch_warnings():  # randomk:0.01's convergence warning: not the point here
            warnings.simplefilter("ignore", UserWarning)
            factory = parse_compression(spec).codec
        assert factory is not None, spec
        codecs[spec] = factory(numel, x.dtype, shapes, 0)
    step = [0]

    def run(name: str, _: int) -> tuple[list[float], list[float]]:
        if name == COPY:
            return time_calls(lambda: dst.copy_(x), calls), [0.0]
        codec = codecs[name]
        parts: list[torch.Tensor] = []

        def encode() -> None:
            step[0] += 1
            parts[:] = codec.encode(x, step[0])

        t_enc = time_calls(encode, calls)
        t_dec = time_calls(lambda: codec.decode(parts, step[0]), calls)
        return t_enc, t_dec

    # One untimed call of each: first-touch page faults, cached sample positions and tables.
    for name in (COPY, *SPECS):
        run(name, 0)
    results = interleave([COPY, *SPECS], rounds, run)
    return numel, {n: [r[n] for r in results] for n in (COPY, *SPECS)}


def _powersgd_worker(args: dict[str, Any]) -> dict[str, Any] | None:
    gs.init()
    torch.set_num_threads(1)
    wl = make_workload("mlp", seed=SEED, params=args["params"])
    per_rank = 32
    steps: dict[str, Callable[[int], Any]] = {}
    for name, mode, options in (
        ("gradsync powersgd:4", "gradsync", {"compression": "powersgd:4"}),
        ("DDP + torch powerSGD_hook", "ddp-powersgd", {}),
    ):
        torch.manual_seed(SEED)
        trainer = Trainer(mode, wl, per_rank * dist.get_world_size(), **options)
        steps[name] = trainer.step
    times = time_interleaved(
        steps,
        args["rounds"],
        args["steps"],
        warmup=POWERSGD_START,
        first=POWERSGD_START,
        style=REVERSE,
    )
    return times if dist.get_rank() == 0 else None


def _per_round(res: list[Any], pick: Callable[[list[float]], float]) -> list[float]:
    """One encode + decode time per round: ``pick`` (min or median) of each's calls."""
    return [pick(enc) + pick(dec) for enc, dec in res]


def _codec_table(numel: int, res: dict[str, list[Any]]) -> tuple[str, list[str]]:
    nbytes = 4 * numel
    copy_best = _per_round(res[COPY], min)
    met = []
    rows = []
    for name in (COPY, *SPECS):
        best = _per_round(res[name], min)
        typical = _per_round(res[name], statistics.median)
        gbs = nbytes / statistics.median(best) / 1e9
        if name != COPY and gbs >= GOAL_GBS:
            met.append(name)
        enc = statistics.median(min(e) for e, _ in res[name])
        dec = statistics.median(min(d) for _, d in res[name])
        rows.append(
            [
                name,
                f"{enc * 1e3:.2f}",
                f"{dec * 1e3:.2f}" if name != COPY else "",
                f"{gbs:.2f}",
                f"{nbytes / statistics.median(typical) / 1e9:.2f}",
                f"{median_of_ratios(copy_best, best) or 0:.3f}",
            ]
        )
    head = (
        "configuration | encode ms | decode ms | encode + decode GB/s "
        "| GB/s, median call | copy time / (encode + decode)"
    )
    return table(head, rows), met


def load_note(load: list[float]) -> str:
    """The machine's 1-minute load average before and after the run: the timings are only as
    quiet as the machine was."""
    before, after = load
    if before < 0.5:
        return f"idle before the run (1-minute load average {before:.1f}, {after:.1f} at its end)"
    return (
        f"shared with other jobs: 1-minute load average {before:.1f} just before the run and "
        f"{after:.1f} at its end (the run itself adds 1 to 2), so these are readings of a busy "
        "machine"
    )


def render(
    numel: int,
    codec_res: dict[str, list[Any]],
    psgd: dict[str, list[float]],
    args: Any,
    command: str,
) -> str:
    codec_text, met = _codec_table(numel, codec_res)
    missed = [s for s in SPECS if s not in met]
    g, d = psgd["gradsync powersgd:4"], psgd["DDP + torch powerSGD_hook"]
    ratio = median_of_ratios(g, d) or float("nan")
    psgd_rows = [[name, f"{statistics.median(ts) * 1e3:.1f}"] for name, ts in psgd.items()]
    return "\n".join(
        [
            "### Compressor speed against a memory copy (issue 16)\n",
            f"Command: `{command}` ({args.rounds} interleaved rounds, {args.calls} calls per "
            f"configuration per round, medians). Machine: {machine()}; {load_note(args.load)}. "
            "One thread (`torch.set_num_threads(1)`), "
            f"{numel:,} fp32 elements ({4 * numel / 1e6:.1f} MB, the "
            f"{args.params / 1e6:g}M-parameter mlp's "
            "gradient and, for powersgd:4, its parameter shapes). Per round, each configuration's "
            "fastest encode and fastest decode of its calls (the readings least disturbed by "
            "other jobs); the ms columns and encode + decode GB/s (input bytes over one encode "
            "plus one decode) are medians of those over rounds. GB/s, median call: the same "
            "from each round's median call instead, what a busy machine gives. Last column: "
            "the copy's time over the codec's in the same round, median over rounds (1.0 would "
            "be memory speed).\n",
            codec_text + "\n",
            f"At or above {GOAL_GBS:g} GB/s (the issue's goal): {', '.join(met) or 'none'}; "
            f"below: {', '.join(missed) or 'none'}.\n",
            f"PowerSGD rank 4 against torch's hook (2 gloo ranks on loopback, mlp with "
            f"{args.params:,} parameters, {args.psgd_rounds} interleaved rounds of "
            f"{args.steps} steps after {POWERSGD_START} untimed warm-up steps, median ms/step):\n",
            table("configuration | ms/step", psgd_rows) + "\n",
            f"gradsync powersgd:4 step time / DDP + torch powerSGD_hook: {ratio:.3f} (median of "
            "per-round ratios; below 1 is faster).",
        ]
    )


def main() -> None:
    h = Harness("benchmarks.codec_speed", __doc__, repeats=None)
    h.parser.add_argument("--rounds", type=int, default=15, help="codec rounds (%(default)s)")
    h.parser.add_argument("--calls", type=int, default=5, help="calls per round (%(default)s)")
    h.parser.add_argument("--psgd-rounds", type=int, default=6, help="%(default)s")
    h.parser.add_argument("--steps", type=int, default=10, help="steps per block (%(default)s)")
    h.parser.add_argument(
        "--part", choices=("all", "codecs", "powersgd"), default="all", help="%(default)s"
    )
    args = h.parse(rounds=2, calls=2, psgd_rounds=2, steps=2)
    args.load = [os.getloadavg()[0]]
    args.params = 200_000 if args.quick else MLP_PARAMS
    numel, codec_res = 0, {}
    if args.part in ("all", "codecs"):
        numel, codec_res = _codec_rounds(args.params, args.rounds, args.calls)
        print(_codec_table(numel, codec_res)[0], flush=True)
    psgd: dict[str, list[float]] = {}
    if args.part in ("all", "powersgd"):
        work = {"params": args.params, "rounds": args.psgd_rounds, "steps": args.steps}
        psgd = launch(_powersgd_worker, (work,), nproc=2)[0]
        print({name: statistics.median(ts) for name, ts in psgd.items()}, flush=True)
    args.load.append(os.getloadavg()[0])
    if args.part == "all":
        h.finish(render(numel, codec_res, psgd, args, h.command()))


if __name__ == "__main__":
    main()
