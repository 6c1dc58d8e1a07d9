"""Issue 16, "the low-bandwidth frontier", measured on the emulated cluster: how much sooner
than torch DDP the periodic strategies with sparse or low-bit exchanges reach DDP's final loss,
their loss at equal steps, the bytes they send, and streaming DiLoCo's peak bytes per sync.

Needs root and iproute2 (exit 2 without, as the other cluster benchmarks). Built on
``benchmarks/cluster.py`` (its part 1: hosts, launches, targets, compute-only limit): each
setting (workload, hosts, link) is one emulated cluster; each repeat is one launch running DDP,
compute-only and every candidate in turn (order rotated by repeat), so every ratio is taken
within a launch and then the median over repeats is shown. The workers are
``benchmarks.cluster_worker``'s, run through this module (``--worker``) only to add each gradsync
run's bytes per step from its report.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.cluster import (
    FINAL_SLACK,
    MA,
    Config,
    ma_at,
    samples_per_s,
    say,
    time_to_target,
    worker_env,
    worker_output_to,
)
from benchmarks.harness import ROTATE, Harness, machine, median, order, table
from gradsync.cluster import Cluster, launch_on_cluster, requirements_missing
from gradsync.spec import parse_strategy_spec

PREFIX = "gsf-"
APPROX_FACTOR = 2  # candidates run this many times DDP's steps (a multiple of every period)

DDP = Config("ddp", "torch DDP (baseline)", "ddp")
ONLY = Config("compute-only", "compute-only (limit, no communication)", "compute-only")
LOCAL4 = Config("local4", "`local:4` (previous best)", "gradsync", "strategy=local:4", False)
#: gossip averaging (issue 46): a pair exchange every 4 steps, no collective spanning the group
GOSSIP4 = Config("gossip4", "`gossip:4`", "gradsync", "strategy=gossip:4", False)
#: gossip with NoLoCo's outer momentum step (issue 46), DiLoCo's outer settings
NOLOCO4 = Config("noloco4", "`noloco:4`", "gradsync", "strategy=noloco:4", False)
#: gossip every step with its pair exchange in int8 (issue 46): in a loopback probe of the 1M
#: mlp on 8 ranks (2026-12-01; the losses do not depend on the links) it reached DDP's final loss
#: at DDP's own step 63, as uncompressed `gossip:1` did, where `gossip:2` + int8 was +5.5% at
#: DDP's last step, `gossip:4` +23.2%, `gossip:1` + int4 +14.5%, and NoLoCo at outer lr 1 and
#: momentum 0.2-0.5 +19% to +505%
GOSSIP1_INT8 = Config(
    "gossip1-int8", "`gossip:1` + int8", "gradsync", "strategy=gossip:1,compress=int8", False
)


def _c(key: str, strategy: str, compress: str = "") -> Config:
    label = f"`{strategy}`" + (f" + {compress}" if compress else "")
    fields = f"strategy={strategy}" + (f",compress={compress}" if compress else "")
    return Config(key, label, "gradsync", fields, False)


def _streaming(c: Config) -> bool:
    """Whether ``c`` runs streaming DiLoCo (F > 1 fragments, or a delay or ALPHA)."""
    if c.mode != "gradsync":
        return False
    from benchmarks.cluster_worker import RunSpec, parse_run  # the worker's own --config reader

    run = parse_run(f"{c.key}={c.mode},{c.fields}", RunSpec(name=c.key, mode=c.mode))
    return parse_strategy_spec(run.strategy).fragments is not None


L8S = _c("local8-sl", "local:8", "sparseloco")
# Plain and streaming DiLoCo with the same compression: the peak-bytes pair. On mlp the outer
# step is plain averaging (outer lr 1, no momentum): in a loopback probe (the losses do not
# depend on the links) `diloco:4:2:1` + int4 with it was -0.3% vs DDP at step 64 on 4 ranks and
# -1.7% on 2, where the outer Nesterov momentum at lr 0.7 left every int4 DiLoCo +75% or worse
# and the best sparseloco candidate (`diloco:8:3:1`, rows) +5.9% on 4 ranks.
MLP_OUTER = "outer_lr=1:outer_momentum=0"
MLP_PLAIN = _c("diloco4-avg-int4", f"diloco:4:{MLP_OUTER}", "int4")
MLP_STREAM = _c("sdiloco4-2-avg-int4", f"diloco:4:2:1:{MLP_OUTER}", "int4")
# Eager outer updates (issue 46; gradsync.strategies.eager): each fragment's exchange applied a
# period after it starts, this rank's own share at once, where TAU=1 gives it one step
MLP_EAGER = _c("ediloco4-2-avg-int4", f"diloco:4:2:eager:{MLP_OUTER}", "int4")
# The mlp's fastest (issue 46): half precision on the wire rather than int4, an exchange every
# 6 steps (H=12, F=2) and each in flight for 5 of them (TAU=5). int4 is an all-gather whose
# encode and N-part decode cost more CPU than the mlp's step: in a loopback timeline
# (`benchmarks.frontier_timeline`'s phases, 2 workers) the launch took 18.2 ms a step under
# `diloco:4:2:1` + int4 against 3.1 ms under `diloco:8:2:3` + fp16. H, F and TAU from a
# loopback sweep of the steps to DDP's final loss (2 ranks, fp16, outer lr 1, no momentum; the
# losses do not depend on the links), DDP at step 63: 12:2:5 48, 8:2:3 49, 16:2:7 50, 6:2:2 52,
# 12:3:3 63, 8:4:1 69, 8:2:3 with ALPHA 0.5 101, 32:2:15 and 32:4:7 not in 128 steps; then on
# 2 emulated hosts (3 repeats, a loaded machine) 12:2:5 reached it at 55% of the compute-only
# limit, 8:2:3 at 41%, 4:1:3 (45 steps, the whole model each time) at 39%.
MLP_FAST = _c("sdiloco12-2-5-avg-fp16", f"diloco:12:2:5:{MLP_OUTER}", "fp16")
MLP_FAST_8 = _c("sdiloco8-2-3-avg-fp16", f"diloco:8:2:3:{MLP_OUTER}", "fp16")
# On 4 ranks longer periods leave the replicas too far apart: in the same sweep on 4 ranks
# (DDP at 63) 4:1:3 reached DDP's loss at step 47, 6:2:2 at 56, 4:2:1 at 62, 8:2:3 at 99, and
# 12:2:5, 8:4:1 and 4:2:1 with ALPHA 0.5 not in 128 steps; on 4 emulated hosts (1 repeat, a
# loaded machine) 6:2:2 reached it at 30% of the limit, 4:1:3 at 29%, `diloco:4:2:1` + int4 18%.
MLP4_FAST = _c("sdiloco6-2-2-avg-fp16", f"diloco:6:2:2:{MLP_OUTER}", "fp16")
MLP4_WHOLE = _c("sdiloco4-1-3-avg-fp16", f"diloco:4:1:3:{MLP_OUTER}", "fp16")
LM_PLAIN = _c("diloco8-int4", "diloco:8", "int4")
# ALPHA 0.5 (the local fragment half kept at each merge, as the paper suggests once TAU > 0):
# in a loopback probe (the losses do not depend on the links) charlm's loss at step 128 was
# +1.7% vs DDP, against +6.6% with ALPHA 0 (+6.8% with the layers split).
LM_STREAM = _c("sdiloco8-4-a05-int4", "diloco:8:4:1:0.5", "int4")
# charlm's fastest: plain DiLoCo every 16 steps, its outer momentum 0.5 rather than 0.9. In a
# loopback probe of the outer optimizer on 2 ranks (the losses do not depend on the links),
# momentum 0.9 left `diloco:8` + int4 +9.7% above DDP's loss at step 128 and `diloco:16` +4.0%
# (neither reached DDP's final loss in 256 steps: too few outer steps for that momentum to
# pay); at 0.5 both were within 1.7% and reached it at step 130, DDP at 127.
LM_FAST = _c("diloco16-m05-int4", "diloco:16:outer_momentum=0.5", "int4")
# The same, streamed: 4 fragments, each exchange overlapped with 3 steps, and the merge keeping
# those steps (``keep``, docs/streaming.md). In a loopback probe (2 ranks) it reached DDP's final
# loss at step 130, as LM_FAST does, where `diloco:16:2:2` with ALPHA 0 needed 160 and with keep
# 130; on 2 emulated hosts (3 repeats, 2026-12-01) `16:2:2` went from 70% of the compute-only
# limit with ALPHA 0 to 89% with keep, LM_FAST 90% in the same launches.
LM_KEEP = _c("sdiloco16-4-3-keep-int4", "diloco:16:4:3:keep:outer_momentum=0.5", "int4")
# The held-out transformer's own (issue 46; benchmarks/frontier_model.py): in a loopback probe
# (2 ranks, the losses do not depend on the links; DDP reached its final loss at step 123),
# plain DiLoCo averaging every 2 steps + int4 was +4.2% above DDP's loss at step 128 and reached
# DDP's final loss at step 137; every step (`diloco:1`) +3.5%, also step 137; `local:2`,
# uncompressed, +3.8%; every 4 steps +12.3% (step 158), the streaming `diloco:4:2:1` +12.5%
# (162); outer momentum 0.5 +12.2% to +19.6% (H 4 to 16; charlm's best +19.6%, step 165, its
# streaming candidate +23.2%, 180); outer lr 1.3 +10.9% (H 4); the default outer Nesterov +51%
# (H 8) and +82% (H 2), never reaching it in 256 steps.
HO_FAST = _c("diloco2-avg-int4", f"diloco:2:{MLP_OUTER}", "int4")
# (plain, streaming, F) per workload
PAIRS = {
    "mlp": (MLP_PLAIN, MLP_STREAM, 2),
    "charlm": (LM_PLAIN, LM_STREAM, 4),
    "heldout": (MLP_PLAIN, MLP_STREAM, 2),
}


@dataclass(frozen=True)
class Setting:
    key: str
    workload: str
    hosts: int
    link: str
    configs: tuple[Config, ...]
    params: int = 3_000_000  # mlp only
    batch: int = 64
    steps: int = 64
    goal: float | None = None  # x sooner to DDP's final loss; None: report only
    goal_of_limit: float | None = None  # or: this fraction of the compute-only limit
    #: issue 46's goal: the best configuration's x sooner, this fraction of the limit or more
    share_goal: float | None = None
    per_host: int = 1  # ranks on each host (they share its link)

    def args(self) -> list[str]:
        wl = ["--workload", self.workload, "--global-batch", str(self.batch)]
        return wl + (["--params", str(self.params)] if self.workload == "mlp" else [])

    def what(self) -> str:
        wl = (
            f"mlp, {self.params / 1e6:g}M parameters"
            if self.workload == "mlp"
            else "charlm (default size)"
        )
        if self.workload == "heldout":
            wl = HELDOUT_WHAT
        ranks = f" x {self.per_host} ranks" if self.per_host > 1 else ""
        return f"{wl}, global batch {self.batch}, {self.hosts} hosts{ranks}, {self.link} links"


#: ``--workload heldout``: issue 46's held-out transformer, written for the frontier
HELDOUT_WHAT = "held-out transformer (benchmarks/frontier_model.py, 1.26M parameters)"


# Picked by a 1-repeat probe of a wider set, whose dropped members never reached DDP's final
# loss in 2N steps: local:16 + sparseloco (mlp 2 and 4 hosts, 100 Mbit/s: +48% to +113% loss at
# step N; charlm +13%) and diloco:8:4:1 + sparseloco on charlm (+13%).
MLP = (DDP, LOCAL4, GOSSIP4, L8S, MLP_PLAIN, MLP_STREAM, MLP_EAGER, MLP_FAST_8, MLP_FAST, ONLY)
MLP_SHORT = (DDP, LOCAL4, GOSSIP4, L8S, MLP_STREAM, MLP_FAST, ONLY)
MLP4 = (DDP, LOCAL4, GOSSIP4, L8S, MLP_STREAM, MLP4_FAST, MLP4_WHOLE, ONLY)
SETTINGS = (
    Setting("mlp2", "mlp", 2, "1gbit", MLP, goal=5.0, share_goal=0.8),
    Setting("mlp4", "mlp", 4, "1gbit", MLP4, goal=4.0, share_goal=0.8),
    Setting(
        "charlm2",
        "charlm",
        2,
        "1gbit",
        (DDP, LOCAL4, GOSSIP4, L8S, LM_PLAIN, LM_STREAM, LM_FAST, LM_KEEP, ONLY),
        batch=32,
        steps=128,
        goal_of_limit=0.9,
        share_goal=0.95,
    ),
    # 1M parameters: at a tenth of the bandwidth, DDP's 64 steps of the 3M model alone take a
    # minute; 4 MB per exchange at 100 Mbit/s is like 40 MB at 1 Gbit/s.
    Setting("mlp2-100m", "mlp", 2, "100mbit", MLP_SHORT, params=1_000_000),
)
#: settings run only when named (``--settings``): issue 46's gossip question, 8 ranks (4 hosts
#: of 2, which share their host's link) at 100 Mbit/s, gossip and NoLoCo against the periodic
#: all-reduce strategies (several minutes: DDP's 64 steps alone take about a minute)
EXTRA_SETTINGS = (
    Setting(
        "gossip8-100m",
        "mlp",
        4,
        "100mbit",
        (DDP, LOCAL4, GOSSIP4, GOSSIP1_INT8, NOLOCO4, MLP_STREAM, ONLY),
        params=1_000_000,
        per_host=2,
    ),
    # issue 46's held-out model (benchmarks/frontier_model.py: a transformer no benchmark had
    # used), 2 hosts at 1 Gbit/s, 8 sequences of 64 tokens a step: the mlp's and charlm's
    # candidates as tuned on them, and the held-out model's own best from a loopback probe
    Setting(
        "heldout2",
        "heldout",
        2,
        "1gbit",
        (DDP, LOCAL4, MLP_PLAIN, MLP_STREAM, LM_STREAM, LM_FAST, HO_FAST, ONLY),
        batch=8,
        steps=128,
    ),
)
QUICK = {
    "mlp2": {"params": 1_000_000, "steps": 16},
    "charlm2": {"steps": 32},
    "heldout2": {"steps": 32},
}


# Worker side: cluster_worker, plus each gradsync run's bytes per step -------------------------


def worker(argv: Sequence[str]) -> int:
    """``benchmarks.cluster_worker``'s main, with each gradsync run's per-step bytes (this
    rank's, from its report's records) added to the run's result."""
    from benchmarks import cluster_worker as cw

    got: dict[str, list[int]] = {}
    make, train = cw.make_trainer, cw.train_one

    def make_trainer(args: Any, spec: Any) -> Any:
        trainer = make(args, spec)
        if trainer.sync is not None:
            report = trainer.sync.report

            def counted() -> Any:
                rep = report()
                rank = min(r.rank for r in rep.records) if rep.records else 0
                mine = sorted((r.step, r.bytes) for r in rep.records if r.rank == rank)
                got[spec.name] = [b for _, b in mine]
                return rep

            trainer.sync.report = counted
        return trainer

    def train_one(args: Any, spec: Any, seen: dict[str, Any]) -> dict[str, Any]:
        res = train(args, spec, seen)
        res["step_bytes"] = got.pop(spec.name, None)
        return res

    cw.make_trainer, cw.train_one = make_trainer, train_one
    return cw.main(list(argv))


# Driver ------------------------------------------------------------------------------------------


def launch(
    cluster: Cluster, args: list[str], out: Path, what: str, per_host: int = 1
) -> dict[str, Any]:
    """One launch of ``worker`` on every host (cluster.py's ``launch``, this module's worker),
    ``per_host`` ranks on each."""
    for stale in out.parent.glob(out.name + "*"):
        stale.unlink()
    t0 = time.monotonic()
    cmd = ["benchmarks.frontier", "--worker", *args, "--out", str(out)]
    rc = launch_on_cluster(cluster, cmd, per_host, env=worker_env(), timeout_s=900)
    if rc != 0 or not out.exists():
        raise RuntimeError(f"launch failed (rc {rc}) after {time.monotonic() - t0:.0f}s: {args}")
    result: dict[str, Any] = json.loads(out.read_text())
    say(f"  {what}: {time.monotonic() - t0:.0f}s")
    return result


def measure(s: Setting, repeats: int, workdir: Path) -> list[dict[str, Any]]:
    """Per repeat, the runs by key."""
    reps = []
    with Cluster(hosts=s.hosts, link=s.link, prefix=PREFIX) as cluster:
        for rep in range(repeats):
            runs = [
                "--config=" + c.run_arg(s.steps if c.exact else APPROX_FACTOR * s.steps)
                for c in order(s.configs, rep, ROTATE)
            ]
            out = workdir / f"{s.key}-{rep}.json"
            what = f"{s.key}, repeat {rep + 1}/{repeats}"
            res = launch(cluster, [*s.args(), *runs], out, what, s.per_host)
            reps.append({r["name"]: r for r in res["runs"]})
    return reps


def one_repeat(s: Setting, runs: dict[str, Any]) -> dict[str, Any]:
    """Every figure of one repeat, by configuration key; ratios against this launch's DDP."""
    ddp, n = runs["ddp"], s.steps
    target = ma_at(ddp["loss"], n - 1) * (1 + FINAL_SLACK)
    hit = time_to_target(ddp, target)
    assert hit is not None  # DDP's own final MA is below the target
    ddp_sps = samples_per_s(ddp, s.batch)
    only = runs.get(ONLY.key)
    limit = samples_per_s(only, s.batch) / ddp_sps if only else None
    only_cpu = cpu_per_step(only) if only else None
    out: dict[str, Any] = {}
    for c in s.configs:
        r = runs[c.key]
        sps = samples_per_s(r, s.batch)
        row: dict[str, Any] = {"vs_ddp_sps": sps / ddp_sps}
        cpu = cpu_per_step(r)
        row["cpu_vs_only"] = cpu / only_cpu if cpu and only_cpu else None
        if c.mode == "compute-only":
            row["cores_busy"] = cores_busy(r)
            out[c.key] = row
            continue
        mine = time_to_target(r, target)
        row["sooner"] = hit[0] / mine[0] if mine else None
        row["step"] = mine[1] if mine else None
        row["cpu_share"] = cpu_bound_share(r, mine, hit[0], limit)
        row["loss_gap"] = ma_at(r["loss"], n - 1) / ma_at(ddp["loss"], n - 1) - 1
        per_step = r.get("step_bytes") or [r["grad_bytes"]] * len(r["loss"])  # DDP: gradient
        row["mb_n"] = sum(per_step[:n]) / 1e6
        row["mb_hit"] = sum(per_step[: mine[1] + 1]) / 1e6 if mine else None
        row["peak_mb"] = max(per_step) / 1e6
        row["measured_bytes"] = r.get("step_bytes") is not None
        out[c.key] = row
    out["target"] = target
    return out


def cpu_per_step(run: dict[str, Any]) -> float | None:
    """The machine's busy CPU seconds a step over the run (every rank and the kernel)."""
    busy = run.get("busy_cpu_s")
    return busy[-1] / len(busy) if busy else None


def _cores(run: dict[str, Any]) -> int:
    """The cores /proc/stat's busy count covers: the worker's, else this machine's (the same
    machine: the emulated hosts are its network namespaces)."""
    return int(run.get("cores") or os.cpu_count() or 1)


def cores_busy(run: dict[str, Any]) -> float | None:
    """The share of the machine's cores busy over the run."""
    busy = run.get("busy_cpu_s")
    return busy[-1] / (run["time_s"][-1] * _cores(run)) if busy else None


def cpu_bound_share(
    run: dict[str, Any], mine: tuple[float, int] | None, ddp_s: float, limit: float | None
) -> float | None:
    """The share of the compute-only limit this run could have had if its CPU work up to DDP's
    final loss had kept every core busy: DDP's seconds over (that work / cores), over the limit.
    No schedule of that much work does better on this machine; a share above it needs less CPU
    a step (fewer bytes through the kernel, cheaper codecs, less contention between the
    exchange and the passes beside it) or fewer steps."""
    busy = run.get("busy_cpu_s")
    if not busy or mine is None or not limit or busy[mine[1]] <= 0:
        return None
    return ddp_s / (busy[mine[1]] / _cores(run)) / limit


def summarize(s: Setting, reps: list[dict[str, Any]]) -> dict[str, Any]:
    per = [one_repeat(s, runs) for runs in reps]
    rows: dict[str, Any] = {}
    for c in s.configs:
        got = [p[c.key] for p in per]
        row = {k: median(g.get(k) for g in got) for k in got[0] if k != "measured_bytes"}
        row["reached"] = sum(g.get("sooner") is not None for g in got)
        row["per_repeat"] = [g.get("sooner") for g in got]
        row["measured_bytes"] = got[0].get("measured_bytes", False)
        rows[c.key] = row
    return {"rows": rows, "repeats": len(per), "target": median(p["target"] for p in per)}


def _share(x: float, goal: float) -> str:
    """``x`` as a percentage, with as many decimals as it takes for a miss not to read as the
    goal (or above it) once rounded: 94.8%, not 95%, against a goal of 95%."""
    for digits in range(4):
        shown = f"{x:.{digits}%}"
        if x >= goal or float(shown[:-1]) / 100 < goal:
            return shown
    return f"{x:.4%}"


def _f(x: float | None, spec: str, unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def render_setting(s: Setting, summ: dict[str, Any]) -> str:
    rows, n = summ["rows"], s.steps
    limit = rows["compute-only"]["vs_ddp_sps"]
    out = []
    for c in s.configs:
        r = rows[c.key]
        cpu = _f(r.get("cpu_vs_only"), ".2f", "x")
        if c.mode == "compute-only":
            busy = _f(r.get("cores_busy"), ".0%", " of the cores busy")
            cells = ["100%", f"{limit:.2f}x (limit)", f"{cpu} ({busy})", "-", "-", "-", "-", "-"]
        else:
            k = summ["repeats"]
            note = "" if r["reached"] in (0, k) else f" ({r['reached']}/{k} repeats)"
            sooner = (
                f"not reached in {APPROX_FACTOR * n} steps"
                if r["sooner"] is None
                else f"{r['sooner']:.2f}x (step {r['step']:.0f}){note}"
            )
            mb = _f(r["mb_n"], ".3f") + ("" if r["measured_bytes"] else " (gradient x steps)")
            share = None if r["sooner"] is None else r["sooner"] / limit
            cells = [
                _f(share, ".0%"),
                sooner,
                cpu,
                _f(r.get("cpu_share"), ".0%"),
                _f(r["loss_gap"], "+.1%"),
                mb,
                _f(r["mb_hit"], ".3f"),
                _f(r["peak_mb"], ".3f"),
            ]
        steps = n if c.exact else APPROX_FACTOR * n
        out.append([c.label, str(steps), f"{r['vs_ddp_sps']:.2f}x", *cells])
    head = (
        "configuration | steps run | samples/s vs DDP | share of the compute-only limit | "
        "x sooner to DDP's final loss | machine CPU a step vs compute-only | "
        "share at the CPU bound | "
        f"loss at step {n} vs DDP | MB per rank in {n} steps | MB per rank to DDP's loss | "
        "peak MB per sync"
    )
    text = f"**{s.what()}** (target {summ['target']:.4f})\n\n{table(head, out)}\n"
    pair = PAIRS.get(s.workload)
    if pair and pair[0].key in rows and pair[1].key in rows:
        plain, stream = rows[pair[0].key]["peak_mb"], rows[pair[1].key]["peak_mb"]
        text += (
            f"\nPeak bytes per sync: {pair[1].label} {stream:.3f} MB, {stream / plain:.2f} of "
            f"{pair[0].label}'s {plain:.3f} MB (1/F = {1 / pair[2]:.2f}).\n"
        )
    return text


def goals(done: dict[str, tuple[Setting, dict[str, Any]]]) -> list[str]:
    lines = []
    for s, summ in done.values():
        rows = summ["rows"]
        limit = rows["compute-only"]["vs_ddp_sps"]
        cands = [c for c in s.configs if c.mode == "gradsync" and rows[c.key]["sooner"]]
        best = max(cands, key=lambda c: rows[c.key]["sooner"], default=None)
        if best is None:
            lines.append(f"- {s.what()}: no gradsync configuration reached DDP's final loss")
            continue
        x = rows[best.key]["sooner"]
        found = (
            f"best {best.label}, {x:.2f}x sooner (compute-only limit {limit:.2f}x, "
            f"{x / limit:.0%} of it)"
        )
        if s.goal is not None:
            verdict = "met" if x >= s.goal else "not met"
            lines.append(f"- {s.what()}: goal >= {s.goal:g}x: {found}: **{verdict}**")
        elif s.goal_of_limit is not None:
            frac = x / limit
            verdict = "met" if frac >= s.goal_of_limit else "not met"
            lines.append(
                f"- {s.what()}: goal within {1 - s.goal_of_limit:.0%} of the compute-only limit:"
                f" {found}: **{verdict}**"
            )
        else:
            lines.append(f"- {s.what()} (report only): {found}")
        if s.share_goal is not None:
            verdict = "met" if x / limit >= s.share_goal else "not met"
            shown = _share(x / limit, s.share_goal)
            lines.append(
                f"  - issue 46: {shown} of the compute-only limit (goal >= "
                f"{s.share_goal:.0%}): **{verdict}**" + cpu_bound_line(s, rows, cands)
            )
        pair = PAIRS.get(s.workload)
        for c in s.configs:
            if not _streaming(c):
                continue
            gap = rows[c.key]["loss_gap"]
            line = (
                # "within 2% of DDP's" read as no more than 2% above it: a lower loss at equal
                # steps is the candidate doing better, not a miss
                f"  - streaming {c.label}: loss at step {s.steps} {gap:+.1%} vs DDP (goal at "
                f"most 2% above DDP's: **{'met' if gap <= 0.02 else 'not met'}**)"
            )
            if pair and c.key == pair[1].key and pair[0].key in rows:
                ratio = rows[c.key]["peak_mb"] / rows[pair[0].key]["peak_mb"]
                met = "met" if ratio <= 1.05 / pair[2] else "not met"
                line += (
                    f"; peak bytes per sync {ratio:.2f} of {pair[0].label}'s "
                    f"(goal 1/F = {1 / pair[2]:.2f}: **{met}**)"
                )
            lines.append(line)
    return lines


def cpu_bound_line(s: Setting, rows: dict[str, Any], cands: list[Config]) -> str:
    """Where the goal stands against the CPU bound: the highest share any configuration that
    reached DDP's loss could have had with every core busy with its own work."""
    bounds = [(rows[c.key].get("cpu_share"), c) for c in cands]
    known = [(b, c) for b, c in bounds if b is not None]
    if not known or s.share_goal is None:
        return ""
    top, c = max(known, key=lambda bc: bc[0])
    if top >= s.share_goal:
        return f"; at the CPU bound {c.label} could reach {_share(top, s.share_goal)}"
    return (
        f"; at the CPU bound no configuration here could reach it (the highest, {c.label}, "
        f"{_share(top, s.share_goal)}): at the CPU work they did, no schedule reaches it on "
        "this machine"
    )


def render(
    settings: list[Setting], done: dict[str, Any], failed: dict[str, str], repeats: int,
    minutes: float, command: str, quick: bool,
) -> str:  # fmt: skip
    parts = [render_setting(*done[s.key]) for s in settings if s.key in done]
    parts += [f"**{s.what()}**: failed: {failed[s.key]}\n" for s in settings if s.key in failed]
    smoke = " (a smoke run: small sizes, not a measurement)" if quick else ""
    return "\n".join(
        [
            "## The low-bandwidth frontier on the emulated cluster (issue 16)",
            "",
            f"Command (as root): `{command}`{smoke}. Machine: {machine()}. Whole run: "
            f"{minutes:.1f} min. {repeats} repeat(s), medians of per-repeat ratios.",
            "",
            "Emulated hosts as in the cluster section (network namespaces, veth links limited by "
            "tc tbf, 1 rank per host, gloo, 1 thread per rank; the workload's own optimizer). "
            "Each repeat of a setting is one launch that runs DDP, compute-only and every "
            "candidate in turn, order rotated by repeat; every ratio is against that launch's "
            f"DDP. DDP and compute-only run N steps, the candidates {APPROX_FACTOR} N. "
            f"**x sooner**: DDP's seconds to its own final loss (its {MA}-step moving average at "
            f"step N, +{FINAL_SLACK:.0%}) over the candidate's seconds to the same loss, from "
            "the start of step 0 (a gradsync run's Synchronizer built, and its liveness "
            "voucher started, before it: `cluster_worker.await_voucher`); the step it got "
            "there. **Limit**: compute-only's samples/s "
            "over DDP's (after 5 warm-up steps), the most any scheme that needs DDP's number of "
            "steps can gain. **Share of the compute-only limit**: x sooner over the limit, issue "
            "46's headline (a scheme that needs fewer steps than DDP can pass 100%); it still "
            "moves with the machine: the faster the compute, the larger the share of a step the "
            "exchanges' own CPU takes. **Machine CPU a step**: the whole machine's busy CPU "
            "(every rank, gloo's threads, the kernel's work for the links; /proc/stat, read by "
            "rank 0 after each step) over the run, per step, against compute-only's. **Share at "
            "the CPU bound**: the share this configuration would have had if its CPU work up to "
            "DDP's loss had kept every core busy (DDP's seconds over that work divided by the "
            "cores, over the limit): no schedule of the same work is faster on this machine. "
            "**Loss at step N**: the candidate's moving "
            "average at step N over DDP's, minus 1. **MB per rank**: bytes each rank handed "
            "to exchanges, from the run's own records (for DDP: the gradient's size per step); "
            "peak: the most in one step's exchange (for streaming DiLoCo: one fragment's).",
            "",
            *parts,
            "Goals of issues 16 and 46:",
            "",
            *goals(done),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    h = Harness("benchmarks.frontier", __doc__, repeats=1, python=".venv/bin/python")
    keys = ",".join(s.key for s in SETTINGS)
    h.parser.add_argument("--settings", default=keys, help="which settings (default %(default)s)")
    h.parser.add_argument("--workdir", default=None, help="keep worker JSON and logs here")
    args = h.parse(argv)
    missing = requirements_missing()
    if missing:
        print(f"benchmarks.frontier: {missing}", file=sys.stderr)
        return 2
    by_key = {s.key: s for s in (*SETTINGS, *EXTRA_SETTINGS)}
    wanted = [k.strip() for k in args.settings.split(",") if k.strip()]
    if not wanted or set(wanted) - set(by_key):
        h.error(f"--settings takes a comma-separated subset of {', '.join(by_key)}")
    settings = [by_key[k] for k in wanted]
    if args.quick:
        from dataclasses import replace

        settings = [replace(by_key[k], **QUICK[k]) for k in QUICK if k in wanted]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gradsync-frontier-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "workers.log"
    say(f"benchmarks.frontier: worker output in {log}")
    started = time.monotonic()
    done: dict[str, Any] = {}
    failed: dict[str, str] = {}
    raw: dict[str, Any] = {}
    with worker_output_to(log):
        for s in settings:
            try:
                reps = measure(s, args.repeats, workdir)
                summ = summarize(s, reps)
                done[s.key] = (s, summ)
                raw[s.key] = summ
            except Exception as exc:  # noqa: BLE001 - report it, measure the other settings
                say(f"  {s.key} failed: {exc}")
                failed[s.key] = f"{type(exc).__name__}: {exc} (workers' output: {log})"
    minutes = (time.monotonic() - started) / 60
    (workdir / "summary.json").write_text(json.dumps(raw, indent=1, default=str))
    text = render(settings, done, failed, args.repeats, minutes, h.command(), args.quick)
    skip = "a setting failed" if failed else ("a smoke run (--quick)" if args.quick else None)
    h.finish(text, skip)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
