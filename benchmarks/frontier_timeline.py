"""Issue 46, "find where the 40% goes first": the per-step timeline of the frontier's mlp
candidates, on loopback and on the emulated cluster, phase by phase.

The frontier (``benchmarks.frontier``) finds the mlp's best configuration, streaming DiLoCo
with int4 (``diloco:4:2:1:outer_lr=1:outer_momentum=0`` + int4), at about 55-58% of what no
communication allows. This benchmark runs that configuration, its neighbours and a compute-only
reference through ``gradsync run`` (the way users run them: 2 workers, the frontier's mlp of 3M
parameters, 32 samples a worker a step, ``--steps`` steps), each with its timeline recorded
(``spans.jsonl``), and splits a step's wall time into what the training thread did:

- **compute**: the forward and backward passes (``with sync.step()``'s block);
- **inner step**: the rest of the step's ``sync`` time outside the exchange's own spans: the
  user's optimizer step and gradsync's bookkeeping;
- **launch**: a fragment's pseudo-gradient and its encode, on the training thread
  (``outer_launch``); under plain DiLoCo the whole blocking exchange (``outer_exchange``);
- **wait**: the wait at the step an exchange is applied (``outer_wait``);
- **outer step**: the outer optimizer's step and the mix into the local fragment
  (``outer_step``);

and, beside them, how long each exchange was **in flight** (``outer_in_flight``: launch to
result, the wire, the peers and the decode on the communication thread), which the inner
steps overlap. Phases are means per step over the steps after the first ``WARMUP`` (an
exchange every few steps counts a fraction in each), the mean over both workers, and the
median over ``--repeats`` launches, interleaved (every configuration once per repeat, order
rotated). The compute-only reference is ``local:100000``: no exchange before the run's end
(``report()``'s one average, after the timed steps). "compute inflation" is a configuration's
compute time per step over the reference's: the CPU its communication threads (gloo, the
decode in a callback) took from the passes on a machine whose cores the workers fill.

Loopback runs need nothing; ``--hosts 2`` adds the emulated cluster (root and iproute2, as the
other cluster benchmarks), one worker per host behind a ``--link`` limit.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.harness import ROTATE, Harness, machine, order, table
from gradsync.telemetry.records import read_jsonl

WARMUP = 8
COMPUTE_ONLY = ("compute-only (`local:100000`)", "local:100000", "")
OUTER = "outer_lr=1:outer_momentum=0"
CONFIGS = (
    COMPUTE_ONLY,
    (f"`diloco:4:2:1:{OUTER}` + int4 (the frontier's best)", f"diloco:4:2:1:{OUTER}", "int4"),
    (f"`diloco:4:2:1:{OUTER}`, uncompressed", f"diloco:4:2:1:{OUTER}", ""),
    (f"`diloco:4:{OUTER}` + int4 (plain)", f"diloco:4:{OUTER}", "int4"),
    # the frontier's best since 2026-11-30 (benchmarks/frontier.py, MLP_FAST and MLP_FAST_8)
    (f"`diloco:12:2:5:{OUTER}` + fp16", f"diloco:12:2:5:{OUTER}", "fp16"),
    (f"`diloco:8:2:3:{OUTER}` + fp16", f"diloco:8:2:3:{OUTER}", "fp16"),
)
#: training-thread phases from the strategy's spans, by span name (before ``[fragment]``)
PHASES = {
    "outer_launch": "launch",
    "outer_exchange": "launch",
    "average": "launch",
    "outer_wait": "wait",
    "outer_step": "outer step",
}
COLUMNS = ("compute", "inner step", "launch", "wait", "outer step")


def run_once(
    strategy: str, compress: str, steps: int, hosts: int, link: str, out: Path
) -> dict[str, float]:
    """One ``gradsync run``; its phases in ms per step (the mean over both workers)."""
    cmd = [sys.executable, "-m", "gradsync", "run", "--nproc", "2", "--workload", "mlp"]
    cmd += ["--params", "3000000", "--batch-size", "32", "--steps", str(steps)]
    cmd += ["--strategy", strategy, "--out", str(out), "--no-progress"]
    if compress:
        cmd += ["--compress", compress]
    if hosts:
        cmd += ["--hosts", str(hosts), "--link", link]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return phases(out / "spans.jsonl", steps)


def phases(spans: Path, steps: int) -> dict[str, float]:
    """Each phase's mean ms per step over the steps from ``WARMUP`` on, averaged over ranks."""
    per_rank: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in read_jsonl(spans):
        if not WARMUP <= s["step"] < steps:
            continue
        name = s["name"].split("[")[0]
        phase = {"compute": "compute", "sync": "sync", "outer_in_flight": "in flight"}.get(
            name, PHASES.get(name)
        )
        if phase is not None:
            per_rank[s["rank"]][phase] += s["dur"] * 1000 / (steps - WARMUP)
    out: dict[str, float] = defaultdict(float)
    for ranks in per_rank.values():
        spent = sum(ranks[p] for p in ("launch", "wait", "outer step"))
        ranks["inner step"] = ranks["sync"] - spent
        ranks["step"] = ranks["compute"] + ranks["sync"]
        for k, v in ranks.items():
            out[k] += v / len(per_rank)
    return dict(out)


def chosen(configs: str) -> list[int]:
    """The indices in ``CONFIGS`` that ``--configs`` names (compute-only always first: every
    share is taken against it)."""
    if not configs:
        return list(range(len(CONFIGS)))
    picked = [int(i) for i in configs.split(",")]
    bad = [i for i in picked if not 0 <= i < len(CONFIGS)]
    if bad:
        raise ValueError(f"--configs: {bad} out of range; valid: 0 to {len(CONFIGS) - 1}")
    return [0, *sorted(set(picked) - {0})]


def one_setting(h: Harness, hosts: int) -> str:
    args = h.args
    runs: dict[int, list[dict[str, float]]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="gs-timeline-") as tmp:
        for r in range(args.repeats):
            for i in order(chosen(args.configs), r, ROTATE):
                label, strategy, compress = CONFIGS[i]
                t0 = time.monotonic()
                out = Path(tmp) / f"{hosts}-{r}-{i}"
                runs[i].append(run_once(strategy, compress, args.steps, hosts, args.link, out))
                print(f"  {label}, repeat {r + 1}: {time.monotonic() - t0:.0f} s", flush=True)
    med = {i: {k: statistics.median(x[k] for x in v) for k in v[0]} for i, v in runs.items()}
    base = med[0]
    rows = []
    for i, (label, _, _) in enumerate(CONFIGS):
        if i not in med:
            continue
        m = med[i]
        cells = [f"{m['step']:.1f}", f"{base['step'] / m['step']:.2f}"]
        cells += [f"{m.get(c, 0.0):.1f}" for c in COLUMNS]
        cells += [f"{m['compute'] / base['compute']:.2f}", f"{m.get('in flight', 0.0):.1f}"]
        rows.append([label, *cells])
    where = f"{hosts} emulated hosts, {args.link} links" if hosts else "loopback (no link limit)"
    head = "configuration | ms/step | share of compute-only | "
    head += " | ".join(COLUMNS) + " | compute inflation | in flight"
    return f"**{where}** (ms per step; phases as the module docstring says)\n\n" + table(head, rows)


def main() -> None:
    h = Harness("benchmarks.frontier_timeline", __doc__, repeats=3)
    h.parser.add_argument("--steps", type=int, default=64, help="steps a run (%(default)s)")
    h.parser.add_argument("--hosts", type=int, default=0, help="emulated hosts; 0: loopback only")
    h.parser.add_argument("--link", default="1gbit", help="each host's link (%(default)s)")
    h.parser.add_argument(
        "--configs", default="", help="indices into CONFIGS, comma-separated (default: all)"
    )
    args = h.parse(quick={"steps": 16, "repeats": 1})
    if args.steps <= WARMUP:
        h.error(f"--steps must be more than the {WARMUP} warm-up steps, got {args.steps}")
    t0 = time.monotonic()
    parts = [one_setting(h, 0)]
    if args.hosts:
        parts.append(one_setting(h, args.hosts))
    minutes = (time.monotonic() - t0) / 60
    load = os.getloadavg()[0]
    parts.append(
        f"{machine()}. Whole run: {minutes:.1f} min; 1-minute load average {load:.1f} at the "
        f"end. Command: `{h.command()}`"
    )
    h.finish("\n\n".join(parts))


if __name__ == "__main__":
    main()
