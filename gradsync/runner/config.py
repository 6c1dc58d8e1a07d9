"""``RunConfig``: everything ``gradsync run`` needs, validated before any process starts.

Its fields are also the declaration of the flags of ``gradsync run`` and ``gradsync compare``
(gradsync.flags builds the parser from them): a new field with :func:`flag` is a new flag, with
its default and help, and a field without one is set by code only. The flags that set the
Synchronizer's options (``--bucket-mb``, ``--allreduce``, ``--balance``, ``--timeout``,
``--check-every``) are declared on those options' fields (``gradsync.options``) and taken here
with :func:`gradsync.flags.flag_from`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pkgutil
import re
import sys
import time
import warnings
from collections import Counter
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from gradsync.attached_run import add_facts
from gradsync.bucket_autotune import AUTO
from gradsync.compression import Compressor, parse_compression
from gradsync.errors import UsageError
from gradsync.flags import flag, flag_from
from gradsync.inject import parse_kill, parse_slow
from gradsync.membership import (
    LIVE_STRATEGIES,
    check_exchange,
    check_lighthouse,
    runs_live,
    torchft_missing,
)
from gradsync.membership.lighthouse import HEARTBEAT_TIMEOUT_RANGE_S, HEARTBEAT_TIMEOUT_S
from gradsync.options import DEFAULT_TIMEOUT_S, Checks, Exchange, Limits
from gradsync.runner.rundir import OVERWRITE_AND_RESUME
from gradsync.runner.workload_flags import WORKLOAD_ONLY
from gradsync.runtime import BACKENDS, check_nccl, choose_backend
from gradsync.spec import parse_strategy_spec
from gradsync.strategies.factory import (
    check_compression,
    check_compressor,
    parse_strategy,
    uses_servers,
)
from gradsync.strategies.streaming import SPLITS, fragment_tensors
from gradsync.strategies.zero_shards import OwnerLayout
from gradsync.telemetry.stragglers import StragglerConfig
from gradsync.topology import check_allreduce, check_hierarchical
from gradsync.workloads import (
    SIZED_BY_PARAMS,
    WORKLOADS,
    make_workload,
    physical_memory,
    step_bytes,
)
from gradsync.workloads.data import check_data_file

MAX_TIMEOUT_S = 7 * 24 * 3600.0
DEFAULT_LINK = "1gbit"
MIN_TIMEOUT_S = 1.0  # below it no collective of a real job completes before its own timeout
MAX_LOCAL_PROCESSES = 256
MAX_PARAMS = 1_000_000_000
#: --threads per CPU of this machine at most: beyond a few per CPU, threads only queue (and
#: 100000 of them fail the workers' start with a worker failure, not a usage error)
MAX_THREADS_PER_CPU = 4
#: above any learning rate that trains (SGD's and AdamW's sensible ones are below 10); far
#: larger ones overflow float32 parameters in the first update instead (3.4e38 and up)
MAX_LR = 1e6


def is_source_file(path: str) -> bool:
    """Whether ``runpy.run_path`` would compile ``path`` as source: a file that is no
    import path entry (a zip archive is one) and is not compiled bytecode."""
    if not os.path.isfile(path) or pkgutil.get_importer(path) is not None:
        return False
    with open(path, "rb") as f:
        return f.read(len(importlib.util.MAGIC_NUMBER)) != importlib.util.MAGIC_NUMBER


def _check_compiles(script: Path) -> None:
    """A script with a syntax error, refused before any process starts: found by the workers,
    it failed every rank, once more per --max-restart, and left a config.json behind that
    made the rerun of the fixed script need --overwrite (a tester's finding). Only for a
    source file (``is_source_file``): runpy runs a zip archive or compiled file itself."""
    try:
        source = script.read_bytes()
    except OSError as exc:
        raise UsageError(f"gradsync run -- {script}: cannot be read ({exc.strerror})") from None
    try:
        compile(source, str(script), "exec", dont_inherit=True)
    except SyntaxError as exc:
        # no line for some (a null byte, on Python 3.11: "source code cannot contain null
        # bytes"), which name the whole file
        where = ""
        if exc.lineno is not None:
            column = f", column {exc.offset}" if exc.offset else ""
            where = f" (line {exc.lineno}{column})"
        raise UsageError(f"gradsync run -- {script}: {exc.msg}{where}") from None
    except ValueError:  # null bytes, on versions that raise this: runpy will say as much
        return


def workload_flags_refused(given: list[str]) -> UsageError:
    """The refusal of built-in workload flags (``WORKLOAD_ONLY`` names, ``given``) beside a
    script: the script trains its own model on its own data, so they would do nothing."""
    options = ", ".join("--" + name.replace("_", "-") for name in given)
    one = len(given) == 1
    return UsageError(
        f"{options} {'sets' if one else 'set'} the built-in workloads, not a script's "
        f"training: set {'it' if one else 'them'} in the script (its model, data, "
        f"optimizer and gs.Synchronizer call) and drop {'it' if one else 'them'} here"
    )


# The help groups of `gradsync run --help`, in the order the fields below first name them.
TRAINING = "training"
SYNC = "synchronization"
STRAGGLERS = "stragglers"
FAULTS = "fault tolerance"
LIVE = "live membership (torchft)"
CLUSTER = "emulated cluster"
OUTPUT = "output"


def default_out() -> str:
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


#: the warnings the checks of a RunConfig said in this process, by their text: each once
_SAID: set[str] = set()
#: whether they are printed: not in a rank, whose command printed them before starting it
_PRINTED = [True]


def said_by_the_command() -> None:
    """In a rank of ``gradsync run``/``compare``: the warnings a RunConfig's checks give
    (``--compress randomk:0.05``'s) were printed by the command, which checked the same
    config before it started the rank; the rank prints them again neither at its own check nor
    where its Synchronizer builds the same compressor."""
    _PRINTED[0] = False


def checked_compression(spec: str | None) -> Compressor:
    """``parse_compression(spec)``, its warnings (a ``randomk`` fraction below 0.1) said as
    the command's other warnings are, one ``gradsync: warning: ...`` line, once per process,
    where Python's format added the source line of gradsync's own ``warnings.warn`` call, and
    the CLI and each rank printed it (three times under ``--nproc 2``). Once said, the same
    warning raised later in the process (``--resume``'s check, the rank's Synchronizer) is
    ignored. Warnings not of gradsync's own code go on as Python shows them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compressor = parse_compression(spec)
    for w in caught:
        if not w.filename.startswith(_PACKAGE):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            continue
        text = str(w.message)
        if text not in _SAID:
            _SAID.add(text)
            if _PRINTED[0]:
                print(f"gradsync: warning: {text}", file=sys.stderr)
        warnings.filterwarnings("ignore", message=re.escape(text), category=w.category)
    return compressor


_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep


@dataclass(slots=True, kw_only=True)
class RunConfig:
    """Every help names its default (the README's `gradsync run` reference lists each flag)."""

    nproc: int = flag(
        4,
        metavar="N",
        help="worker processes (default: %(default)s; with --resume: the saved run's)",
        group=TRAINING,
    )
    workload: str = flag("charlm", help="charlm | mlp (default: %(default)s)", group=TRAINING)
    steps: int = flag(200, help="training steps (default: %(default)s)", group=TRAINING)
    batch_size: int = flag(
        16, metavar="B", help="samples per worker per step (default: %(default)s)", group=TRAINING
    )
    lr: float | None = flag(
        None, help="learning rate (default: the workload's own)", group=TRAINING
    )
    micro_batches: int = flag(
        1,
        metavar="K",
        help="backward passes per step; must divide --batch-size (default: %(default)s)",
        group=TRAINING,
    )
    seed: int = flag(
        0,
        help="seed of the model's initialisation and the data order (default: %(default)s)",
        group=TRAINING,
    )
    threads: int = flag(
        1, metavar="T", help="intra-op threads per rank (default: %(default)s)", group=TRAINING
    )
    backend: str = flag(
        "auto",
        metavar="NAME",
        help="auto (NCCL with the model on the GPU where each process gets a GPU of its own, "
        "else gloo on the CPU) | gloo | nccl (default: %(default)s)",
        group=TRAINING,
    )
    data: str | None = flag(
        None,
        metavar="FILE",
        help="text file for charlm (default: a sample of the standard library's sources)",
        group=TRAINING,
    )
    params: int = flag(
        100_000,
        metavar="N",
        help="parameter count of the mlp workload's model (mlp only; default: %(default)s)",
        group=TRAINING,
    )
    strategy: str = flag(
        "bsp",
        metavar="SPEC",
        help="bsp | zero:N (N 1-3) | local:H | "
        "diloco:H[:F[:TAU[:ALPHA]|:eager][:SPLIT]][:outer_lr=X][:outer_momentum=M] | ssp:S | "
        "async | hogwild | gossip:H | noloco:H[:outer_lr=X][:outer_momentum=M] "
        "(default: %(default)s)",
        group=SYNC,
    )
    servers: int = flag(
        1,
        metavar="K",
        help="parameter servers for ssp:S and async (default: %(default)s)",
        group=SYNC,
    )
    compression: str | None = flag(
        None,
        option="--compress",
        metavar="SPEC",
        help="fp16 | bf16 | int8 | int4 | topk:F | randomk:F | sign | powersgd:R | "
        "sparseloco[:D[:C[:B]]] (local:H, diloco:H) (default: none)",
        group=SYNC,
    )
    # The Synchronizer's options: each flag is declared on its field in gradsync.options.
    bucket_mb: float | str | None = flag_from(Exchange, "bucket_mb", group=SYNC)
    allreduce: str = flag_from(Exchange, "allreduce", group=SYNC)
    balance: bool = flag_from(Exchange, "balance", group=SYNC)
    timeout: float = flag_from(Limits, "timeout_s", default=DEFAULT_TIMEOUT_S, group=SYNC)
    slow: str | None = flag(
        None,
        metavar="RANK:FACTOR[@START[-END]]",
        help="inject a straggler: make RANK's compute FACTOR times as long from step START "
        "(default 0) until step END, exclusive (default: to the end); e.g. 3:2, 1:1.5@100 or "
        "1:3@10-40, comma-separated for several (default: none)",
        group=STRAGGLERS,
    )
    straggler_window: int = flag(
        20,
        metavar="N",
        help="steps per straggler score window (default: %(default)s)",
        group=STRAGGLERS,
    )
    straggler_threshold: float = flag(
        0.75,
        metavar="X",
        help="flag a rank whose relative score falls below this (default: %(default)s)",
        group=STRAGGLERS,
    )
    straggler_warmup: int = flag(
        10,
        metavar="N",
        help="first steps never scored for stragglers (default: %(default)s)",
        group=STRAGGLERS,
    )
    check_every: int = flag_from(Checks, "check_every", group=FAULTS)
    checkpoint_every: int = flag(
        0,
        metavar="N",
        help="save a checkpoint every N steps into OUT/checkpoints (0: never; "
        "default: %(default)s)",
        group=FAULTS,
    )
    keep_checkpoints: int = flag(
        2, metavar="N", help="checkpoints kept (default: %(default)s)", group=FAULTS
    )
    resume: bool = flag(
        False,
        help="continue from the newest checkpoint in --out with the saved run's --workload, "
        "--params, --steps, --strategy, --compress, --nproc, --replica-groups, "
        "--checkpoint-every, --keep-checkpoints, --max-restarts, --min-replicas and "
        "--heartbeat-timeout, each where not given (a "
        "given --nproc may differ, a given --steps not below the checkpoint's step) "
        "(default: off)",
        group=FAULTS,
    )
    overwrite: bool = flag(
        False,
        help="start over in an --out that holds a run, deleting its checkpoints (default: "
        "refuse such an --out)",
        group=FAULTS,
    )
    max_restarts: int = flag(
        0,
        metavar="R",
        help="restart the workers this many times after a failure, resuming from "
        "checkpoints (default: %(default)s)",
        group=FAULTS,
    )
    kill: str | None = flag(
        None,
        metavar="RANK:STEP",
        help="fault injection: SIGKILL that rank at that step, once; e.g. 1:37, "
        "comma-separated for several (default: none)",
        group=FAULTS,
    )
    replica_groups: int = flag(
        0,
        metavar="G",
        help="live membership: G replica groups of --nproc ranks, each a torchft "
        "participant with its own restarts (--max-restarts, per group): the others go on "
        "without a lost group, and its replacement heals from a live peer; --kill and --slow "
        "name ranks 0..G*nproc-1, group K holding ranks K*nproc...; bsp, zero:1, zero:2, "
        "local:H or diloco:H (streaming too) with any --compress, streaming DiLoCo uncompressed or "
        "--compress fp16/bf16; "
        "docs/membership.md (0: off; default: %(default)s)",
        group=LIVE,
    )
    lighthouse: str | None = flag(
        None,
        metavar="ADDRESS",
        help="the torchft lighthouse of --replica-groups, http://HOST:PORT (default: one "
        "started for the run on 127.0.0.1 and stopped with it)",
        group=LIVE,
    )
    min_replicas: int = flag(
        1,
        metavar="N",
        help="replica groups a step needs: with fewer, the lighthouse waits (the one gradsync "
        "run starts) and no step is applied; G makes the others wait for a lost group's "
        "replacement (default: %(default)s)",
        group=LIVE,
    )
    heartbeat_timeout: float = flag(
        HEARTBEAT_TIMEOUT_S,
        metavar="S",
        help="seconds without a heartbeat before the lighthouse gradsync run starts leaves a "
        "replica group out of the quorum: the survivors' stall after a loss (a lighthouse "
        "given with --lighthouse keeps its own; default: %(default)s)",
        group=LIVE,
    )
    #: which replica group a group's own config.json describes (no flag: ``gradsync run
    #: --replica-groups`` writes one per group, with --kill and --slow in the group's ranks)
    replica_group: int | None = None
    hosts: int = flag(
        0,
        metavar="H",
        help="run on an emulated cluster of H network-namespace hosts (root; see docs; "
        "0: local processes; default: %(default)s)",
        group=CLUSTER,
    )
    link: str = flag(
        DEFAULT_LINK,
        metavar="RATE",
        help="link rate of each emulated host, tc tbf syntax (default: %(default)s)",
        group=CLUSTER,
    )
    out: str = flag(
        factory=default_out,
        metavar="DIR",
        help="run directory (default: runs/<timestamp>)",
        group=OUTPUT,
    )
    progress: bool = flag(True, help="no live progress line (default: shown)", group=OUTPUT)
    plots: bool = flag(True, help="skip PNG plots (default: drawn)", group=OUTPUT)
    tracker: str | None = flag(
        None,
        metavar="NAMES",
        help="also log the step scalars to tensorboard, wandb (offline) or mlflow (a file "
        "store), comma-separated, under the run directory; rank 0 writes them (jsonl: "
        "metrics.jsonl, always written; docs/trackers.md) (default: none)",
        group=OUTPUT,
    )
    telemetry_every: int = 10  # no flag: rank 0's telemetry gather period, for library callers
    #: the user's script and its arguments (``gradsync run [flags] -- SCRIPT ARGS``), or
    #: ``["-m", MODULE, ARGS...]``; empty: the built-in ``workload`` trains
    script: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # One concern each, in this order: with several bad values, the first one here is named.
        self._check_job()
        self._check_sizes()
        self._check_limits()
        self._check_stragglers()
        self._check_inputs()
        self._check_recovery()
        self._check_live()
        self._check_kill()
        if self.hosts:
            self._check_hosts()
        elif self.link != DEFAULT_LINK:
            raise UsageError(
                f"--link {self.link} sets the emulated cluster's links: it needs --hosts H"
            )
        self._check_servers()
        self._check_shards()
        self._check_slow()
        self._check_tracker()
        self._check_script()

    def _check_job(self) -> None:
        if self.nproc < 1:
            raise UsageError(f"--nproc must be at least 1, got {self.nproc}")
        if self.workload not in WORKLOADS:
            raise UsageError(f"unknown workload {self.workload!r}; valid: {', '.join(WORKLOADS)}")
        strategy = parse_strategy(self.strategy)  # raises with the valid forms
        check_allreduce(self.allreduce)
        compressor = checked_compression(self.compression)
        check_hierarchical(self.allreduce, strategy, compressor.spec)
        check_compression(self.strategy, compressor.spec)
        check_compressor(strategy, compressor)
        self._check_backend()

    def _check_backend(self) -> None:
        if self.backend not in ("auto", *BACKENDS):
            raise UsageError(
                f"--backend must be auto, {' or '.join(BACKENDS)}; got {self.backend!r}"
            )
        if self.backend == "nccl":  # refused here, not by every worker after its start
            why = self._host_memory_only()
            if why:
                raise UsageError(
                    f"--backend nccl cannot carry this run: {why}; use --backend gloo (or "
                    "auto, which takes gloo here)"
                )
            check_nccl(local_rank=self.processes - 1, local_processes=self.processes)

    def _host_memory_only(self) -> str | None:
        """Why this run's exchange needs gloo whatever the machine has, or None."""
        if self.hosts:
            return (
                "the emulated cluster's hosts share this machine's GPUs, and NCCL would "
                "bypass its links"
            )
        if self.uses_servers:
            return "parameter servers exchange host memory, which NCCL does not send"
        if self.replica_groups:
            return "--replica-groups exchange over torchft's gloo group on the CPU"
        if parse_strategy_spec(self.strategy).kind == "hogwild":
            return "hogwild shares parameters in host memory"
        return None

    def process_backend(self, local_processes: int) -> str:
        """The backend each process joins with: ``--backend``, where ``auto`` takes NCCL only
        where every local process gets a GPU and the run's exchange can go over NCCL."""
        if self.backend == "auto" and self._host_memory_only():
            return "gloo"
        return choose_backend(self.backend, local_processes)

    def _check_sizes(self) -> None:
        for name in ("steps", "batch_size", "micro_batches", "threads", "telemetry_every"):
            value = getattr(self, name)
            if value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.batch_size % self.micro_batches:
            raise UsageError(
                f"--batch-size {self.batch_size} does not split into --micro-batches "
                f"{self.micro_batches} equal parts; use a multiple of {self.micro_batches}"
            )
        self._check_bucket_mb()
        if self.lr is not None and not 0 < self.lr <= MAX_LR:
            raise UsageError(f"--lr must be a number > 0 and at most {MAX_LR:g}, got {self.lr}")

    def _check_bucket_mb(self) -> None:
        if self.bucket_mb not in (None, AUTO) and not (
            isinstance(self.bucket_mb, (int, float))
            and math.isfinite(self.bucket_mb)  # inf would reach config.json as Infinity
            and self.bucket_mb > 0
        ):
            raise UsageError(
                f"--bucket-mb must be a finite number > 0 or 'auto', got {self.bucket_mb!r}"
            )
        if self.bucket_mb != AUTO or parse_strategy_spec(self.strategy).kind != "bsp":
            return
        # bsp's workers refuse these (a compressor keeps state per bucket, which a change of
        # plan mid-run would misplace; a hierarchy of ranks runs its own buckets): refused here,
        # before anything starts or a run directory is left behind.
        spec = checked_compression(self.compression).spec
        given = [f"--compress {spec}"] if spec != "none" else []
        if self.allreduce == "hierarchical" and self.nproc > 1:
            given.append("--allreduce hierarchical")
        if given:
            raise UsageError(
                f"--bucket-mb auto with {' and '.join(given)}: auto tunes the plain ring "
                "all-reduce's buckets only; give --bucket-mb a number (or leave it out for the "
                "default plan)"
            )

    def _check_limits(self) -> None:
        """Values that would pass the workers' own checks and fail or hang much later."""
        if not MIN_TIMEOUT_S <= self.timeout <= MAX_TIMEOUT_S:
            raise UsageError(
                f"--timeout must be between {MIN_TIMEOUT_S:g} second and {MAX_TIMEOUT_S:.0f} "
                f"seconds (a week), got {self.timeout}"
            )
        if not 0 <= self.seed < 2**64:
            raise UsageError(f"--seed must be between 0 and 2**64 - 1, got {self.seed}")
        if self.nproc > MAX_LOCAL_PROCESSES:
            raise UsageError(
                f"--nproc {self.nproc} is more local workers than gradsync starts on one machine "
                f"(at most {MAX_LOCAL_PROCESSES}); use torchrun across nodes for more"
            )
        cpus = os.cpu_count() or 1
        if self.threads > MAX_THREADS_PER_CPU * cpus:
            raise UsageError(
                f"--threads {self.threads} is more intra-op threads per rank than this "
                f"machine's {cpus} CPU(s) run: use at most {MAX_THREADS_PER_CPU * cpus} "
                f"({MAX_THREADS_PER_CPU} per CPU), e.g. --threads {max(1, cpus // self.nproc)} "
                "to share the CPUs among the ranks"
            )
        if not 1000 <= self.params <= MAX_PARAMS:
            raise UsageError(
                f"--params must be between 1000 and {MAX_PARAMS:,} (4 GB of fp32), "
                f"got {self.params}"
            )
        self._check_batch_memory()

    def _check_batch_memory(self) -> None:
        """A batch whose activations cannot fit in this machine's memory fails in the workers'
        first step with the allocator's error (or the kernel's OOM killer): refuse it here. The
        estimate is a lower bound, so only batches that certainly do not fit are refused."""
        per_sample = self.nproc * step_bytes(self.workload, self.params, 1, self.nproc)
        memory = physical_memory()
        if memory is None or self.batch_size * per_sample <= memory:
            return
        raise UsageError(
            f"--batch-size {self.batch_size} needs at least "
            f"{self.batch_size * per_sample / 2**30:,.1f} GiB for the activations of "
            f"{self.nproc} {self.workload} worker(s), more than this machine's "
            f"{memory / 2**30:.1f} GiB: use at most --batch-size {memory // per_sample}"
        )

    def _check_stragglers(self) -> None:
        try:
            StragglerConfig(
                window=self.straggler_window,
                threshold=self.straggler_threshold,
                warmup=self.straggler_warmup,
            )
        except UsageError as exc:
            option = next(
                f"--straggler-{name}"
                for name in ("window", "threshold", "warmup")
                if str(exc).startswith(name)
            )
            raise UsageError(f"{option}: {exc}") from None

    def _check_inputs(self) -> None:
        self._check_params()
        if self.data is not None:
            if self.workload != "charlm":
                raise UsageError(
                    f"--data is the text charlm trains on; --workload {self.workload} "
                    "makes its own data: drop --data or use --workload charlm"
                )
            check_data_file(self.data)
        if self.balance and not parse_strategy(self.strategy).weights_samples:
            raise UsageError(
                f"--balance needs --strategy bsp, zero:1 or zero:2, got {self.strategy}"
            )

    def _check_params(self) -> None:
        """--params sizes mlp's model only: given with another workload, it would be silently
        ignored. (With a script, ``_check_script`` names it among the built-in workloads'
        flags.) Given is judged against the default, as ``changed_fields`` does."""
        default = RunConfig.__dataclass_fields__["params"].default
        if self.script or self.workload in SIZED_BY_PARAMS or self.params == default:
            return
        takes = ", ".join(SIZED_BY_PARAMS)
        raise UsageError(
            f"--params {self.params} does not apply to workload {self.workload}, whose model "
            f"has a fixed size: --params sizes the model of workload {takes} only; drop "
            f"--params, or use --workload {SIZED_BY_PARAMS[0]}"
        )

    def _check_recovery(self) -> None:
        if self.check_every < 0:
            raise UsageError(f"--check-every must be >= 0 (0: off), got {self.check_every}")
        if self.checkpoint_every < 0:
            raise UsageError(
                f"--checkpoint-every must be >= 0 (0: off), got {self.checkpoint_every}"
            )
        if self.keep_checkpoints < 1:
            raise UsageError(f"--keep-checkpoints must be at least 1, got {self.keep_checkpoints}")
        if not 0 <= self.max_restarts <= 1000:
            raise UsageError(f"--max-restarts must be between 0 and 1000, got {self.max_restarts}")
        if self.resume and self.overwrite:
            raise UsageError(OVERWRITE_AND_RESUME)

    def _check_kill(self) -> None:
        kills = parse_kill(self.kill)
        for k in kills:
            if k.rank >= self.ranks_in_run:
                raise UsageError(
                    f"--kill names rank {k.rank}, but ranks are 0..{self.ranks_in_run - 1}"
                    f"{self._ranks_of_groups}"
                )
        for k in kills:
            if self.uses_servers and k.rank >= self.nproc:
                # A server only serves: it has no step of its own at which to kill itself.
                raise UsageError(
                    f"--kill names rank {k.rank}, a parameter server with --strategy "
                    f"{self.strategy}; only worker ranks 0..{self.nproc - 1} can be killed"
                )
        # a script's steps are its own (--steps is the built-in workloads'): not known here
        late = [] if self.script else [k for k in kills if k.step >= self.steps]
        if late:
            raise UsageError(
                f"--kill {late[0].rank}:{late[0].step} would never fire: the run has --steps "
                f"{self.steps} (steps 0..{self.steps - 1})"
            )
        # Each replica group restarts on its own: its --max-restarts covers its own kills.
        per_group = Counter(self.group_of(k.rank) for k in kills)
        most = max(per_group.values(), default=0)
        if most and self.max_restarts < most:
            where = " in one replica group" if self.replica_groups else ""
            raise UsageError(
                f"--kill injects {most} failure(s){where} but --max-restarts is "
                f"{self.max_restarts}: the run could not survive them"
            )

    def _check_live(self) -> None:
        """--replica-groups and its flags: what the torchft membership of this first version
        carries (gradsync.membership says why each is refused), refused before any start."""
        if not self.replica_groups:
            given = [
                name
                for name, unset in (
                    ("--lighthouse", self.lighthouse is None),
                    ("--min-replicas", self.min_replicas == 1),
                    ("--heartbeat-timeout", self.heartbeat_timeout == HEARTBEAT_TIMEOUT_S),
                )
                if not unset
            ]
            if given:
                raise UsageError(
                    f"{given[0]} sets how replica groups meet: it needs --replica-groups G"
                )
            return
        self._check_heartbeat_timeout()
        groups = self.replica_groups
        if not 2 <= groups <= MAX_LOCAL_PROCESSES:
            raise UsageError(
                f"--replica-groups must be between 2 and {MAX_LOCAL_PROCESSES} (0: off), got "
                f"{groups}: a single group has no peer to go on without it or to heal from"
            )
        spec = parse_strategy_spec(self.strategy)
        if groups * self.nproc > MAX_LOCAL_PROCESSES:
            raise UsageError(
                f"--replica-groups {groups} of --nproc {self.nproc} is {groups * self.nproc} "
                f"processes, more than {MAX_LOCAL_PROCESSES} on one machine"
            )
        if not runs_live(spec):
            raise UsageError(
                f"--replica-groups runs --strategy {LIVE_STRATEGIES} only for now, got "
                f"{self.strategy}: their exchanges are the ones that go through torchft's "
                "quorum and commit decision (the others' collectives would stay inside one "
                f"group or reach a lost one); use --strategy {LIVE_STRATEGIES}"
            )
        try:
            check_exchange(
                self.strategy,
                checked_compression(self.compression).spec,
                self.allreduce,
                self.bucket_mb,
                self.balance,
            )
        except UsageError as exc:
            raise UsageError(f"--replica-groups {groups}: {exc}") from None
        self._check_live_run()
        missing = torchft_missing()
        if missing is not None:
            raise UsageError(f"--replica-groups: {missing}")

    def _check_heartbeat_timeout(self) -> None:
        lo, hi = HEARTBEAT_TIMEOUT_RANGE_S
        if not lo <= self.heartbeat_timeout <= hi:
            raise UsageError(
                f"--heartbeat-timeout must be between {lo:g} and {hi:g} seconds, got "
                f"{self.heartbeat_timeout:g}: a torchft Manager heartbeats every 0.1 s, so "
                f"under {lo:g} s a busy group is taken for lost"
            )
        # A group's own config (replica_group set) names the lighthouse the run started with
        # this very timeout: only one given with --lighthouse keeps a timeout of its own.
        given_lighthouse = self.lighthouse is not None and self.replica_group is None
        if given_lighthouse and self.heartbeat_timeout != HEARTBEAT_TIMEOUT_S:
            raise UsageError(
                "--heartbeat-timeout sets the lighthouse gradsync run starts; the one given "
                f"with --lighthouse {self.lighthouse} keeps its own (torchft_lighthouse "
                "--heartbeat_timeout_ms)"
            )

    def _check_live_run(self) -> None:
        """The run's own settings under --replica-groups: what its launch cannot do yet."""
        groups = self.replica_groups
        if self.hosts and self.hosts != groups:
            raise UsageError(
                f"--replica-groups {groups} with --hosts {self.hosts}: the emulated cluster "
                f"runs one replica group per host; use --replica-groups {groups} --hosts {groups}"
            )
        if self.hosts and self.lighthouse is not None and self.replica_group is None:
            # (a group's own config.json names the lighthouse the run started)
            raise UsageError(
                f"--lighthouse with --hosts {self.hosts}: the run starts the lighthouse inside "
                "the emulated cluster (on host 0), where every host reaches it; drop --lighthouse"
            )
        if self.min_replicas < 1:
            raise UsageError(f"--min-replicas must be at least 1, got {self.min_replicas}")
        if self.min_replicas > groups and self.lighthouse is None:
            # (with a lighthouse of your own, groups of other runs may make up the number)
            raise UsageError(
                f"--min-replicas {self.min_replicas} is more than --replica-groups {groups}: "
                f"no quorum of the run's groups would ever form; use 1..{groups}"
            )
        if self.lighthouse is not None:
            check_lighthouse(self.lighthouse)
        if self.replica_group is not None and not 0 <= self.replica_group < groups:
            raise UsageError(f"replica group {self.replica_group} is not one of 0..{groups - 1}")

    @property
    def groups_here(self) -> int:
        """The replica groups this config launches: --replica-groups for the whole run; 1 for
        a group's own config.json, or a run without live membership."""
        return self.replica_groups if self.replica_groups and self.replica_group is None else 1

    @property
    def ranks_in_run(self) -> int:
        """The ranks --kill and --slow name: every group's, group K holding K*nproc..."""
        return self.processes * self.groups_here

    def group_of(self, rank: int) -> int:
        """The replica group of ``rank`` (in the numbering of ``ranks_in_run``)."""
        return rank // self.processes

    @property
    def _ranks_of_groups(self) -> str:
        if self.groups_here == 1:
            return ""
        n = self.nproc
        holds = "rank K" if n == 1 else f"ranks {n}K to {n}K+{n - 1}"
        return f" ({self.groups_here} replica groups of {n} rank(s): group K holds {holds})"

    def _check_servers(self) -> None:
        if self.servers < 1:
            raise UsageError(f"--servers must be at least 1, got {self.servers}")
        if not self.uses_servers:
            if self.servers != 1:
                raise UsageError(
                    f"--servers {self.servers} is for the parameter-server strategies (ssp:S, "
                    f"async); --strategy {self.strategy} runs no servers"
                )
            return
        if self.servers > 1:
            # Every server needs a parameter tensor of its own (shards are whole tensors).
            workload = make_workload(
                self.workload, seed=self.seed, data=self.data, params=self.params
            )
            tensors = sum(p.requires_grad for p in workload.build_model().parameters())
            if self.servers > tensors:
                raise UsageError(
                    f"--servers {self.servers} is more than the {tensors} trainable parameter "
                    f"tensors of workload {self.workload}: each server holds whole tensors, so "
                    f"use at most {tensors} servers"
                )

    def _check_shards(self) -> None:
        """zero:N gives every rank whole tensors of the model, and streaming DiLoCo cuts it into
        F fragments: refuse here a run whose workers would each refuse it (the same message)."""
        spec = parse_strategy_spec(self.strategy)
        streaming = spec.kind == "diloco" and (spec.fragments or 1) > 1
        if spec.kind != "zero" and not streaming:
            return
        workload = make_workload(self.workload, seed=self.seed, data=self.data, params=self.params)
        model = workload.build_model()
        trainable: list[Any] = [p for p in model.parameters() if p.requires_grad]
        if streaming:
            split = spec.split or SPLITS[0]
            fragment_tensors(model, trainable, spec.fragments or 1, split, str(spec))
            return
        # The built-in workloads' optimizers update every trainable tensor (and building one
        # here would cost a second).
        OwnerLayout(trainable, self.nproc, 0).check(trainable, str(spec))

    def _check_slow(self) -> None:
        workers = self.nproc * self.groups_here
        for s in parse_slow(self.slow):
            if s.rank >= workers:
                raise UsageError(
                    f"--slow names rank {s.rank}, but ranks are 0..{workers - 1} "
                    f"with --nproc {self.nproc}{self._ranks_of_groups}"
                )

    def _check_hosts(self) -> None:
        from gradsync.cluster import parse_rate

        if self.hosts < 0:
            raise UsageError(f"--hosts must be >= 0 (0: no emulated cluster), got {self.hosts}")
        if parse_strategy_spec(self.strategy).kind == "hogwild" and self.hosts > 1:
            # The same refusal as the workers' own host check, before anything is launched.
            raise UsageError(
                f"hogwild runs on one host (its workers share the parameters in memory): drop "
                f"--hosts {self.hosts}, or use async, local:H or bsp across hosts"
            )
        parse_rate(self.link)
        if self.replica_groups:
            return  # one group per host (_check_live_run), each with its own agent's restarts
        if self.processes % self.hosts:
            raise UsageError(
                f"{self.processes} processes do not split evenly over --hosts {self.hosts}; "
                "use a number of workers (plus servers) that is a multiple of the hosts"
            )

    def changed_fields(self) -> list[str]:
        """The fields holding another value than their default (a factory's, such as ``out``,
        never counts): the flags a command line gave, as config.json records them
        (``given``)."""
        return [
            f.name
            for f in fields(self)
            if f.default is not MISSING and getattr(self, f.name) != f.default
        ]

    def _check_script(self) -> None:
        """A script to run exists, and no flag of the built-in workloads comes with it: the
        script trains its own model on its own data, so such a flag would silently do
        nothing. (--strategy, --compression, --servers and --timeout do apply: they are what
        the script's gs.Synchronizer takes where it names none.)"""
        if not self.script:
            return
        if self.script[0] == "-m":
            if len(self.script) < 2 or self.script[1].startswith("-"):
                raise UsageError("gradsync run -- -m MODULE: name the module to run after -m")
        elif not Path(self.script[0]).is_file():
            raise UsageError(
                f"gradsync run -- {self.script[0]}: no such script (give a Python file, or "
                "-m MODULE)"
            )
        elif is_source_file(self.script[0]):
            _check_compiles(Path(self.script[0]))
        changed = self.changed_fields()
        given = [name for name in WORKLOAD_ONLY if name in changed]
        if given:
            raise workload_flags_refused(given)

    def _check_tracker(self) -> None:
        # Before any process starts: a misspelt name or a missing extra would otherwise fail
        # rank 0 after the workers have started.
        if self.tracker is None:
            return
        from gradsync.telemetry.trackers import missing_extras, parse_trackers

        try:
            names = parse_trackers(self.tracker)
        except UsageError as exc:
            raise UsageError(f"--tracker: {exc}") from None
        missing = missing_extras(names)
        if missing:
            raise UsageError(
                f"--tracker {missing[0]} needs the {missing[0]} package, which is not "
                f"installed: pip install 'gradsync[{missing[0]}]'"
            )

    @property
    def uses_servers(self) -> bool:
        return uses_servers(self.strategy)

    @property
    def processes(self) -> int:
        """Processes to launch: the workers, plus the servers of ssp/async (the last ranks)."""
        return self.nproc + (self.servers if self.uses_servers else 0)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.nproc

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def recorded(self) -> dict[str, Any]:
        """What config.json records of this config: every field, less, for a run of a script
        (``script``: the script or ``-m MODULE`` and its arguments, as run), the built-in
        workloads' (``WORKLOAD_ONLY``): the script trains its own model on its own data for
        its own number of steps, and their defaults (``workload: charlm``, ``steps: 200``)
        would record a training that did not run. ``from_dict`` gives them back as defaults,
        which a script's run never uses."""
        data = self.to_dict()
        if self.script:
            for name in WORKLOAD_ONLY:
                del data[name]
        return data

    def save(self, run_dir: Path, **extra: Any) -> None:
        """Write config.json: the flags (``recorded``), plus derived facts for reports
        (``extra``)."""
        data = {**self.recorded(), **extra}
        (run_dir / "config.json").write_text(json.dumps(data, indent=2) + "\n")

    @staticmethod
    def add_facts(run_dir: Path, **facts: Any) -> None:
        """Add derived facts to a written config.json (``attached_run.add_facts``);
        ``from_dict`` ignores them, as it does ``save``'s ``extra``."""
        add_facts(run_dir, **facts)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})
