"""ZeRO stages on the emulated cluster (issue 15): time per step of gradsync's bsp, zero:1,
zero:2 and zero:3 against torch DDP over 1 Gbit/s links, with the simulator's prediction beside
each measurement.

Needs root and iproute2. One 2-host cluster (prefix ``gsz-``: ``gradsync cluster down --prefix
gsz-`` removes what a ``kill -9`` left, and nothing of anyone else's; every other exit tears
down by itself), one rank per host, and one torchrun launch of ``benchmarks.zero_cluster_worker``
that runs every configuration ``--repeats`` times, order rotated by repeat. The simulator is
given the compute-only step time each rank measured in that launch and the link's alpha and
beta fitted to all-reduces timed in it (also the link's nominal rate), and predicts each stage
with ``gradsync.sim.simulate``; docs/cluster.md says more.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.cluster import say, worker_env, worker_output_to
from benchmarks.harness import (
    Harness,
    fmt_iqr,
    machine,
    median_iqr,
    table,
)
from benchmarks.zero import children_cpu_s, cpu_busy_s
from gradsync.cluster import Cluster, launch_on_cluster, parse_rate, requirements_missing
from gradsync.sim import AlphaBeta, CommModel, Overlap, cost_terms, fit_alpha_beta, simulate
from gradsync.sim.simulate import OVERLAPPED, zero_comm_ms
from gradsync.strategies.zero_shards import OwnerLayout
from gradsync.workloads import make_workload
from gradsync.workloads.mlp import parameter_count

PREFIX = "gsz-"
LINK = "1gbit"
HOSTS = 2
MODULE = "benchmarks.zero_cluster_worker"
MB = 1e6


@dataclass(frozen=True)
class Config:
    key: str  # the worker's run name
    label: str
    mode: str
    strategy: str | None = None  # gradsync's strategy, which the simulator also predicts
    # the exchanges it makes per step on gloo, as the worker times them alone
    exchanges: tuple[str, ...] = ()

    def arg(self) -> str:
        extra = f",strategy={self.strategy}" if self.strategy else ""
        return f"--config={self.key}={self.mode}{extra}"


AR, BCAST, RING_RS = "allreduce", "broadcasts", "ring_reduce_scatter"
AG_T, RS_T = "all_gather_into_tensor", "reduce_scatter_tensor"
DDP = Config("ddp", "torch DDP (baseline)", "ddp", exchanges=(AR,))
COMPUTE = Config("compute", "compute-only (no communication)", "compute-only")
CONFIGS = (
    DDP,
    Config("bsp", "gradsync bsp", "gradsync", "bsp", (AR,)),
    Config("zero1", "gradsync zero:1", "gradsync", "zero:1", (AR, BCAST)),
    Config("zero2", "gradsync zero:2", "gradsync", "zero:2", (RING_RS, BCAST)),
    # FSDP2 gathers the parameters before the forward and again before the backward
    Config("zero3", "gradsync zero:3", "gradsync", "zero:3", (AG_T, AG_T, RS_T)),
    COMPUTE,
)
# The exchanges timed alone: what each carries, as the second table names it.
EXCHANGES = {
    AR: ("all-reduce of the gradient", "DDP, bsp, zero:1", "allreduce"),
    BCAST: (
        "one broadcast per owner of its padded chunk, all in flight at once",
        "zero:1, zero:2 (parameters)",
        "allgather",
    ),
    RING_RS: (
        "ring of send/receive pairs over the padded flat buffer",
        "zero:2 (gradient)",
        "reducescatter",
    ),
    AG_T: (
        "gloo's flat all-gather, gradient-sized",
        "zero:3 (FSDP2), twice",
        "allgather",
    ),
    RS_T: ("gloo's flat reduce-scatter, gradient-sized", "zero:3 (FSDP2)", "reducescatter"),
    "one_way": ("one padded chunk sent one way (reference)", "-", None),
}


# Running --------------------------------------------------------------------------------------


def run_launch(args: Any, workdir: Path) -> dict[str, Any]:
    """Bring the cluster up, run the one launch, tear down (on every exit); the worker's JSON
    and how busy the machine was with other processes meanwhile (in cores)."""
    out = workdir / "zero-cluster.json"
    out.unlink(missing_ok=True)
    grad = 4 * parameter_count(args.params)
    sizes = [2**16, 2**18, 2**20, 2**22, grad]  # up to the whole gradient, for the fit
    chunk = padded_bytes(args.params, HOSTS) // (4 * HOSTS)
    worker_args = [
        MODULE,
        "--params", str(args.params), "--global-batch", str(args.global_batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--repeats", str(args.repeats), "--timeout", str(args.timeout),
        "--probe-sizes", ",".join(map(str, sizes)),
        "--exchange-elems", f"{grad // 4},{chunk}",
        *(c.arg() for c in CONFIGS), "--out", str(out),
    ]  # fmt: skip
    busy0, ours0, t0 = cpu_busy_s(), children_cpu_s(), time.monotonic()
    with Cluster(hosts=HOSTS, link=LINK, prefix=PREFIX) as cluster:
        say(f"  cluster {cluster.base} up; launching {len(CONFIGS)} configurations")
        rc = launch_on_cluster(cluster, worker_args, env=worker_env(), timeout_s=args.budget)
    wall = time.monotonic() - t0
    others = ((cpu_busy_s() - busy0) - (children_cpu_s() - ours0)) / wall
    if rc != 0 or not out.exists():
        raise RuntimeError(f"the launch failed (exit {rc}) after {wall:.0f} s")
    say(f"  launch done in {wall:.0f} s")
    return {**json.loads(out.read_text()), "launch_s": wall, "others_cores": others}


# Summarising ----------------------------------------------------------------------------------


def step_times(res: dict[str, Any], key: str) -> list[float]:
    """Seconds per step, one per repeat: the timed block (barrier to barrier) of the slowest
    rank over its steps."""
    runs = res["results"][key]["repeats"]
    return [max(r["block_s"] for r in run["ranks"]) / res["steps"] for run in runs]


def per_repeat(res: dict[str, Any], key: str) -> dict[int, float]:
    runs = res["results"][key]["repeats"]
    return dict(zip((r["repeat"] for r in runs), step_times(res, key), strict=True))


def compute_profile(res: dict[str, Any]) -> tuple[np.ndarray, float]:
    """Each rank's compute-only step (ms, median over every timed step of every repeat), as the
    simulator's ``(1, workers)`` compute matrix, and the backward pass's share of it."""
    runs = res["results"][COMPUTE.key]["repeats"]
    world = res["world_size"]
    per_rank = [
        statistics.median(s for run in runs for s in run["ranks"][w]["step_s"])
        for w in range(world)
    ]
    bwd = statistics.median(b for run in runs for r in run["ranks"] for b in r["bwd_s"])
    frac = min(1.0, bwd / statistics.median(per_rank))
    return np.array([per_rank]) * 1e3, frac


def fitted_link(res: dict[str, Any]) -> tuple[AlphaBeta, float]:
    fit = fit_alpha_beta(
        [p["bytes"] for p in res["probe"]],
        [p["time_s"] for p in res["probe"]],
        n=res["world_size"],
    )
    return fit.model(), fit.max_rel_error


def mlp_parameters(params: int) -> list[torch.nn.Parameter]:
    return list(make_workload("mlp", seed=0, params=params).build_model().parameters())


def padded_bytes(params: int, world: int) -> int:
    """The bytes zero:1 and zero:2 move as the whole buffer: gradsync's flat buffer is
    ``world`` chunks each the size of the most loaded rank's whole tensors (padding included)."""
    layout = OwnerLayout(mlp_parameters(params), world, 0)
    return sum(4 * world * g.chunk for g in layout.groups)


@dataclass(frozen=True)
class SimInputs:
    """What the simulator is given, all measured in the same launch."""

    compute_ms: np.ndarray  # (1, workers): each rank's compute-only step
    backward_frac: float
    buckets: int  # gradsync's buckets at its default size (bsp's and zero:1's exchange)
    grad_bytes: float
    padded_bytes: float


def predict(spec: str, s: SimInputs, link: AlphaBeta) -> float:
    """The simulator's step time (ms) for ``spec``: bucketed overlap for bsp and zero:1, whose
    gradient exchange is bsp's, as gradsync runs them; the others as the simulator prices them."""
    ov = Overlap(backward_frac=s.backward_frac, buckets=s.buckets) if spec in OVERLAPPED else None
    sim = simulate(spec, s.compute_ms, CommModel(link=link, nbytes=s.grad_bytes), overlap=ov)
    assert sim.step_ms is not None
    return float(sim.step_ms[0])


def sim_sent(spec: str, world: int, grad: float) -> float:
    """Bytes the simulator has each rank send per step (ring collectives)."""
    if spec == "bsp":
        return cost_terms("allreduce", "ring", world)[1] * grad
    stage = int(spec.split(":")[1])
    op = zero_comm_ms(stage, CommModel(comm_ms=1.0), world)[0]
    gathers = 2 if stage == 3 else 1
    terms = cost_terms(op, "ring", world)[1] + gathers * cost_terms("allgather", "ring", world)[1]
    return terms * grad


def sim_inputs(res: dict[str, Any], params: int) -> SimInputs:
    compute, frac = compute_profile(res)
    bsp = res["results"]["bsp"]["repeats"]
    grad = 4 * parameter_count(params)
    # bsp's buckets (zero:1 forms the same); 1 if bsp itself failed
    buckets = len(bsp[0]["ranks"][0]["bucket_bytes"]) if bsp else 1
    padded = padded_bytes(params, res["world_size"])
    return SimInputs(compute, frac, buckets, grad, padded)


def row_for(
    c: Config, res: dict[str, Any], s: SimInputs, links: dict[str, AlphaBeta]
) -> dict[str, Any]:
    """One configuration's figures: measured step times and ratios, bytes sent, last loss,
    and the simulator's step time on each link (None where it has no counterpart)."""
    entry = res["results"][c.key]
    row: dict[str, Any] = {"config": c, "error": entry["error"], "times": step_times(res, c.key)}
    if not row["times"]:
        return row
    mine, base = per_repeat(res, c.key), per_repeat(res, DDP.key)
    both = sorted(set(mine) & set(base))
    # ratios within a repeat, where both ran seconds apart: a drift of the machine cancels
    row["ratios"] = [mine[r] / base[r] for r in both]
    steps, world = res["steps"], res["world_size"]
    row["sent"] = [
        statistics.median(run["ranks"][w]["sent_bytes"] or 0 for run in entry["repeats"]) / steps
        for w in range(world)
    ]
    # the global batch's loss (mean over the ranks' slices) at the last timed step
    row["loss"] = [
        statistics.fmean(r["loss"][-1] for r in run["ranks"]) for run in entry["repeats"]
    ]
    spec = c.strategy or ("bsp" if c is DDP else None)
    row["spec"] = spec
    if spec is not None:
        row["sim_sent"] = sim_sent(spec, world, s.grad_bytes)
        row["sim"] = {name: predict(spec, s, link) for name, link in links.items()}
    if c.exchanges and res.get("exchanges"):
        # bottom-up: the slowest rank's compute, then each exchange as long as it took alone
        ex = res["exchanges"]
        alone = sum(ex[e]["time_s"] for e in c.exchanges) * 1e3
        row["alone"] = float(s.compute_ms.max()) + alone
    return row


def summarize(res: dict[str, Any], params: int, rate_bps: int) -> dict[str, Any]:
    s = sim_inputs(res, params)
    fitted, fit_err = fitted_link(res)
    links = {"fitted": fitted, "nominal": AlphaBeta(alpha=0.0, beta=8.0 / rate_bps)}
    rows = [row_for(c, res, s, links) for c in CONFIGS]
    ddp_loss = next(r for r in rows if r["config"] is DDP).get("loss") or [float("nan")]
    return {"sim": s, "fitted": fitted, "fit_err": fit_err, "rows": rows, "ddp_loss": ddp_loss}


# Rendering ------------------------------------------------------------------------------------


def _err(pred: float, measured_s: float) -> str:
    return f"{pred:.1f} ({pred / (measured_s * 1e3) - 1:+.0%})"


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in summary["rows"]:
        c: Config = r["config"]
        if not r["times"]:
            out.append([c.label, f"failed: {r['error']}"] + ["-"] * 5)
            continue
        med = median_iqr(r["times"])[0]
        sent = " / ".join(f"{b / MB:.1f}" for b in r["sent"])
        cells = ["-"] * 3
        if "sim" in r:
            sent += f" ({r['sim_sent'] / MB:.1f})"
            as_bsp = " as bsp" if c is DDP else ""
            cells[:2] = [_err(r["sim"][k], med) + as_bsp for k in ("fitted", "nominal")]
        if "alone" in r:
            cells[2] = _err(r["alone"], med)
        label = c.label + (f" (stopped: {r['error']})" if r["error"] else "")
        times = fmt_iqr([t * 1e3 for t in r["times"]], ".1f")
        out.append([label, times, fmt_iqr(r["ratios"], ".2f", "x"), sent, *cells])
    return out


def exchange_rows(res: dict[str, Any], s: SimInputs, link: AlphaBeta) -> list[list[str]]:
    """The exchanges timed alone, beside what the simulator charges for them in its stage
    formulas (ring collectives on the gradient's bytes, fitted link)."""
    world, rows = res["world_size"], []
    for key, (what, used_by, op) in EXCHANGES.items():
        got = res["exchanges"].get(key)
        if got is None:
            continue
        sent = got["sent_bytes"]
        charge = 1e3 * link.time(op, world, s.grad_bytes) if op else None
        rows.append(
            [
                what,
                used_by,
                "-" if sent is None else f"{sent / MB:.1f}",
                "-" if sent is None else f"{sent * 8 / got['time_s'] / 1e9:.2f}",
                f"{got['time_s'] * 1e3:.0f} ({min(got['times_s']) * 1e3:.0f}-"
                f"{max(got['times_s']) * 1e3:.0f})",
                "-" if charge is None else f"{charge:.1f}",
            ]
        )
    return rows


def render(summary: dict[str, Any], res: dict[str, Any], args: Any, head: dict[str, Any]) -> str:
    s: SimInputs = summary["sim"]
    link: AlphaBeta = summary["fitted"]
    world = res["world_size"]
    compute = " / ".join(f"{c:.1f}" for c in s.compute_ms[0])
    shared = (
        f"Other processes used {res['others_cores']:.2f} cores on average during the launch"
        + (": the machine was shared." if res["others_cores"] > 0.1 else ".")
    )
    cols = (
        "configuration | ms/step, median (IQR) | vs DDP (IQR) | MB sent/step, rank 0 / 1 "
        "(simulator's) | simulator ms/step, fitted link (error) | simulator, nominal 1 Gbit/s "
        "(error) | compute + its exchanges timed alone (error)"
    )
    ex_cols = (
        "exchange, timed alone | used by | MB sent by rank 0's host | Gbit/s sent | ms, median "
        "(min-max) | "
        "simulator's charge, ms"
    )
    ex_rows = exchange_rows(res, s, link) if res.get("exchanges") else []
    ex_table = (
        "Each stage's exchanges timed alone in the same launch (7 calls, each between barriers), "
        "beside what the simulator's formula charges for that step of the stage (ring "
        "collectives on the gradient's bytes, fitted link):\n\n" + table(ex_cols, ex_rows)
        if ex_rows
        else ""
    )
    return (
        "## ZeRO stages on the emulated cluster: step time against DDP and the simulator "
        "(issue 15)\n\n"
        f"Command (as root): `{head['command']}`"
        f"{' (a smoke run: small sizes, 1 repeat, not a measurement)' if args.quick else ''}. "
        f"Machine: {machine()}. Whole run: {head['minutes']:.1f} min. {shared}\n\n"
        f"{world} hosts (network namespaces) joined by veth links limited to {LINK} each way by "
        "tc tbf (docs/cluster.md); 1 rank per host, gloo, 1 thread per rank. Model: the `mlp` "
        f"workload, {parameter_count(args.params):,} parameters ({s.grad_bytes / MB:.1f} MB of "
        f"float32 gradient), SGD momentum 0.9, global batch {args.global_batch}. One launch "
        f"runs every configuration {res['repeats']} times, order rotated by repeat; each run is "
        f"a fresh replica from the same seed: {res['warmup']} untimed steps, then "
        f"{res['steps']} timed between barriers. ms/step: the slowest rank's timed block over "
        "its steps, median over repeats (interquartile range); vs DDP: per repeat, then the "
        "median (IQR). MB sent: bytes each host's interface sent per step (Ethernet frames: "
        "TCP/IP headers and ACKs included), median over repeats; in parentheses what the "
        "simulator's ring collectives send.\n\n"
        f"Simulator inputs, measured in the same launch: compute-only step {compute} ms "
        f"(rank 0 / 1; backward {s.backward_frac:.0%} of it); gradsync's buckets at 25 MB: "
        f"{s.buckets} (bsp's and zero:1's overlap); link fitted to {world}-rank all-reduces "
        f"of 64 KB to the whole gradient: alpha {link.alpha * 1e6:.0f} us, beta "
        f"{link.beta * 1e9:.2f} ns/B ({8 / link.beta / 1e9 if link.beta else float('inf'):.2f} "
        f"Gbit/s), worst fit error {summary['fit_err']:.0%}; nominal: alpha 0, 1 Gbit/s. "
        "The simulator predicts DDP as bsp (the same all-reduce). Error: prediction / "
        "measurement - 1. The last column is not the simulator: the slowest rank's compute "
        "plus each of the stage's exchanges as long as it took alone (table below), nothing "
        "overlapped.\n\n"
        f"{table(cols, table_rows(summary))}\n\n{ex_table}\n\n{reading(summary, res)}\n"
    )


def _med_ms(r: dict[str, Any]) -> float:
    return median_iqr(r["times"])[0] * 1e3


def _ratio_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    ok = {k: r for k, r in rows.items() if r["times"]}
    stages = [
        f"{r['config'].label} {median_iqr(r['ratios'])[0]:.2f}x"
        for r in ok.values()
        if r["config"] is not DDP
    ]
    lines = [f"- Step time against DDP (median of per-repeat ratios): {', '.join(stages)}."]
    sims = [
        f"{r['config'].label} {r['sim']['fitted'] / _med_ms(r) - 1:+.0%}"
        for r in ok.values()
        if "sim" in r
    ]
    gap = max(
        (abs(r["sim"]["fitted"] - r["sim"]["nominal"]) / _med_ms(r) for r in ok.values()
         if "sim" in r),
        default=0.0,
    )  # fmt: skip
    zero = [abs(r["sim"]["fitted"] / _med_ms(r) - 1) for k, r in ok.items() if "zero" in k]
    why = (
        ": the zero stages' errors are not a matter of alpha and beta"
        if zero and min(zero) > 2 * gap
        else ""
    )
    lines.append(
        f"- The simulator on the fitted link is off by {', '.join(sims)} (DDP predicted as "
        f"bsp). On the nominal link its predictions move by at most {gap:.0%} of a step{why}."
    )
    return lines


def _bytes_line(rows: dict[str, dict[str, Any]], s: SimInputs, res: dict[str, Any]) -> str:
    z1, z2, z3 = rows["zero1"], rows["zero2"], rows["zero3"]
    if not (z1["times"] and z2["times"] and z3["times"]):
        return ""
    numels = [p.numel() for p in mlp_parameters(res["params"])]
    big = max(numels) / sum(numels)
    ex = res["exchanges"]
    return (
        f"- Bytes: zero:1 and zero:2 sent {max(z1['sent']) / MB:.1f} and "
        f"{max(z2['sent']) / MB:.1f} MB per step per rank where the simulator's ring "
        f"collectives send {z1['sim_sent'] / MB:.1f} and {z2['sim_sent'] / MB:.1f}. gradsync "
        "deals whole tensors to their owners, and this mlp's hidden h x h weight holds "
        f"{big:.0%} of its parameters, so one rank owns it and the other everything else; "
        "each rank's chunk of the flat buffer is padded to the larger, and the parameters "
        f"go back as {s.padded_bytes / MB:.1f} MB ({s.padded_bytes / s.grad_bytes:.1f}x the "
        f"gradient, {(s.padded_bytes - s.grad_bytes) / MB:.1f} MB of it padding); zero:2's "
        "reduce-scatter moves as much. zero:3 sent "
        f"{max(z3['sent']) / MB:.1f} MB against {z3['sim_sent'] / MB:.1f}: gloo's flat "
        f"reduce-scatter (FSDP2's) sent {ex[RS_T]['sent_bytes'] / MB:.1f} MB for a "
        f"{s.grad_bytes / MB:.1f} MB gradient, as much as the all-reduce "
        f"({ex[AR]['sent_bytes'] / MB:.1f} MB), where a reduce-scatter needs half."
    )


def _directions(ratio: float) -> str:
    if ratio >= 1.6:
        return " (one direction after the other)"
    return " (both directions at once)" if ratio <= 1.3 else ""


def _duplex_line(res: dict[str, Any], s: SimInputs, link: AlphaBeta) -> str:
    ex = res["exchanges"]
    one, bc, ring, ar = (ex[k]["time_s"] * 1e3 for k in ("one_way", BCAST, RING_RS, AR))
    lo, hi = (f(ex[BCAST]["times_s"]) * 1e3 for f in (min, max))
    charge = 1e3 * link.time("allgather", res["world_size"], s.grad_bytes)
    varied = (
        f", from {lo:.0f} to {hi:.0f} ms call by call (whether gloo overlapped the two varied)"
        if hi > 1.5 * lo
        else ""
    )
    return (
        f"- Rate: one padded chunk sent one way took {one:.0f} ms. The ring's send/receive "
        f"pairs (one chunk each way) took {ring:.0f} ms, {ring / one:.1f}x that"
        f"{_directions(ring / one)}; the broadcasts that bring the parameters back (one chunk "
        f"each way, both in flight) took {bc:.0f} ms, {bc / one:.1f}x"
        f"{_directions(bc / one)}{varied}. gloo's all-reduce sent "
        f"{ex[AR]['sent_bytes'] / MB:.1f} MB each way in {ar:.0f} ms, both directions at "
        f"once. With the padding, zero:1's and zero:2's parameter exchange took {bc:.0f} ms "
        f"where the simulator charges {charge:.0f} ms ({bc / charge:.1f}x)."
    )


def _bottom_up_line(rows: dict[str, dict[str, Any]], res: dict[str, Any]) -> str:
    errs = {r["config"].label: r["alone"] / _med_ms(r) - 1 for r in rows.values() if "alone" in r}
    if not errs:
        return ""
    worst = max(errs.values(), key=abs)
    listed = ", ".join(f"{k} {v:+.0%}" for k, v in errs.items())
    if abs(worst) <= 0.15:
        verdict = (
            "what the simulator misses is which bytes the stages send and how gloo sends "
            "them, not costs elsewhere in the step"
        )
    else:
        verdict = "the exchanges alone do not account for the whole step everywhere"
    return (
        "- Compute plus each stage's exchanges timed alone (last column) against the "
        f"measured step: {listed}; {verdict}."
    )


def reading(summary: dict[str, Any], res: dict[str, Any]) -> str:
    """What the figures say, written from them."""
    rows = {r["config"].key: r for r in summary["rows"]}
    lines = _ratio_lines(rows)
    if res.get("exchanges"):
        lines += [
            _bytes_line(rows, summary["sim"], res),
            _duplex_line(res, summary["sim"], summary["fitted"]),
            _bottom_up_line(rows, res),
        ]
    ddp_loss = summary["ddp_loss"]
    worst = max(
        (abs(a - b) for r in summary["rows"] if r["config"] is not COMPUTE
         for a, b in zip(r.get("loss", []), ddp_loss, strict=False)),
        default=0.0,
    )  # fmt: skip
    lines.append(
        f"- Same computation: every configuration's loss at the last timed step is DDP's "
        f"({statistics.fmean(ddp_loss):.5f}) within {worst:.1e}."
    )
    failed = [r["config"].label for r in summary["rows"] if r["error"]]
    if failed:
        lines.append(f"- Failed on the cluster: {', '.join(failed)} (errors in the table).")
    return "\n".join(line for line in lines if line)


# Main -----------------------------------------------------------------------------------------


def main() -> int:
    # 6 repeats: every configuration runs once in each position of the rotation
    h = Harness("benchmarks.zero_cluster", __doc__, repeats=4, python=".venv/bin/python")
    p = h.parser
    p.add_argument("--params", type=int, default=3_000_000, help="mlp parameters (%(default)s)")
    p.add_argument("--global-batch", type=int, default=64, help="default %(default)s")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (%(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run (%(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout, s")
    p.add_argument("--budget", type=float, default=330.0, help="the launch's limit, s")
    p.add_argument("--workdir", default=None, help="keep the worker's JSON and log here")
    args = h.parse(params=1_000_000, steps=5, warmup=2, repeats=1)
    if min(args.steps, args.global_batch) < 1 or args.warmup < 0:
        h.error("need --steps >= 1, --global-batch >= 1 and --warmup >= 0")
    missing = requirements_missing()
    if missing:
        print(f"benchmarks.zero_cluster: {missing}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gradsync-zero-cluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "workers.log"
    say(f"benchmarks.zero_cluster: worker output in {log}")
    started = time.monotonic()
    try:
        with worker_output_to(log):
            res = run_launch(args, workdir)
    except RuntimeError as exc:
        print(f"benchmarks.zero_cluster: {exc}; the workers' output: {log}", file=sys.stderr)
        return 1
    summary = summarize(res, args.params, parse_rate(LINK))
    head = {"command": h.command(), "minutes": (time.monotonic() - started) / 60}
    h.finish(render(summary, res, args, head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
