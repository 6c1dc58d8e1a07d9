"""The flags of ``gradsync simulate`` and ``gradsync bench allreduce``, declared once; turning
them into the simulator's inputs; printing results.

The flags are the fields of :class:`SimulateOptions` and :class:`BenchOptions` (gradsync.flags
builds the parsers from them, as ``run``'s from RunConfig): a new field with :func:`flag` is a
new flag. Shared by the argument parsing in ``gradsync.sim.cli`` and the modes in
``gradsync.sim.commands``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from typing import Any, Protocol

from gradsync.errors import UsageError
from gradsync.flags import flag, option_of
from gradsync.sim.config import ALLREDUCE_CHOICES, CommModel, ComputeModel, Hosts, SimStrategy
from gradsync.sim.failures import (
    CHECKPOINT_EVERY,
    GROUP_GPUS,
    HEAL_S,
    LLAMA3,
    MAX_GPUS,
    RESTART_S,
    STALL_S,
    STEP_S,
    FailureCosts,
)
from gradsync.sim.gate import StoreGate, check_group_size
from gradsync.sim.model import ALGORITHMS, AlphaBeta
from gradsync.sim.simulate import Overlap

DEFAULT_SWEEP_STRATEGIES = "bsp,zero:1,zero:2,ssp:4,async,local:8"
#: one simulation's strategy when --strategy is not given
DEFAULT_STRATEGY = "bsp"

# The help groups of `gradsync simulate --help`, in the order the fields below first name them.
WORKERS = "workers and compute"
COMM = "communication (fixed, or alpha-beta for a message)"
HOSTS = "hosts (as gradsync run --hosts H --allreduce KIND; alpha-beta model only)"
STRATEGY = "strategy and output"
PREDICTION = "calibrated prediction from a real run"
FAILURES = "goodput under failures (--failures; defaults: gradsync's own measurements)"

#: The fields that price failures: they mean something with ``--failures`` only.
FAILURE_FIELDS = (
    "gpus",
    "failure_rate",
    "step_s",
    "checkpoint_every",
    "restart_s",
    "stall_s",
    "heal_s",
    "group_gpus",
)
DEFAULT_GPUS = "1024,16384,100000"
#: The fields ``--from`` reads: the run, its what-ifs, the link that prices its all-reduce,
#: the resampling. The step simulation's others (--compute, --jitter, --steps, ...) describe
#: what ``--from`` takes from the run, and are refused with it rather than ignored.
FROM_RUN_FIELDS = (
    "from_run",
    "workers",
    "strategy",
    "remove_straggler",
    "compression_ratio",
    "calibration",
    "algorithm",
    "alpha_us",
    "link_gbps",
    "warmup",
    "resample",
    "seed",
    "json",
)
#: the strategies whose step gate ``--gate-store-rate`` prices
GATED = ("bsp", "zero")


@dataclasses.dataclass(slots=True, kw_only=True)
class SimulateOptions:
    """The flags of ``gradsync simulate``; the checks that need no simulation are made here."""

    workers: int | None = flag(
        None,
        help="workers (default: one per --compute value, 4 for a single value)",
        group=WORKERS,
    )
    steps: int = flag(100, help="steps per worker (default 100)", group=WORKERS)
    compute: str = flag("20", help="base ms per step: one value or one per worker", group=WORKERS)
    jitter: float = flag(0.0, help="uniform jitter in [-J, J] ms", group=WORKERS)
    straggler: list[str] = flag(
        factory=list,
        metavar="RANK:FACTOR",
        help="persistent straggler: multiply RANK's base compute (repeatable)",
        group=WORKERS,
    )
    transient: str | None = flag(
        None,
        metavar="P:FACTOR",
        help="each worker-step slows by FACTOR with probability P",
        group=WORKERS,
    )
    seed: int = flag(0, help="seed of random.Random for the jitter", group=WORKERS)
    comm_ms: float | None = flag(None, help="fixed ms per exchange", group=COMM)
    message_mb: float | None = flag(None, help="gradient size in MiB", group=COMM)
    alpha_us: float | None = flag(None, help="latency per message, us (20)", group=COMM)
    link_gbps: float | None = flag(None, help="link bandwidth, Gbit/s (10)", group=COMM)
    algorithm: str | None = flag(None, choices=ALGORITHMS, help="all-reduce algorithm", group=COMM)
    calibration: str | None = flag(None, help="alpha/beta JSON from bench allreduce", group=COMM)
    gate_store_rate: float | None = flag(
        None,
        metavar="REQ_PER_S",
        help="price the step gate (bsp, zero:N): each of its stores serving REQ_PER_S requests "
        "a second, two per rank per step, the world's store also a heartbeat per rank per "
        "second (benchmarks.gate measures the rate; default: not priced)",
        group=COMM,
    )
    gate_rtt_ms: float = flag(0.1, help="the gate's store round trip, ms (0.1)", group=COMM)
    gate_group_size: int | None = flag(
        None,
        metavar="G",
        help="the gate's ranks counted in groups of G, each at a store of its own, as "
        "Limits(gate_group_size=G); G >= the workers is flat (default: automatic, as the "
        "runtime: flat below 64 ranks, else about the square root of the ranks)",
        group=COMM,
    )
    compression_ratio: float = flag(
        1.0,
        help="a compressor's: each exchange carries bytes / R (int4 about 7.5, int8 about 4; "
        "not zero:N's collectives); with --from, the what-if",
        group=COMM,
    )
    hosts: int | None = flag(
        None,
        metavar="H",
        help="spread the workers evenly over H hosts; --link-gbps and --alpha-us are then the "
        "link between hosts (default: one link, no hosts)",
        group=HOSTS,
    )
    allreduce: str = flag(
        "ring",
        choices=ALLREDUCE_CHOICES,
        help="ring: one flat ring over every rank, paced by the slower link; hierarchical: "
        "reduce in each host, all-reduce among one leader per host, broadcast back (bsp, "
        "zero:1, local:H, diloco:H), shown beside ring (default ring)",
        group=HOSTS,
    )
    intra_gbps: float | None = flag(None, help="bandwidth inside a host, Gbit/s (100)", group=HOSTS)
    intra_alpha_us: float | None = flag(None, help="latency inside a host, us (5)", group=HOSTS)
    # None: not given (bsp for one simulation; with --from, the run's own), so that an explicit
    # --strategy bsp is a what-if of --from and refused with a sweep, as any other value
    strategy: str | None = flag(
        None,
        help="bsp | zero:1 | zero:2 | zero:3 | ssp:S | async | local:H | "
        "diloco:H[:F[:TAU[:ALPHA]|:eager][:SPLIT]] | hogwild | gossip:H | noloco:H (default "
        "bsp; with --from, the run's own)",
        group=STRATEGY,
    )
    layers: str | None = flag(
        None,
        metavar="LIST",
        help="sizes of the model's layers in module order (any unit), for streaming DiLoCo's "
        "fragments under the layers split (diloco:H:F:TAU:ALPHA:layers; layer i in fragment "
        "i %% F); the default rows split cuts every layer F ways, and without --layers too "
        "each fragment carries 1/F of the bytes",
        group=STRATEGY,
    )
    overlap: bool = flag(False, help="BSP (or zero:1) with bucketed overlap", group=STRATEGY)
    backward_frac: float = flag(
        2 / 3,
        help="share of compute that is the backward pass (default 0.667)",
        group=STRATEGY,
    )
    buckets: int = flag(4, help="gradient buckets for --overlap", group=STRATEGY)
    sweep_staleness: str | None = flag(
        None, metavar="LIST", help="e.g. 0,1,2,4,8,inf", group=STRATEGY
    )
    sweep_workers: str | None = flag(None, metavar="LIST", help="e.g. 8,16,64,1024", group=STRATEGY)
    strategies: str = flag(
        DEFAULT_SWEEP_STRATEGIES,
        help=f"strategies for --sweep-workers (default {DEFAULT_SWEEP_STRATEGIES})",
        group=STRATEGY,
    )
    plot_dir: str | None = flag(
        None,
        metavar="DIR",
        help="where sweep PNGs go, made if missing (default: a new directory under the system's "
        "temporary directory; the PNGs' paths are printed)",
        group=STRATEGY,
    )
    table_steps: int = flag(20, help="rows of the BSP step table", group=STRATEGY)
    json: bool = flag(False, help="machine-readable output", group=STRATEGY)
    from_run: str | None = flag(
        None,
        option="--from",
        metavar="RUN_DIR",
        help="predict this run from its telemetry",
        group=PREDICTION,
    )
    remove_straggler: bool = flag(False, help="what-if: slowest rank fixed", group=PREDICTION)
    warmup: int = flag(2, help="steps of the run to skip (default 2)", group=PREDICTION)
    resample: str = flag(
        "steps",
        choices=("steps", "ranks"),
        help="draw whole measured steps (keeps cross-rank correlation; default) or each "
        "rank's compute independently",
        group=PREDICTION,
    )
    failures: bool = flag(
        False,
        help="goodput of restart-from-checkpoint against live membership under failures, at "
        "each of --gpus (docs/simulator.md, Goodput under failures)",
        group=FAILURES,
    )
    gpus: str | None = flag(
        None, metavar="LIST", help=f"cluster sizes (default {DEFAULT_GPUS})", group=FAILURES
    )
    failure_rate: float | None = flag(
        None,
        metavar="PER_GPU_HOUR",
        help=f"failures a GPU-hour (default: Llama 3's {LLAMA3.interruptions} unexpected "
        f"interruptions in {LLAMA3.days:g} days on {LLAMA3.gpus:,} GPUs, {LLAMA3.rate:.4g})",
        group=FAILURES,
    )
    step_s: float | None = flag(
        None, help=f"seconds a training step (default {STEP_S:g}: RELIABILITY.md)", group=FAILURES
    )
    checkpoint_every: int | None = flag(
        None,
        metavar="N",
        help="steps between committed checkpoints, restart's rollback (default "
        f"{CHECKPOINT_EVERY})",
        group=FAILURES,
    )
    restart_s: float | None = flag(
        None,
        help="restart from checkpoint: seconds from a death to the whole group training again "
        f"(default {RESTART_S:g}: gradsync's forked restart of a small model, a floor; minutes "
        "at scale)",
        group=FAILURES,
    )
    stall_s: float | None = flag(
        None,
        help=f"live membership: seconds the survivors stall per failure (default {STALL_S:g}, "
        "measured: torchft's 2 s heartbeat timeout)",
        group=FAILURES,
    )
    heal_s: float | None = flag(
        None,
        help="live membership: seconds from a death to the lost group training again, relaunch "
        f"and healing from a peer (default {HEAL_S:g}, measured)",
        group=FAILURES,
    )
    group_gpus: int | None = flag(
        None,
        metavar="G",
        help=f"live membership: GPUs a failure takes out, one replica group (default {GROUP_GPUS})",
        group=FAILURES,
    )

    def __post_init__(self) -> None:
        if self.table_steps < 0:
            raise UsageError(f"--table-steps must be >= 0, got {self.table_steps}")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be >= 0 steps, got {self.warmup}")
        # argparse's type=float takes 'nan' and 'inf'; no flag here means anything by them.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                flag_name = option_of(SimulateOptions, f.name)
                raise UsageError(f"{flag_name} must be a finite number, got {value}")
        # checked whether or not they are used: a bad value is refused, not carried
        if self.gate_rtt_ms < 0:
            raise UsageError(
                f"--gate-rtt-ms must be a finite number of ms >= 0, got {self.gate_rtt_ms}"
            )
        if self.gate_store_rate is not None and self.gate_store_rate <= 0:
            raise UsageError(
                "--gate-store-rate must be a finite number of requests per second > 0, got "
                f"{self.gate_store_rate}"
            )
        if self.gate_store_rate is None and self.gate_rtt_ms != _default_of("gate_rtt_ms"):
            raise UsageError(
                f"--gate-rtt-ms {self.gate_rtt_ms} is the step gate's store round trip, priced "
                "only with --gate-store-rate REQ_PER_S: give it too, or drop --gate-rtt-ms"
            )
        check_group_size(self.gate_group_size)
        if self.gate_store_rate is None and self.gate_group_size is not None:
            raise UsageError(
                f"--gate-group-size {self.gate_group_size} is how the step gate counts its "
                "ranks, priced only with --gate-store-rate REQ_PER_S: give it too, or drop "
                "--gate-group-size"
            )
        for name in ("sweep_staleness", "sweep_workers"):
            text = getattr(self, name)
            if text is not None and not all(item.strip() for item in text.split(",")):
                what = "has an empty item" if text.strip(" ,") else "names nothing"
                example = "0,1,2,4,8,inf" if name == "sweep_staleness" else "8,16,64,1024"
                raise UsageError(
                    f"{option_of(SimulateOptions, name)} {text!r} {what}: give comma-separated "
                    f"values, e.g. {example}"
                )
        self._check_failures_mode()
        self._check_sweeps()
        if self.from_run:
            self._check_from_run()

    def _check_from_run(self) -> None:
        """``--from`` predicts a run from its telemetry: the flags that describe a simulated
        run (its compute, its link's message, hosts, overlap, the gate, the output of one
        simulation) are refused with it rather than ignored."""
        extra = [
            name
            for name, given in (
                ("--hosts", self.hosts is not None),
                ("--layers", self.layers is not None),
                ("--allreduce hierarchical", self.allreduce != "ring"),
            )
            if given
        ]
        named = {"hosts", "layers", "allreduce"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in FROM_RUN_FIELDS or f.name in named or value == _default(f):
                continue
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            given = option_of(SimulateOptions, f.name)
            extra.append(given if isinstance(value, bool) else f"{given} {shown}")
        if extra:
            raise UsageError(
                f"{', '.join(extra)} apply to a simulation, not to --from's prediction of a "
                "run, which takes each rank's compute and comm, the steps and the bytes from "
                f"the run's telemetry; --from takes "
                f"{', '.join(option_of(SimulateOptions, n) for n in FROM_RUN_FIELDS[1:])}: "
                "drop them, or simulate without --from"
            )

    def _check_sweeps(self) -> None:
        """The flags one mode reads and the others would silently ignore: --strategies is
        the workers sweep's, --strategy one simulation's (or --from's), and --from predicts
        one run rather than sweeping."""
        sweeps = [
            flag
            for flag, given in (
                (f"--sweep-staleness {self.sweep_staleness}", self.sweep_staleness),
                (f"--sweep-workers {self.sweep_workers}", self.sweep_workers),
            )
            if given
        ]
        if self.from_run and sweeps:
            raise UsageError(
                f"{' and '.join(sweeps)} sweep(s) simulations; --from predicts the one run "
                f"{self.from_run}: give one or the other"
            )
        if sweeps and self.strategy is not None:
            raise UsageError(
                f"--strategy {self.strategy} is for one simulation; the sweeps take their own "
                "(--sweep-staleness runs ssp:S at each S, --sweep-workers runs --strategies): "
                f"drop --strategy, or give --sweep-workers with --strategies {self.strategy}"
            )
        if self.strategies == DEFAULT_SWEEP_STRATEGIES:
            return
        if not self.sweep_workers:
            raise UsageError(
                f"--strategies {self.strategies!r} lists the strategies of --sweep-workers: "
                "give --sweep-workers too, or --strategy S for one simulation"
            )
        items = [s.strip() for s in self.strategies.split(",")]
        if not all(items):
            what = "has an empty item" if any(items) else "names no strategy"
            raise UsageError(
                f"--strategies {self.strategies!r} {what}: give comma-separated "
                f"strategy specs, e.g. {DEFAULT_SWEEP_STRATEGIES}"
            )

    def _check_failures_mode(self) -> None:
        """``--failures`` is a mode of its own: its flags are refused without it, and the
        step simulation's with it, rather than ignored."""
        given = [
            option_of(SimulateOptions, n) for n in FAILURE_FIELDS if getattr(self, n) is not None
        ]
        if given and not self.failures:
            raise UsageError(f"{', '.join(given)} price(s) failures: give --failures too")
        if not self.failures:
            return
        own = {*FAILURE_FIELDS, "failures", "json"}
        others = [
            option_of(SimulateOptions, f.name)
            for f in dataclasses.fields(self)
            if f.name not in own and getattr(self, f.name) != _default(f)
        ]
        if others:
            raise UsageError(
                f"{', '.join(others)} apply to the step simulation, not to --failures (whose "
                f"flags are {', '.join(option_of(SimulateOptions, n) for n in FAILURE_FIELDS)}); "
                "drop them"
            )


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _default_of(name: str) -> Any:
    return next(_default(f) for f in dataclasses.fields(SimulateOptions) if f.name == name)


def check_gate(args: SimulateOptions, strategies: list[SimStrategy], what: str) -> None:
    """``UsageError`` for ``--gate-store-rate`` where none of ``strategies`` (what ``what``
    simulates) has the step gate it prices (bsp, zero:N), rather than ignoring it."""
    if args.gate_store_rate is None or any(s.kind in GATED for s in strategies):
        return
    raise UsageError(
        f"--gate-store-rate {args.gate_store_rate:g} prices the step gate of bsp and zero:N; "
        f"{what} has none: drop --gate-store-rate, or simulate bsp or zero:1, zero:2, zero:3"
    )


#: the name of ``bench allreduce``'s calibration file when ``--out`` is not given
CALIBRATION_FILE = "allreduce_calibration.json"


@dataclasses.dataclass(slots=True, kw_only=True)
class BenchOptions:
    """The flags of ``gradsync bench allreduce``."""

    nproc: int = flag(2, help="ranks (default 2)")
    sizes: str | None = flag(
        None,
        help="bytes, comma-separated, each a positive multiple of 4 (float32 values); K/M "
        "suffixes ok (default 4K..64M in x4 steps)",
    )
    repeats: int = flag(20, help="timed repeats per size (default 20)")
    out: str | None = flag(
        None,
        metavar="FILE",
        help="where the fit goes, its directory made if missing (default: "
        f"{CALIBRATION_FILE} in a new directory under the system's temporary directory; the "
        "path is printed)",
    )
    json: bool = flag(False, help="machine-readable output")


class _Output(Protocol):
    json: bool


def parse_floats(text: str, flag: str) -> list[float]:
    items = text.split(",")
    if not any(x.strip() for x in items):
        raise UsageError(f"{flag} needs at least one number, got {text!r}")
    if not all(x.strip() for x in items):
        # "20,,20" ran as 2 workers, not 3 nor a refusal
        raise UsageError(
            f"{flag} {text!r} has an empty item: give comma-separated numbers, e.g. 20,22,21,38"
        )
    try:
        return [float(x) for x in items]
    except ValueError:
        raise UsageError(f"{flag} needs comma-separated numbers, got {text!r}") from None


def parse_pair(text: str, flag: str) -> tuple[float, float]:
    head, sep, tail = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return float(head), float(tail)
    except ValueError:
        raise UsageError(f"{flag} needs A:B (e.g. 3:2.0), got {text!r}") from None


def parse_straggler(text: str) -> tuple[int, float]:
    head, sep, _ = text.partition(":")
    try:
        rank = int(head)
    except ValueError:
        rank = None
    if rank is None or not sep:
        raise UsageError(
            f"--straggler needs RANK:FACTOR with an integer rank (e.g. 3:2.0), got {text!r}"
        )
    return rank, parse_pair(text, "--straggler")[1]


def compute_model(args: SimulateOptions) -> ComputeModel:
    base = parse_floats(args.compute, "--compute")
    if args.workers is not None and args.workers < 1:
        # Checked here, not left to "or": 0 would otherwise fall back to the default silently.
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    workers = args.workers or (len(base) if len(base) > 1 else 4)
    if len(base) > 1 and len(base) != workers and not args.sweep_workers:
        raise UsageError(
            f"--compute has {len(base)} values but --workers is {workers}; "
            "give one value per worker or a single value"
        )
    stragglers = tuple(parse_straggler(s) for s in args.straggler)
    prob, factor = parse_pair(args.transient, "--transient") if args.transient else (0.0, 1.0)
    return ComputeModel(
        workers=workers,
        steps=args.steps,
        base_ms=tuple(base),
        jitter_ms=args.jitter,
        stragglers=stragglers,
        transient_prob=prob,
        transient_factor=factor,
        seed=args.seed,
    )


# The link flags' ranges: past them a step costs days or a float overflows (--link-gbps 1e-300
# printed a wall-clock of 300 digits).
#: --link-gbps and --intra-gbps: 1 Mbit/s to 1 Pbit/s
GBPS_RANGE = (1e-3, 1e6)
#: --alpha-us and --intra-alpha-us: up to a second
ALPHA_US_RANGE = (0.0, 1e6)
#: --message-mb: up to a TiB
MESSAGE_MB_RANGE = (0.0, 1e6)


def check_range(name: str, value: float, low: float, high: float, unit: str) -> None:
    """``UsageError`` naming the flag, its value and its range unless low <= value <= high
    (nan included: it fails every comparison)."""
    if not low <= value <= high:
        raise UsageError(
            f"{name} must be a finite number from {low:g} to {high:g} {unit}, got {value}"
        )


def link_from_args(args: SimulateOptions) -> AlphaBeta | None:
    given = [args.alpha_us, args.link_gbps, args.algorithm]
    if args.calibration:
        from gradsync.sim.calibrate import load_calibration

        link = load_calibration(args.calibration)
        if args.algorithm:
            link = AlphaBeta(alpha=link.alpha, beta=link.beta, algorithm=args.algorithm)
        return link
    if args.message_mb is None and all(v is None for v in given):
        return None
    gbps = 10.0 if args.link_gbps is None else args.link_gbps
    check_range("--link-gbps", gbps, *GBPS_RANGE, "Gbit/s")
    alpha_us = 20.0 if args.alpha_us is None else args.alpha_us
    check_range("--alpha-us", alpha_us, *ALPHA_US_RANGE, "us")
    return AlphaBeta(
        alpha=alpha_us * 1e-6, beta=8.0 / (gbps * 1e9), algorithm=args.algorithm or "ring"
    )


def comm_model(args: SimulateOptions) -> CommModel:
    link = link_from_args(args)
    ratio = args.compression_ratio
    hosts = hosts_from_args(args)
    gate = gate_from_args(args)
    if link is None:
        fixed = 0.0 if args.comm_ms is None else args.comm_ms
        return CommModel(comm_ms=fixed, ratio=ratio, hosts=hosts, gate=gate)
    if args.comm_ms is not None:
        raise UsageError(
            "--comm-ms is a fixed cost; it cannot be combined with the alpha-beta "
            "flags (--message-mb, --alpha-us, --link-gbps, --algorithm, "
            "--calibration)"
        )
    if args.message_mb is None:
        raise UsageError("the alpha-beta model needs --message-mb (gradient size in MiB, >= 0)")
    check_range("--message-mb", args.message_mb, *MESSAGE_MB_RANGE, "MiB")
    return CommModel(link=link, nbytes=args.message_mb * 2**20, ratio=ratio, hosts=hosts, gate=gate)


def gate_from_args(args: SimulateOptions) -> StoreGate | None:
    """``--gate-store-rate``: the step gate's store; None (not priced) without it."""
    if args.gate_store_rate is None:
        return None
    return StoreGate(
        store_rate=args.gate_store_rate, rtt_ms=args.gate_rtt_ms, group_size=args.gate_group_size
    )


def parse_gpus(text: str | None) -> list[int]:
    """``--gpus``: the cluster sizes of ``--failures``."""
    items = (DEFAULT_GPUS if text is None else text).split(",")
    counts = []
    for item in items:
        try:
            n = int(item.strip())
        except ValueError:
            n = 0
        if not 1 <= n <= MAX_GPUS:
            raise UsageError(
                f"--gpus takes whole numbers of GPUs from 1 to {MAX_GPUS:,}, comma-separated "
                f"(e.g. {DEFAULT_GPUS}), got {item.strip()!r}"
            )
        counts.append(n)
    return counts


def failure_costs_from_args(args: SimulateOptions) -> FailureCosts:
    """``--failures``' costs: each flag given, else gradsync's measured default."""
    given = {n: getattr(args, n) for n in FAILURE_FIELDS if n != "gpus"}
    return FailureCosts(**{n: v for n, v in given.items() if v is not None})


# The defaults of the path inside a host: ten times the default link between hosts, and a
# quarter of its latency (shared memory or a PCIe/NVLink hop, against a network round trip).
INTRA_GBPS, INTRA_ALPHA_US = 100.0, 5.0


def hosts_from_args(args: SimulateOptions) -> Hosts | None:
    """``--hosts H`` with ``--allreduce`` and the intra-host link; None without ``--hosts``,
    where the flags that only mean something on hosts are refused rather than ignored."""
    if args.hosts is None:
        given = [
            f
            for f, v in (
                ("--intra-gbps", args.intra_gbps),
                ("--intra-alpha-us", args.intra_alpha_us),
            )
            if v is not None
        ]
        if args.allreduce == "hierarchical":
            given.insert(0, "--allreduce hierarchical")
        if given:
            raise UsageError(
                f"{', '.join(given)} describe(s) hosts: give --hosts H too (the --workers are "
                "spread evenly over H hosts; --link-gbps is then the link between hosts)"
            )
        return None
    gbps = INTRA_GBPS if args.intra_gbps is None else args.intra_gbps
    check_range("--intra-gbps", gbps, *GBPS_RANGE, "Gbit/s")
    alpha_us = INTRA_ALPHA_US if args.intra_alpha_us is None else args.intra_alpha_us
    check_range("--intra-alpha-us", alpha_us, *ALPHA_US_RANGE, "us")
    algorithm = args.algorithm or "ring"
    intra = AlphaBeta(alpha=alpha_us * 1e-6, beta=8.0 / (gbps * 1e9), algorithm=algorithm)
    return Hosts(hosts=args.hosts, intra=intra, allreduce=args.allreduce)


def layers_from_args(args: SimulateOptions) -> list[float] | None:
    """``--layers``: the model's layer sizes, for streaming DiLoCo's fragments."""
    return None if args.layers is None else parse_floats(args.layers, "--layers")


def overlap_from_args(args: SimulateOptions) -> Overlap:
    return Overlap(backward_frac=args.backward_frac, buckets=args.buckets)


def emit(args: _Output, doc: dict[str, Any], text: str) -> None:
    if args.json:
        json.dump(_jsonable(doc), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(text)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x
