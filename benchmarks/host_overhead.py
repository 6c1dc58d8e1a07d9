"""Host overhead per step against DDP's (issue 44): a step that is all overhead, 2 gloo ranks.

The model is ``make_workload("mlp", seed=3, params=5000)`` (as ``benchmarks.gate``), trained
with plain SGD on 8 samples per rank, 1 thread per rank, gloo on loopback: its forward,
backward and update take a fraction of a millisecond, so the step time is the framework's own
host work (Python, hooks, bookkeeping, the collective's launch and wait). Five configurations,
each its own replica from the same seed, in the same processes over the same group: torch DDP
with its defaults; gradsync ``bsp`` with its defaults (``gs.Synchronizer(model, opt, "bsp")``);
'bare' (``telemetry=False, check_every=0, skip_nonfinite=False``); and each of those two with
the step gate off (``between_steps_timeout_s=None``). They run in interleaved blocks of
``--steps`` steps (100 by default: one divergence check and ten telemetry gathers per block,
the defaults' periods), the order rotated by repeat; each gradsync block is divided by the DDP
block of the same repeat, and the table gives the median ratio and the middle half. A
second table divides the same blocks pairwise (default by default with the gate off, default
by bare, ...): what the gate and the safety features cost, timed, not profiled.

The per-phase breakdown: after the timed blocks, cProfile runs over ``--profile-steps`` steps
of the default configuration, of 'bare', of 'bare, gate off' and of DDP, on both ranks (so
that neither waits for a profiled peer more than it would otherwise), and rank 0's profile is
read. Every function's own time (cProfile's tottime) is put in a phase:

- a function of gradsync's is in the phase of its file: the Synchronizer
  (``synchronizer.py``), buckets and hooks (``buckets.py``, the autograd hooks included), the
  gate (``checks/gate.py``, ``checks/gate_ahead.py``), telemetry (``telemetry/``), the guard and
  divergence check (``checks/guards.py``), the strategy (``strategies/``), the arrival
  watch and the group's timeout (``checks/diagnose.py``), other gradsync (``compat``,
  ``flat``, ...: the write-up names the files); ``workloads/`` is the step's own code;
- torch's: the forward (``torch/nn``; DDP's Python wrapper, ``torch/nn/parallel``, is a row of
  its own), autograd (the C++ engine's ``run_backward`` and ``torch/autograd``), the optimizer
  (``torch/optim``), profiler ranges (``torch/profiler``, ``torch/autograd/profiler.py``:
  ``record_function``), the collectives (torch.distributed's collective calls, their
  ``Work``/``Future`` waits, the ``c10d_logger`` wrapper: launch and wait together), split by
  whose they are (the telemetry's and the divergence check's gathers, else the gradients'
  all-reduce) by looking through them to the gradsync code that called them, and a
  ``TCPStore``'s requests made on the training thread (the gate's are on its own thread);
- anything else (built-in functions such as a tensor's ``copy_``, ``threading``, ``contextlib``,
  torch.distributed's helpers such as ``get_world_size``, torch's other Python) is charged to
  the phase of the function that called it, split by cProfile's per-caller times; above one
  level up, by the callers' cumulative times. So a gradient copied into its bucket is bucket
  bookkeeping, the training thread's join of the gate's thread is the gate, and a lock taken
  by the collective's launch is the collective.

Limits. cProfile's hook runs at every Python call and return: it inflates Python-heavy code
(gradsync's) far more than C++ (DDP's reducer, autograd), so the profiled step is longer than
the timed one and the Python phases' shares are upper bounds; the Python calls per step, also
given, are exact. A C++ callee's time (autograd's engine running the hooks, the reducer inside
``run_backward``) is the caller's own time: DDP's bucket copies and its all-reduce's launch and
wait are in its autograd row. cProfile's clock is the wall clock and only the training thread
is profiled: time the thread spends descheduled (gloo's worker threads, the gate's thread and
the other rank share 2 cores) or waiting for the GIL is charged to whatever it was running,
most of all the collective's launch (which wakes gloo's thread) and its wait. The gate's
thread makes its store round trips while the block runs, so what it takes from the training
thread shows in the rows of what that thread ran meanwhile (the batch, the forward), not in
the gate's row: the timed differences between configurations (the second table) count it.
Above one level, the split by cumulative time assumes every call of a function costs the same
whoever calls it. The collectives share ``c10d_logger``'s wrapper: looking through it, the
callers whose calls add up to the collective's are taken where exactly one set of them does
(the gradients' all-reduce and the gathers differ in count), else all of it is split by
cumulative time. The step's own code includes
the ``with sync.step()`` statement's ``contextlib`` frames, which a DDP step does not have.
"""

from __future__ import annotations

import cProfile
import itertools
import os
import pstats
import statistics
import subprocess
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradsync as gs
from benchmarks.harness import (
    ROOT,
    Harness,
    fmt_iqr,
    machine,
    median_iqr,
    pair_ratios,
    table,
    time_interleaved,
)
from gradsync.processes.launch import launch
from gradsync.workloads import make_workload

DDP = "DDP"
DEFAULT = "default"
BARE = "bare"
DEFAULT_NO_GATE = "default, gate off"
BARE_NO_GATE = "bare, gate off"
CONFIGS = (DDP, DEFAULT, BARE, DEFAULT_NO_GATE, BARE_NO_GATE)
#: what the breakdown profiles
PROFILED = (DEFAULT, BARE, BARE_NO_GATE, DDP)
#: the issue's goals: gradsync / DDP
GOALS = {DEFAULT: 1.05, BARE: 1.00}
PARAMS, PER_RANK = 5000, 8

SYNCHRONIZER = "Synchronizer (synchronizer.py)"
BUCKETS = "buckets and hooks (buckets.py)"
GATE = "gate (checks/gate*.py; arming, joining its thread)"
TELEMETRY = "telemetry (telemetry/)"
GUARDS = "guard and divergence check (checks/guards.py)"
STRATEGY = "strategy (strategies/)"
WATCH = "arrival watch, group timeout (checks/diagnose.py)"
OTHER_GS = "other gradsync"
RANGES = "profiler ranges (record_function)"
DDP_PY = "DDP's Python (torch/nn/parallel)"
FORWARD = "forward (torch/nn)"
AUTOGRAD = "autograd (engine, C++ hooks)"
OPTIMIZER = "optimizer (torch/optim)"
COLLECTIVE = "collective: gradients' all-reduce, launch and wait"
GATHERS = "collective: telemetry's and the check's gathers"
STORE = "store requests (training thread)"
OWN = "the step's own code (batch, loss, loop)"
OTHER = "other"
PHASES = (
    SYNCHRONIZER,
    BUCKETS,
    GATE,
    TELEMETRY,
    GUARDS,
    STRATEGY,
    WATCH,
    OTHER_GS,
    RANGES,
    DDP_PY,
    FORWARD,
    AUTOGRAD,
    OPTIMIZER,
    COLLECTIVE,
    GATHERS,
    STORE,
    OWN,
    OTHER,
)
#: gradsync's own phases: what DDP does not have
GRADSYNC_PHASES = PHASES[:8]

# (path fragment, phase) in order, the first that matches wins; paths with '/' as separator
_FILES = (
    ("/gradsync/workloads/", OWN),
    ("/gradsync/synchronizer.py", SYNCHRONIZER),
    ("/gradsync/buckets.py", BUCKETS),
    ("/gradsync/checks/gate", GATE),
    ("/gradsync/telemetry/", TELEMETRY),
    ("/gradsync/checks/guards.py", GUARDS),
    ("/gradsync/strategies/", STRATEGY),
    ("/gradsync/checks/diagnose.py", WATCH),
    ("/gradsync/", OTHER_GS),
    ("/benchmarks/host_overhead.py", OWN),
    ("/torch/profiler/", RANGES),
    ("/torch/autograd/profiler", RANGES),
    ("/torch/autograd/", AUTOGRAD),
    ("/torch/nn/parallel/", DDP_PY),
    ("/torch/nn/", FORWARD),
    ("/torch/optim/", OPTIMIZER),
)
# Built-in (C) functions that are a phase of their own, by a fragment of their name
_BUILTINS = (
    ("run_backward", AUTOGRAD),
    ("torch._C.Future", COLLECTIVE),
    ("torch._C.wait>", COLLECTIVE),  # a torch.futures.Future's wait
    ("_record_function", RANGES),
)
#: what is a collective (or its wait) of torch.distributed's, by name: its other functions
#: (``get_world_size``, ``_get_backend``, the default timeout) are charged to their callers
_COLLECTIVES = frozenset(
    {
        *("all_reduce", "allreduce", "all_gather", "allgather", "all_gather_into_tensor"),
        *("_allgather_base", "broadcast", "barrier", "reduce_scatter", "reduce_scatter_tensor"),
        *("all_to_all", "alltoall", "all_gather_object", "broadcast_object_list", "gather"),
        *("scatter", "send", "recv", "isend", "irecv", "wait", "then", "value", "wrapper"),
    }
)
#: a TCPStore's requests (the gate's and the watch's), by the name of the method
_STORE = frozenset(
    {"add", "set", "get", "compare_set", "check", "multi_get", "multi_set", "delete_key"}
)

Func = tuple[str, int, str]


def anchor(func: Func) -> str | None:
    """The phase ``func`` is in by where it is defined; None: charged to its callers."""
    filename, _, name = func
    if filename == "~":
        if "_distributed_c10d." in name:
            method = name.rpartition(".")[2].rstrip(">")
            return COLLECTIVE if method in _COLLECTIVES else STORE if method in _STORE else None
        return next((phase for frag, phase in _BUILTINS if frag in name), None)
    path = filename.replace(os.sep, "/")
    if path.endswith("/torch/_tensor.py") and name == "backward":
        return AUTOGRAD
    if "/torch/distributed/" in path or "/torch/futures/" in path:
        return COLLECTIVE if name in _COLLECTIVES else None
    return next((phase for frag, phase in _FILES if frag in path), None)


class Attribution:
    """Each function's own time and calls put in phases (``pstats.Stats.stats``: function ->
    (primitive calls, calls, tottime, cumtime, callers))."""

    def __init__(self, stats: dict[Func, Any]) -> None:
        self.stats = stats
        self._memo: dict[tuple[Func, bool, int], dict[str, float]] = {}

    def context(
        self, func: Func, seen: frozenset[Func], through: bool = False, calls: int = 0
    ) -> dict[str, float]:
        """The phases ``func``'s time belongs to, as fractions summing to 1: its own, else its
        callers' by their cumulative times (by their call counts where those are all 0).
        ``through``: a collective's callers are looked through too (whose collective it is);
        ``calls`` of ``func`` were made by the callee asked for, and where exactly one set of
        ``func``'s callers made that many calls (a wrapper shared by collectives, called by
        each of them as often as its callers called it), only those callers count."""
        phase = anchor(func)
        if phase is not None and not (through and phase == COLLECTIVE):
            return {phase: 1.0}
        key = (func, through, calls if through else 0)
        if key in self._memo:
            return self._memo[key]
        edges = self.stats.get(func, (0, 0, 0.0, 0.0, {}))[4]
        callers = {c: e for c, e in edges.items() if c not in seen}
        if through and calls:
            callers = _matching(callers, calls)
        weights = {c: float(e[3]) for c, e in callers.items()}
        if sum(weights.values()) <= 0:
            weights = {c: float(e[1]) for c, e in callers.items()}
        total = sum(weights.values())
        if total <= 0:
            return {OTHER: 1.0}
        out: dict[str, float] = defaultdict(float)
        for caller, w in weights.items():
            made = int(callers[caller][1])
            for p, f in self.context(caller, seen | {func}, through, made).items():
                out[p] += f * w / total
        self._memo[key] = dict(out)
        return self._memo[key]

    def charged(self, func: Func) -> dict[str, tuple[float, float]]:
        """``func``'s own seconds and Python calls by phase: all in its own phase if it has
        one, else split by caller exactly (cProfile keeps each caller's share of a callee's
        own time), then by those callers' phases. A collective is split by whose it is: the
        telemetry's or the divergence check's gathers, else the gradients' all-reduce."""
        _, nc, tt, _, callers = self.stats[func]
        python = func[0] != "~"
        phase = anchor(func)
        if phase == COLLECTIVE and callers:
            whose = self._split(func, callers, tt, python, through=True)
            out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
            for p, (sec, calls) in whose.items():
                mine = GATHERS if p in (TELEMETRY, GUARDS) else COLLECTIVE
                out[mine][0] += sec
                out[mine][1] += calls
            return {p: (v[0], v[1]) for p, v in out.items()}
        if phase is not None or not callers:
            return {phase or OTHER: (tt, nc if python else 0)}
        return self._split(func, callers, tt, python)

    def _split(
        self, func: Func, callers: dict[Func, Any], tt: float, python: bool, through: bool = False
    ) -> dict[str, tuple[float, float]]:
        edge_tt = sum(e[2] for e in callers.values())
        edge_nc = sum(e[1] for e in callers.values())
        out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for caller, e in callers.items():
            share = e[2] / edge_tt if edge_tt > 0 else e[1] / max(edge_nc, 1)
            for p, f in self.context(caller, frozenset({func}), through, int(e[1])).items():
                out[p][0] += tt * share * f
                out[p][1] += e[1] * f if python else 0.0
        return {p: (v[0], v[1]) for p, v in out.items()}

    def phases(self) -> dict[str, tuple[float, float]]:
        """Seconds of own time and Python calls by phase, over the whole profile."""
        total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for func in self.stats:
            for p, (s, c) in self.charged(func).items():
                total[p][0] += s
                total[p][1] += c
        return {p: (v[0], v[1]) for p, v in total.items()}

    def files(self, phase: str) -> dict[str, float]:
        """Own seconds of the Python functions in ``phase``, by file (the callees it is charged
        for left out)."""
        out: dict[str, float] = defaultdict(float)
        for func, v in self.stats.items():
            if func[0] != "~" and anchor(func) == phase:
                out[_name((func[0], 0, "")).partition(":")[0]] += v[2]
        return dict(out)

    def python_in(self, phase: str) -> dict[str, tuple[float, int]]:
        """Own seconds and calls of the Python functions in ``phase``, by function."""
        return {
            _name(func): (v[2], v[1])
            for func, v in self.stats.items()
            if func[0] != "~" and anchor(func) == phase
        }

    def top(self, count: int) -> list[tuple[str, float, int, str]]:
        """The ``count`` functions of most own time: (name, seconds, calls, where charged)."""
        ranked = sorted(self.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:count]
        out = []
        for func, v in ranked:
            parts = sorted(self.charged(func).items(), key=lambda kv: -kv[1][0])
            where = ", ".join(
                f"{p} {s / v[2]:.0%}" if len(parts) > 1 else p
                for p, (s, _) in parts[:2]
                if v[2] <= 0 or s / v[2] >= 0.05
            )
            out.append((_name(func), v[2], v[1], where or parts[0][0]))
        return out


def _matching(callers: dict[Func, Any], calls: int, most: int = 10) -> dict[Func, Any]:
    """The callers whose calls add up to ``calls``, where exactly one set of them does (among
    up to ``most`` callers); else all of them."""
    if len(callers) > most or sum(e[1] for e in callers.values()) == calls:
        return callers
    names = list(callers)
    found = [
        subset
        for n in range(1, len(names))
        for subset in itertools.combinations(names, n)
        if sum(callers[c][1] for c in subset) == calls
    ]
    return {c: callers[c] for c in found[0]} if len(found) == 1 else callers


def _name(func: Func) -> str:
    filename, line, name = func
    if filename == "~":
        return name
    path = filename.replace(os.sep, "/")
    for root in ("/gradsync/", "/torch/", "/benchmarks/"):
        if root in path:
            path = root[1:] + path.rsplit(root, 1)[1]
            break
    else:
        path = os.path.basename(path)
    return f"{path}:{line}({name})"


# The ranks ---------------------------------------------------------------------------------------


def _trainer(kind: str, rank: int, world: int) -> Any:
    """``step(i)`` of configuration ``kind``: its own model from the same seed, plain SGD."""
    w = make_workload("mlp", seed=3, params=PARAMS)
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    lo, hi = PER_RANK * rank, PER_RANK * (rank + 1)

    if kind == DDP:
        net = DistributedDataParallel(model)

        def ddp_step(i: int) -> None:
            opt.zero_grad(set_to_none=True)
            x, y = w.batch(i, PER_RANK * world, lo, hi)
            w.loss(net, x, y).backward()
            opt.step()

        return ddp_step, net
    options: dict[str, Any] = {}
    if kind in (BARE, BARE_NO_GATE):
        options.update(telemetry=False, check_every=0, skip_nonfinite=False)
    if kind in (DEFAULT_NO_GATE, BARE_NO_GATE):
        options.update(between_steps_timeout_s=None)
    sync = gs.Synchronizer(model, opt, "bsp", **options)

    def step(i: int) -> None:
        with sync.step():
            x, y = w.batch(i, PER_RANK * world, lo, hi)
            w.loss(model, x, y).backward()

    return step, sync


def _profile(step: Any, first: int, steps: int) -> tuple[dict[Func, Any], float]:
    """cProfile's stats of ``steps`` steps on this thread, and their wall seconds."""
    dist.barrier()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(first, first + steps):
        step(i)
    prof.disable()
    wall = time.perf_counter() - t0
    dist.barrier()
    return pstats.Stats(prof).stats, wall  # type: ignore[attr-defined]


def worker(job: dict[str, Any]) -> dict[str, Any] | None:
    gs.init()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    made = {kind: _trainer(kind, rank, world) for kind in CONFIGS}
    steps = {kind: m[0] for kind, m in made.items()}
    blocks = time_interleaved(steps, job["repeats"], job["steps"], warmup=5)
    first = 5 + job["repeats"] * job["steps"]
    profiles = {}
    for kind in PROFILED:
        stats, wall = _profile(steps[kind], first, job["profile_steps"])
        found = Attribution(stats)
        profiles[kind] = {
            "phases": found.phases(),
            "top": found.top(15),
            "other_files": found.files(OTHER_GS),
            "collective_python": found.python_in(COLLECTIVE),
            "wall": wall,
            "own": sum(v[2] for v in stats.values()),
        }
    for kind, (_, obj) in made.items():
        if kind != DDP:
            obj.close()
    return {"blocks": blocks, "profiles": profiles} if rank == 0 else None


# The write-up -----------------------------------------------------------------------------------


#: what each pair of configurations differs by, timed: (what, with, without)
DIFFERENCES = (
    ("the gate, on the defaults", DEFAULT, DEFAULT_NO_GATE),
    ("the gate, on bare", BARE, BARE_NO_GATE),
    ("telemetry, guard and divergence check, gate on", DEFAULT, BARE),
    ("telemetry, guard and divergence check, gate off", DEFAULT_NO_GATE, BARE_NO_GATE),
)


def _difference_rows(blocks: dict[str, list[float]]) -> list[list[str]]:
    rows = []
    for what, on, off in DIFFERENCES:
        a, b, ddp = blocks[on], blocks[off], blocks[DDP]
        rows.append(
            [
                what,
                f"{on} / {off}: {fmt_iqr(pair_ratios(a, b))}",
                fmt_iqr([(x - y) * 1e3 for x, y in zip(a, b, strict=True)], "+.3f", sep=" to "),
                fmt_iqr(
                    [(x - y) / d * 100 for x, y, d in zip(a, b, ddp, strict=True)],
                    "+.1f",
                    "%",
                    " to ",
                ),
            ]
        )
    return rows


def _ratio_rows(blocks: dict[str, list[float]]) -> list[list[str]]:
    rows = []
    for kind in CONFIGS:
        ms = statistics.median(blocks[kind]) * 1e3
        if kind == DDP:
            rows.append([kind, f"{ms:.3f}", "1 (by definition)", "", ""])
            continue
        ratios = pair_ratios(blocks[kind], blocks[DDP])
        over = [(a - b) * 1e3 for a, b in zip(blocks[kind], blocks[DDP], strict=True)]
        goal = GOALS.get(kind)
        if goal is None:
            verdict = ""
        else:
            med, q1, q3 = median_iqr(ratios)
            verdict = (f"{goal:.2f}: met" if med <= goal else f"{goal:.2f}: not met") + (
                " (whole middle half within)" if q3 <= goal else ""
            )
        rows.append(
            [kind, f"{ms:.3f}", fmt_iqr(ratios), fmt_iqr(over, "+.3f", sep=" to "), verdict]
        )
    return rows


def _calls(per_step: float) -> str:
    """Calls per step: tenths where there are few (a gather every 10 steps)."""
    return f"{per_step:.1f}" if 0 < per_step < 9.95 else f"{per_step:.0f}"


def _breakdown(res: dict[str, Any], steps: int) -> tuple[str, list[str]]:
    profiles = res["profiles"]
    timed = {k: statistics.median(res["blocks"][k]) * 1e3 for k in PROFILED}
    per = {
        k: {p: (s * 1e3 / steps, c / steps) for p, (s, c) in profiles[k]["phases"].items()}
        for k in PROFILED
    }
    walls = {k: profiles[k]["wall"] * 1e3 / steps for k in PROFILED}
    rows = []
    for phase in PHASES:
        got = [per[k].get(phase, (0.0, 0.0)) for k in PROFILED]
        if all(ms < 0.0005 and calls < 0.05 for ms, calls in got):
            continue
        d_ms, d_calls = got[0]
        rows.append(
            [
                phase,
                f"{d_ms:.3f}",
                f"{d_ms / walls[DEFAULT]:.1%}",
                _calls(d_calls),
                *(f"{ms:.3f} ({_calls(calls)})" for ms, calls in got[1:]),
            ]
        )
    own = {k: sum(ms for ms, _ in per[k].values()) for k in PROFILED}
    calls = {k: sum(c for _, c in per[k].values()) for k in PROFILED}
    rows.append(
        [
            "**profiled step** (wall; own times sum to)",
            f"{walls[DEFAULT]:.3f} ({own[DEFAULT]:.3f})",
            "100%",
            f"{calls[DEFAULT]:.0f}",
            *(f"{walls[k]:.3f} ({calls[k]:.0f})" for k in PROFILED[1:]),
        ]
    )
    rows.append(
        [
            "**timed step, unprofiled** (median block)",
            f"{timed[DEFAULT]:.3f}",
            "",
            "",
            *(f"{timed[k]:.3f}" for k in PROFILED[1:]),
        ]
    )
    header = [
        "phase",
        "default, ms/step",
        "share of the profiled step",
        "Python calls/step",
        "bare, ms/step (calls)",
        "bare, gate off, ms/step (calls)",
        "DDP, ms/step (calls)",
    ]

    def ms(kind: str, *phases: str) -> float:
        return sum(per[kind].get(p, (0.0, 0.0))[0] for p in phases)

    gs_ms = ms(DEFAULT, *GRADSYNC_PHASES)
    ranked = sorted(GRADSYNC_PHASES, key=lambda p: -ms(DEFAULT, p))
    others = sorted(profiles[DEFAULT]["other_files"].items(), key=lambda kv: -kv[1])
    collective = sorted(profiles[DEFAULT]["collective_python"].items(), key=lambda kv: -kv[1][0])
    notes = [
        f"gradsync's own phases (the first {len(GRADSYNC_PHASES)} rows) take "
        f"{gs_ms:.3f} ms of the default's profiled {walls[DEFAULT]:.3f} ms step "
        f"({gs_ms / walls[DEFAULT]:.0%}); the largest is {ranked[0]} "
        f"({ms(DEFAULT, ranked[0]):.3f} ms), then {ranked[1]} ({ms(DEFAULT, ranked[1]):.3f} ms) "
        f"and {ranked[2]} ({ms(DEFAULT, ranked[2]):.3f} ms).",
        "Other gradsync, by file (their own time, callees left out): "
        + ", ".join(f"`{f}` {s * 1e3 / steps:.3f} ms" for f, s in others[:5])
        + ".",
        f"Profiler ranges are in both: {ms(DEFAULT, RANGES):.3f} ms in the default step, "
        f"{ms(DDP, RANGES):.3f} ms in DDP's (its forward's and the optimizer's, which torch "
        "enters in Python).",
        "DDP's reducer runs in C++ inside autograd's `run_backward`: its bucket copies, its "
        "all-reduce's launch and wait are its autograd row. Autograd and collective together: "
        + ", ".join(f"{k} {ms(k, AUTOGRAD, COLLECTIVE):.3f} ms" for k in PROFILED)
        + ". The collective's Python (torch.distributed's wrappers, which gradsync calls and "
        "DDP's reducer does not), by own time in the default step: "
        + ", ".join(
            f"`{f}` {t * 1e3 / steps:.3f} ms ({c / steps:.1f} calls)"
            for f, (t, c) in collective[:4]
        )
        + ".",
        "Profiling stretches the step "
        + ", ".join(f"{k} {walls[k] / timed[k]:.1f}x" for k in PROFILED)
        + ": compare the columns by calls and by what DDP has no row for, not by profiled "
        "milliseconds.",
    ]
    return table(header, rows), notes


def _top(res: dict[str, Any], steps: int) -> str:
    rows = [
        [f"`{name}`", f"{s * 1e6 / steps:.1f}", f"{c / steps:.1f}", phase]
        for name, s, c, phase in res["profiles"][DEFAULT]["top"]
    ]
    return table(["function (default step)", "own us/step", "calls/step", "charged to"], rows)


def render(
    res: dict[str, Any], args: Any, command: str, loads: tuple[float, float], code: str
) -> str:
    steps = args.profile_steps
    breakdown, notes = _breakdown(res, steps)
    return (
        "## Host overhead per step against DDP (issue 44)\n\n"
        f"Command: `{command}` (repeats {args.repeats}, {args.steps} steps per block; profile "
        f"of {steps} steps), {code}. Machine: {machine()}. 1-minute load average "
        f"{loads[0]:.2f} at the start and {loads[1]:.2f} at the end (2 ranks on 2 cores: other "
        "work on the machine shows in the spread).\n\n"
        f"A {PARAMS:,}-parameter mlp, {PER_RANK} samples per rank, plain SGD, 2 ranks, gloo on "
        "loopback, 1 thread per rank: a step that is all host overhead. Each configuration is "
        "its own replica from the same seed in the same processes; blocks run interleaved, the "
        "order rotated by repeat. ms/step: the median block's mean. Ratios and differences: "
        "block by block against the DDP block of the same repeat, median (middle half). "
        "'bare': `telemetry=False, check_every=0, skip_nonfinite=False`; 'gate off': "
        "`between_steps_timeout_s=None`. "
        + (
            "A block of 100 steps holds one divergence check and ten telemetry gathers, as the "
            "defaults run them.\n\n"
            if args.steps == 100
            else f"Blocks of {args.steps} steps (the defaults check the replicas every 100 "
            "steps and gather telemetry every 10).\n\n"
        )
        + table(
            ["configuration", "ms/step", "/ DDP (middle half)", "- DDP, ms (middle half)", "goal"],
            _ratio_rows(res["blocks"]),
        )
        + "\n\nWhat each feature costs, timed: the same blocks, one configuration against the "
        "one without the feature in the same repeat, median (middle half).\n\n"
        + table(
            ["feature", "ratio", "difference, ms/step", "difference, share of DDP's step"],
            _difference_rows(res["blocks"]),
        )
        + "\n\nWhere a step's time goes: cProfile on both ranks, rank 0's profile, each "
        "function's own time put in a phase by the file it is in, built-in and other "
        "functions by their callers (this module's docstring: how, and the limits; cProfile "
        "inflates Python calls, so the gradsync rows are upper bounds and the calls per step "
        "are the exact figure).\n\n"
        + breakdown
        + "\n\n"
        + "\n".join(f"- {n}" for n in notes)
        + "\n\nThe functions of most own time in the default step (profiled):\n\n"
        + _top(res, steps)
        + "\n"
    )


def revision() -> str:
    """The commit the run measured, and whether gradsync/ differed from it (the hot path is
    being changed as this is measured: a table says which code it is of)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.rstrip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "gradsync outside a git checkout"
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "gradsync").splitlines()]
    if not dirty:
        return f"gradsync at commit {head}"
    named = ", ".join(f"`{p}`" for p in dirty[:3]) + (", ..." if len(dirty) > 3 else "")
    return f"gradsync at commit {head} with uncommitted changes to {named}"


def main() -> None:
    h = Harness("benchmarks.host_overhead", __doc__, repeats=51)
    h.parser.add_argument("--steps", type=int, default=100, help="steps per block")
    h.parser.add_argument(
        "--profile-steps", type=int, default=300, help="steps cProfile covers per configuration"
    )
    args = h.parse(repeats=2, steps=10, profile_steps=20)
    start, code = os.getloadavg()[0], revision()
    job = {"repeats": args.repeats, "steps": args.steps, "profile_steps": args.profile_steps}
    results = launch(worker, (job,), nproc=2)
    end = os.getloadavg()[0]
    h.finish(render(results[0], args, h.command(), (start, end), code))


if __name__ == "__main__":
    main()
