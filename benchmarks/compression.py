"""Gradient compressors under BSP, and gradsync PowerSGD against DDP's own PowerSGD hook.

2 gloo ranks; `charlm` and a 6M-parameter `mlp` (a 24 MB gradient, so the exchange is not
negligible). Every configuration trains its own replica from the same seed on the same batches,
interleaved in blocks in the same processes, so step times compare within a round and final
losses after the same number of steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from benchmarks.codec_speed import load_note
from benchmarks.harness import REVERSE, Harness, machine, table, time_interleaved
from benchmarks.steps import POWERSGD_START, Trainer, bytes_per_step_and_close
from gradsync.processes.launch import launch
from gradsync.workloads import make_workload

COMPRESSORS = ("none", "fp16", "bf16", "int8", "topk:0.01", "randomk:0.01", "sign", "powersgd:4")
DDP_CONFIGS = {"ddp": "ddp", "ddp+powersgd:4": "ddp-powersgd"}  # name: Trainer mode
# Both PowerSGDs run plain all-reduce for their first 10 steps: keep those untimed.
WARMUP = POWERSGD_START
LAST = 10  # final loss: mean of the last LAST steps, one step's loss is too noisy to compare
SEED = 0
GAP_LIMIT = 0.05  # the claim: final loss within 5% of uncompressed BSP
Step = Callable[[int], None]


def _config(
    name: str, workload: Any, per_rank: int
) -> tuple[Step, gs.Synchronizer | None, list[float]]:
    """One replica trained from the same seed: its step, its Synchronizer (gradsync) and the
    losses its steps append."""
    torch.manual_seed(SEED)  # DDP and gradsync both broadcast rank 0's init anyway
    mode = DDP_CONFIGS.get(name, "gradsync")
    trainer = Trainer(mode, workload, per_rank * dist.get_world_size(), compression=name)
    losses: list[float] = []

    def step(i: int) -> None:
        losses.append(float(trainer.step(i).detach()))

    return step, trainer.sync, losses


def _measure(workload: Any, per_rank: int, repeats: int, steps: int) -> dict[str, Any]:
    names = list(COMPRESSORS) + list(DDP_CONFIGS)
    configs = {n: _config(n, workload, per_rank) for n in names}
    params = sum(p.numel() for p in workload.build_model().parameters())
    # Training goes on across blocks, step numbers too: every configuration has taken the same
    # steps when its final loss is read.
    times = time_interleaved(
        {n: step for n, (step, _, _) in configs.items()},
        repeats,
        steps,
        warmup=WARMUP,
        first=WARMUP,
        style=REVERSE,
    )
    out: dict[str, Any] = {"params": params, "steps_total": WARMUP + repeats * steps}
    for n, (_, sync, losses) in configs.items():
        last = torch.tensor(statistics.fmean(losses[-LAST:]), dtype=torch.float64)
        dist.all_reduce(last)
        row = {"step_s": statistics.median(times[n]), "loss": float(last) / dist.get_world_size()}
        if sync is not None:
            row["bytes_per_step"] = bytes_per_step_and_close(sync, WARMUP)
        out[n] = row
    return out


def worker(args: dict[str, Any]) -> dict[str, Any] | None:
    gs.init()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, kind, kwargs, per_rank in args["workloads"]:
        wl = make_workload(kind, seed=SEED, **kwargs)
        out[name] = _measure(wl, per_rank, args["repeats"], args["steps"])
    return out if dist.get_rank() == 0 else None


def _gap(loss: float, base: float) -> float:
    return loss / base - 1.0


def render(
    res: dict[str, Any], args: argparse.Namespace, workloads: list[str], command: str
) -> str:
    parts = [
        "## Gradient compression (issue 4)\n",
        f"Command: `{command}` (repeats {args.repeats}, {args.steps} steps per block, seed "
        f"{SEED}). Machine: {machine()}; {load_note(args.load)}. 2 ranks, gloo on loopback, "
        "1 thread per rank, bucket 25 MB, each workload's own optimizer and learning rate. "
        "Step time: median over interleaved rounds, relative to uncompressed gradsync BSP in "
        f"the same run. Final loss: mean over ranks of the last {LAST} steps' training loss "
        "after the same number of steps from the same seed; gap relative to uncompressed BSP.\n",
    ]
    for name in workloads:
        m = res[name]
        base = m["none"]
        rows = [
            [
                c,
                f"{m[c]['bytes_per_step'] / 1e6:.3f}",
                f"{4 * m['params'] / m[c]['bytes_per_step']:.1f}x",  # fp32 bytes over sent
                f"{m[c]['step_s'] * 1e3:.1f}",
                f"{m[c]['step_s'] / base['step_s']:.3f}",
                f"{m[c]['loss']:.4f}",
                f"{_gap(m[c]['loss'], base['loss']) * 100:+.1f}%",
            ]
            for c in COMPRESSORS
        ]
        head = (
            "compressor | MB/step sent | ratio vs fp32 | ms/step | step time / none | "
            "final loss | loss gap"
        )
        parts.append(
            f"### {name}: {m['params']:,} parameters, {m['steps_total']} steps\n\n"
            f"{table(head, rows)}\n"
        )
        ddp = m["ddp"]
        side = [
            [
                label,
                f"{m[key]['step_s'] * 1e3:.1f}",
                f"{m[key]['step_s'] / ddp['step_s']:.3f}",
                f"{m[key]['loss']:.4f}",
            ]
            for label, key in (
                ("gradsync powersgd:4", "powersgd:4"),
                ("DDP + torch PowerSGD hook, rank 4", "ddp+powersgd:4"),
                ("gradsync none (BSP)", "none"),
                ("DDP, no hook", "ddp"),
            )
        ]
        side_table = table("configuration | ms/step | step time / DDP | final loss", side)
        parts.append(
            f"PowerSGD rank 4 side by side ({name}, same run, both start compressing at step "
            f"{WARMUP}, both with error feedback and warm start):\n\n{side_table}\n"
        )
        parts.append(_findings(name, m) + "\n")
    if "charlm" in res:
        parts.append(_claim(res["charlm"]) + "\n")
    return "\n".join(parts)


def _findings(name: str, m: dict[str, Any]) -> str:
    """Sentences generated from the measured values: which compressors paid off in time."""
    base = m["none"]["step_s"]
    faster = [c for c in COMPRESSORS[1:] if m[c]["step_s"] < 0.97 * base]
    slower = [c for c in COMPRESSORS[1:] if m[c]["step_s"] > 1.03 * base]
    comm = m["none"]["bytes_per_step"] / 1e6
    text = (
        f"On {name}, with {comm:.2f} MB per uncompressed step on loopback, "
        f"{', '.join(faster) or 'no compressor'} stepped more than 3% faster than uncompressed "
        f"BSP; {', '.join(slower) or 'none'} stepped more than 3% slower. Loopback moves bytes "
        "at memory speed, so a compressor pays only where the time it saves on the wire exceeds "
        "its encode and decode time; on a real network the bytes column matters more than the "
        "time column here. "
    )
    g, d = m["powersgd:4"], m["ddp+powersgd:4"]
    text += (
        f"gradsync powersgd:4 took {g['step_s'] / d['step_s']:.2f}x the step time of DDP with "
        f"torch's PowerSGD hook, and reached a final loss of {g['loss']:.4f} against "
        f"{d['loss']:.4f}."
    )
    return text


def _claim(m: dict[str, Any]) -> str:
    """The issue's convergence claim, checked per compressor at this step count."""
    base = m["none"]["loss"]
    held: list[str] = []
    missed: list[str] = []
    for c in COMPRESSORS[1:]:
        gap = _gap(m[c]["loss"], base)
        (held if gap <= GAP_LIMIT else missed).append(f"{c} ({gap * 100:+.1f}%)")
    return (
        f'Claim "charlm with each compressor reaches a final loss within '
        f'{GAP_LIMIT:.0%} of uncompressed BSP at the same number of steps", at '
        f"{m['steps_total']} steps: holds for {', '.join(held) or 'none'}; "
        f"misses for {', '.join(missed) or 'none'}."
    )


def main() -> None:
    h = Harness("benchmarks.compression", __doc__, repeats=4)
    h.parser.add_argument("--steps", type=int, default=20, help="steps per block")
    h.parser.set_defaults(mlp_params=6_000_000)
    args = h.parse(repeats=2, steps=3, mlp_params=200_000)
    mlp_params = args.mlp_params
    workloads = [
        ("charlm", "charlm", {}, 16),
        (f"mlp ({mlp_params / 1e6:g}M params)", "mlp", {"params": mlp_params}, 32),
    ]
    args.load = [os.getloadavg()[0]]
    results = launch(
        worker,
        ({"repeats": args.repeats, "steps": args.steps, "workloads": workloads},),
        nproc=2,
    )
    args.load.append(os.getloadavg()[0])
    h.finish(render(results[0], args, [w[0] for w in workloads], h.command()))


if __name__ == "__main__":
    main()
