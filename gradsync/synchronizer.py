"""``Synchronizer``: one training loop for every strategy, a superstep per ``sync.step()``."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import inspect
import multiprocessing.util
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist

from gradsync import compat, exit_safety, runtime
from gradsync.attached_run import AttachedRun, ending_status, pulled_bytes
from gradsync.balance import ShardBalancer
from gradsync.checkpoint.checkpointer import Checkpointer
from gradsync.checks import divergence_behind
from gradsync.checks.diagnose import BETWEEN, BLOCK, END, START, ArrivalWatch, GroupTimeout
from gradsync.checks.gate import DEFAULT_BETWEEN_STEPS_S, StepGate
from gradsync.checks.gate_ahead import GateAhead
from gradsync.checks.guards import check_replicas
from gradsync.checks.verdicts import PendingVerdicts
from gradsync.compression import parse_compression
from gradsync.compression.base import Compressor
from gradsync.errors import UsageError
from gradsync.flat import chunks, copy_into, flatten
from gradsync.inject import Slowdown, apply_slowdowns, check_slowdowns, parse_slow
from gradsync.membership import LiveSettings, check_membership
from gradsync.options import (
    DEFAULT_TIMEOUT_S,
    GROUP_OF,
    Checks,
    Exchange,
    Limits,
    Options,
    Telemetry,
)
from gradsync.processes.stores import server_store
from gradsync.strategies.base import (
    Layout,
    StepOutcome,
    StepPlan,
    Strategy,
    SyncContext,
    clip_grad_norm,
)
from gradsync.strategies.factory import check_compressor, parse_strategy
from gradsync.telemetry.device_clock import DeviceClock, StepMarks, cuda_device_of
from gradsync.telemetry.records import Span, StepRecord
from gradsync.telemetry.report import RunReport
from gradsync.telemetry.timing import TelemetryCollector
from gradsync.telemetry.trackers import KILLED
from gradsync.topology import Hierarchy, check_hierarchical

#: the most the initial and buffer broadcasts copy into one flat tensor at a time (DDP's own
#: initial broadcast goes in 250 MB runs; gradsync's bucket is 25 MB)
BROADCAST_CHUNK_BYTES = 25 * 2**20


@dataclass(slots=True)
class StepHandle:
    """Yielded by ``sync.step()``: set ``loss`` (a tensor or float) to have it reported, and
    ``samples`` if the block's batch size differs from what the Synchronizer was told.

    ``synchronize()`` inside the block, after the last backward pass, is the gradient-ready
    point: clip, unscale or log ``p.grad`` there. After the block, ``skipped`` tells whether
    the update was skipped (a non-finite gradient) rather than applied."""

    step: int
    micro_batches: int
    loss: torch.Tensor | float | None = None
    samples: int = 0
    _skipped: bool = field(default=False, repr=False)
    _skip_reason: str | None = field(default=None, repr=False)
    #: the verdict still on the device (a 0-d tensor, 1.0: skipped), until it is read
    _found_inf: torch.Tensor | None = field(default=None, repr=False)
    #: why every rank skipped the step (``Synchronizer._skip_reason``), asked once it was
    _why_skipped: Callable[[int], str | None] | None = field(default=None, repr=False)
    _ready: Callable[[], StepOutcome] | None = field(default=None, repr=False)
    _params: list[torch.Tensor] = field(default_factory=list, repr=False)
    _strategy: Strategy | None = field(default=None, repr=False)
    _synchronized: bool = field(default=False, repr=False)

    @property
    def skipped(self) -> bool:
        """After the block: True when the update was not applied (the gradient was not
        finite). Where the verdict stayed on the device (a fused optimizer), reading this
        before the Synchronizer has read it in its batch waits for the device."""
        self._read_verdict()
        return self._skipped

    @skipped.setter
    def skipped(self, value: bool) -> None:
        self._found_inf = None
        self._skipped = value

    @property
    def skip_reason(self) -> str | None:
        """Why the step was skipped, when the reason is known (another rank's block raised)."""
        self._read_verdict()
        return self._skip_reason

    @skip_reason.setter
    def skip_reason(self, value: str | None) -> None:
        self._skip_reason = value

    def _read_verdict(self) -> None:
        if self._found_inf is not None:
            self._settle(bool(self._found_inf))

    def _settle(self, skipped: bool) -> None:
        """The verdict is known on the host: ``skipped``, and why where a rank's block raised."""
        self._found_inf = None
        self._skipped = skipped
        why, self._why_skipped = self._why_skipped, None
        if skipped and why is not None:
            self._skip_reason = why(self.step)

    def synchronize(self) -> bool:
        """Finish this step's exchange now, inside the block, after its last backward pass.

        Afterwards ``p.grad`` holds the gradient the update will use, and changing it in place
        (``clip_grad_norm_``, ``GradScaler.unscale_``, logging its norm) changes the update:
        under ``bsp`` the mean over ranks and micro-batches (the same on every rank); under
        ``local:H`` / ``diloco:H`` this rank's own mean over micro-batches (the inner step's
        gradient); under ``ssp:S`` / ``async`` this worker's gradient before it is pushed.
        Returns False when the step will be skipped because the gradient is not finite (on
        every rank that must agree); where that verdict stays on the device (a fused
        optimizer, docs/gpu.md), returning it waits for the device, which ``clip_grad_norm_``
        does not. At most once per step; without it the exchange finishes at the block's
        exit. No backward pass may follow it in the same block."""
        return not _skipped(self._exchange())

    def _exchange(self) -> StepOutcome:
        """``synchronize()`` without reading its verdict: a verdict left on the device stays
        there (``clip_grad_norm_`` needs none, and a skipped step's optimizer ignores it)."""
        if self._ready is None:
            raise UsageError("synchronize() belongs inside a sync.step() block")
        self._synchronized = True
        return self._ready()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``synchronize()`` (unless done already), then clip the gradient the update will use
        to ``max_norm`` with ``torch.nn.utils.clip_grad_norm_``; returns its total norm before
        clipping. Under ``bsp`` that is the norm of the mean gradient over ranks (the same on
        every rank, so the clipped update is the one a single process would make); under
        ``local:H`` / ``diloco:H`` and ``ssp:S`` / ``async`` the norm of this rank's own
        gradient (see ``synchronize``); under ``zero:2``, where each rank holds its shard of
        the mean gradient, the norm is combined over the shards (a collective). A step to be
        skipped clips nothing, except where its verdict stays on the device (a fused
        optimizer): the non-finite gradient is then clipped to a non-finite one, the norm
        returned is not finite, and the update is skipped all the same."""
        if not self._synchronized:
            self._exchange()
        assert self._strategy is not None
        return clip_grad_norm(self._strategy, self._params, max_norm, norm_type)


class Synchronizer:
    """Wraps a model and the user's optimizer; each ``with sync.step():`` block is a superstep.

    ``accumulation`` says how the k backward passes of ``sync.step(micro_batches=k)`` combine:
    ``"mean"`` (default) averages their gradients, so each micro-batch's loss is a plain mean;
    ``"sum"`` adds them, for scripts that divide each loss by k as DDP scripts do.

    On block exit the strategy synchronizes and ``optimizer.step()`` has run. Gradients are
    zeroed at block entry. Parameters and buffers are broadcast from rank 0 at construction,
    so replicas start identical (as DDP does).

    ``timeout_s`` bounds gradsync's own waits: it is the group's collective timeout while
    gradsync runs (a step block, ``save``, ``report``), and the user's timeout comes back
    between steps (see ``gradsync.checks.diagnose``). A rank still in its own code between
    steps (an evaluation on rank 0) is waited for up to ``between_steps_timeout_s`` before
    the next collective is posted (``gradsync.checks.gate``); None turns that gate off, and then
    ``timeout_s`` bounds those waits too. ``gate_group_size``: ranks the gate counts together
    at a store of their own (None: flat below 64 ranks, else about the square root of the
    world; ``gradsync.checks.gate_groups``).

    The settings also come grouped (``gradsync.options``): ``exchange=Exchange(...)``
    (``bucket_mb``, ``allreduce``, ``accumulation``, ``broadcast_buffers``,
    ``find_unused_parameters``, ``balance``),
    ``limits=Limits(...)`` (``timeout_s``, ``between_steps_timeout_s``, ``gate_group_size``),
    ``telemetry=Telemetry(...)`` (``telemetry_every``, ``record_spans``, ``on_records``;
    ``telemetry=False`` turns it off) and ``checks=Checks(...)`` (``check_every``,
    ``skip_nonfinite``), each field the keyword of its name; a setting given both ways is
    refused. ``sync.options`` holds them resolved.

    If a rank's block raises, its peers skip that step with it (under ``bsp`` its unsent
    buckets go out as NaN) and the exception propagates on that rank; caught there, training
    goes on in step on every rank.

    ``run_dir`` (default: ``$GRADSYNC_RUN_DIR``, which ``gradsync run`` sets) attaches the
    Synchronizer to a run directory: rank 0 writes ``metrics.jsonl`` as records are gathered,
    and ``report()`` writes ``spans.jsonl`` and ``report.json``, the files ``gradsync report``
    reads; ``gradsync run``'s ``--kill`` and ``--slow`` act on it (``gradsync.attached_run``).
    """

    #: Synchronizers created so far in this process, per process group: each one keeps its
    #: own arrival records, so a later one never reads an earlier one's
    _created: ClassVar[dict[str, int]] = {}
    #: set by ``close()``: a step or load after it is refused (its strategy is torn down)
    _closed = False

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: str | Strategy | None = None,
        compression: str | Compressor | None = None,
        bucket_mb: float | str | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        telemetry: bool | Telemetry = True,
        telemetry_every: int = 10,
        slow: str | list[Slowdown] | None = None,
        on_records: Callable[[list[StepRecord]], None] | None = None,
        record_spans: bool = False,
        servers: int | None = None,
        timeout_s: float | None = None,
        balance: bool | ShardBalancer = False,
        skip_nonfinite: bool = True,
        check_every: int = 100,
        accumulation: str = "mean",
        scaler: torch.amp.GradScaler | None = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        between_steps_timeout_s: float | None = DEFAULT_BETWEEN_STEPS_S,
        gate_group_size: int | None = None,
        allreduce: str = "ring",
        run_dir: str | Path | None = None,
        exchange: Exchange | None = None,
        limits: Limits | None = None,
        checks: Checks | None = None,
        membership: str | None = None,
        lighthouse: str | None = None,
        min_replicas: int | None = None,
    ) -> None:
        runtime.require_initialized("gs.Synchronizer")
        _check_arguments(model, optimizer, scaler)
        # The settings given as keywords (each the field of that name of an option group)
        keywords = {name: value for name, value in locals().items() if name in GROUP_OF}
        options = Options.of(
            keywords, exchange=exchange, limits=limits, telemetry=telemetry, checks=checks
        )
        # ``run_dir`` or GRADSYNC_RUN_DIR (set by ``gradsync run``): the run directory's files,
        # faults and settings for whatever script trains (``gradsync.attached_run``)
        self._run = AttachedRun.find(run_dir)
        given_slow = slow is not None
        strategy, compression, servers, slow, self.options = self._run_defaults(
            strategy, compression, servers, slow, options
        )
        self.scaler = scaler
        self.model = model
        self.optimizer = optimizer
        # What the strategies synchronize (their lists are taken at setup too): listed once,
        # not on every step, for StepHandle.clip_grad_norm_.
        self._trainable: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        # As DDP: a model without buffers at construction is never walked for them again (the
        # walk costs about 0.2 ms a step on a 24-layer transformer's 242 modules).
        self._has_buffers = next(iter(model.buffers()), None) is not None
        self.group = group
        self.rank = runtime.rank(group)
        self.world_size = runtime.world_size(group)
        self.strategy, self.compressor = self._make_strategy(strategy, compression, servers)
        self._live = self._check_live(membership, lighthouse, min_replicas, strategy)
        self._membership: Any = None
        #: what the strategy works on (set up in ``_setup_strategy``)
        self._context: SyncContext | None = None
        self.layout = Layout.of(self.world_size, self.strategy.servers)
        if self._run is not None:
            self._start_run(self._run, model)
        self._hierarchy: Hierarchy | None = None
        self.slowdowns = self._slowdowns(slow, given_slow)
        self.balancer = self._make_balancer(self.options.exchange.balance)
        self._sizes: list[int] | None = None
        self._make_gate_and_telemetry(group)
        self._init_step_state()
        self._checkpoints = self._make_checkpointer()
        if self.strategy.barrier_free:
            self._collector.before_gather = self._checkpoints.before_gather
        self._setup_strategy()
        self._after_setup(model, optimizer)

    def _check_live(
        self,
        membership: str | None,
        lighthouse: str | None,
        min_replicas: int | None,
        strategy: str | Strategy,
    ) -> LiveSettings | None:
        """``membership="torchft"``: this process is one replica group (gradsync.membership);
        under ``gradsync run --replica-groups`` the run directory says so. Checked against
        the rest of the settings before anything is set up."""
        if self._run is not None:
            membership, min_replicas = self._run.live(membership, min_replicas)
        return check_membership(
            membership,
            lighthouse=lighthouse,
            min_replicas=min_replicas,
            strategy=strategy,
            compression_spec=self.compressor.spec,
            allreduce=self.allreduce,
            bucket_mb=self.options.exchange.bucket_mb,
            balance=self.options.exchange.balance,
        )

    def _slowdowns(self, slow: str | list[Slowdown] | None, given: bool) -> list[Slowdown]:
        """The injected slowdowns (``slow``, or the run directory's)."""
        slowdowns = parse_slow(slow) if isinstance(slow, str | None) else list(slow)
        if given:  # --slow's ranks may be other replica groups': the run checked those
            check_slowdowns(slowdowns, self.world_size)
        return slowdowns

    def _start_run(self, run: AttachedRun, model: torch.nn.Module) -> None:
        """Tell the run directory this rank has started, and keep its last records for it."""
        params = [p for p in model.parameters() if p.requires_grad]
        trained = sum(p.numel() for p in params)
        run.start(
            self.rank, self.layout.workers, trained, pulled_bytes(params, self.layout.servers)
        )
        # A script that never calls report() (a port through the front door may not) or
        # close() still gets its last step records into the run directory: at the exit of
        # its process (a multiprocessing child's too, which ends with os._exit: its atexit
        # handlers run only where gradsync's worker runs them, after these finalizers).
        multiprocessing.util.Finalize(
            self, _write_unreported, args=(weakref.ref(self),), exitpriority=1
        )
        _ATTACHED.add(self)  # and when its rank is stopped (write_unreported_records)

    def _make_gate_and_telemetry(self, group: dist.ProcessGroup | None) -> None:
        """The timeline's spans, the arrival watch, the step gate (and its thread), the
        telemetry's collector and the checks' pending verdicts."""
        self.spans: list[Span] = []
        #: those of ``spans`` not in the run directory's spans.jsonl yet (``_write_own_spans``)
        self._unwritten_spans: list[Span] = []
        self._group_timeout, self._watch, self._gate = self._make_watch()
        #: the step gate waited on a thread from the block's entry (``checks.gate_ahead``)
        self._ahead = (
            GateAhead(self._gate) if self._gate is not None and self.strategy.gate_ahead else None
        )
        if self._ahead is not None:
            exit_safety.stop_at_exit(self._ahead.stop)
        every = (self.options.telemetry or Telemetry()).telemetry_every  # none: no records
        self._collector = TelemetryCollector(group, every, self._on_gathered, watch=self._watch)
        #: non-finite verdicts left on the device, read together at the telemetry's period
        self._verdicts = PendingVerdicts(every)
        #: the periodic divergence check posted and not compared yet
        self._posted_check: divergence_behind.PostedCheck | None = None

    def _init_step_state(self) -> None:
        """The step count and what the steps, the checks and the API calls keep track of."""
        self._step = 0
        #: whether this process has taken a step with this Synchronizer (``load``'s check)
        self._stepped_here = False
        self._in_step = False
        self._natural = 0.0  # last step's compute without injected slowdown
        #: seconds the training thread waited in ``_join_gate`` since it was last zeroed (at
        #: a block's start): waiting for peers, so sync time, not compute
        self._gate_waited = 0.0
        self._final_checked = False
        #: ``step_count`` when ``report()`` last ran the strategy's ``finalize`` (the replicas
        #: agree there); None before. The front door warns of replicas left apart without it.
        self.finalized_at: int | None = None
        #: gradsync's own API calls in progress (save, report, ...): the model's state taken
        #: inside one is gradsync's, not the script's
        self._calls = 0

    def _after_setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """What depends on the strategy's setup: the parameters it trains, the device clock,
        and the hook that counts the optimizer's steps."""
        replaced = self.strategy.trainable()
        #: parameters frozen at the build, whose gradients no strategy synchronizes (None where
        #: the strategy replaced the model's parameters: zero:3's shards)
        self._frozen_at_build: set[int] | None = (
            None
            if replaced is not None
            else {id(p) for p in model.parameters() if not p.requires_grad}
        )
        self._trainable = replaced or self._trainable
        cuda = cuda_device_of(self._trainable)
        # On CUDA a host clock times kernel launches: steps are timed by device events there.
        self._clock = DeviceClock(cuda) if cuda is not None and self.telemetry_enabled else None
        self._marks: StepMarks | None = None
        self._back_to_user()
        # Counts every optimizer.step(); gradsync's own are expected, any other is the
        # double-step trap of a ported script (optimizer.step() or scaler.step() kept).
        self._optimizer_steps = self._expected_steps = 0
        self._step_hook = optimizer.register_step_post_hook(self._count_optimizer_step)

    def _run_defaults(
        self,
        strategy: str | Strategy | None,
        compression: str | Compressor | None,
        servers: int | None,
        slow: str | list[Slowdown] | None,
        options: Options,
    ) -> tuple[str | Strategy, str | Compressor | None, int, str | list[Slowdown] | None, Options]:
        """The arguments and options the script names, else (in a run directory) the command
        line's --strategy, --compression, --servers, --timeout and --slow, else the defaults."""
        if self._run is not None:
            strategy = self._run.choose("strategy", strategy, "bsp")
            compression = self._run.choose("compression", compression, None)
            servers = self._run.choose("servers", servers, 1)
            chosen = self._run.choose("timeout_s", options.limits.timeout_s, DEFAULT_TIMEOUT_S)
            options = options.attached(chosen)
            slow = self._run.slow if slow is None else slow
        strategy = "bsp" if strategy is None else strategy
        return strategy, compression, 1 if servers is None else servers, slow, options.resolved()

    def _make_strategy(
        self, strategy: str | Strategy, compression: str | Compressor | None, servers: int
    ) -> tuple[Strategy, Compressor]:
        """The strategy and the compressor, checked against the model, the exchange and each
        other."""
        made = parse_strategy(strategy, servers=servers, timeout_s=self.timeout_s)
        _check_sharded_model(self.model, made)
        compressor = parse_compression(compression)
        check_hierarchical(self.allreduce, made, compressor.spec)
        check_compressor(made, compressor)
        return made, compressor

    def _make_watch(self) -> tuple[GroupTimeout | None, ArrivalWatch, StepGate | None]:
        """The group's collective timeout while gradsync runs, the arrival watch every wait
        goes through, and the gate before each collective (``gradsync.checks``)."""
        group, limits = self.group, self.options.limits
        timeout_s = self.timeout_s
        # timeout_s becomes the group's collective timeout while this Synchronizer is open,
        # so the backend itself ends any wait that outlasts it (see gradsync.checks.diagnose).
        group_timeout = GroupTimeout(group, timeout_s) if self.world_size > 1 else None
        watch = ArrivalWatch(
            self.rank,
            self.world_size,
            group_timeout.seconds if group_timeout is not None else timeout_s,
            scope=self._arrival_scope(group),
        )
        # Its heartbeat thread must not run on into the interpreter's shutdown (issue 49).
        exit_safety.stop_at_exit(watch.stop)
        # Parameter servers serve inside gradsync, never in the user's code: no gate there.
        between = limits.between_steps_timeout_s
        gate = (
            StepGate(
                watch,
                watch.timeout_s,
                between,
                group_size=limits.gate_group_size,
                make_server=_gate_group_server,
            )
            if self.world_size > 1 and between is not None and not self.strategy.servers
            else None
        )
        return group_timeout, watch, gate

    def _make_checkpointer(self) -> Checkpointer:
        """The saves and loads of this rank (``gradsync.checkpoint``), given the loop's parts."""
        group, model, optimizer = self.group, self.model, self.optimizer
        return Checkpointer(
            rank=self.rank,
            world_size=self.world_size,
            layout=self.layout,
            group=group,
            strategy=self.strategy,
            model=model,
            optimizer=optimizer,
            compression=self.compressor.spec,
            timeout_s=self.timeout_s,
            watch=self._watch,
            collector=self._collector,
            step=lambda: self._step,
            sync_state=self.state_dict,
            load_sync_state=self.load_state_dict,
        )

    def _say_nothing_compressed(self) -> None:
        """Under ``allreduce="hierarchical"`` only the hosts' leaders compress, across hosts:
        on one host nothing crosses, so the compressor sends nothing and the run is the exact
        one (a user tester's int8 run ended bitwise equal to plain bsp, silently)."""
        if self.rank == 0:
            warnings.warn(
                f"gradsync: allreduce='hierarchical' on one host: compression="
                f"{self.compressor.spec!r} compresses only what crosses hosts, and nothing does "
                "here, so every exchange is exact and uncompressed; drop "
                "allreduce='hierarchical' to compress within the host",
                RuntimeWarning,
                stacklevel=4,
            )

    def _setup_strategy(self) -> None:
        """Collective: the gate, the model check, the initial broadcast and the strategy's
        setup; a failure releases the collective timeout and the heartbeat."""
        exchange = self.options.exchange
        try:
            self._pass_gate(START, "construction of the Synchronizer")
            self._check_same_model()
            self._broadcast_initial_state()
            if exchange.allreduce == "hierarchical" and self.world_size > 1:
                self._hierarchy = Hierarchy(self.group, self.timeout_s)
                if len(self._hierarchy.leaders) == 1 and self.compressor.spec != "none":
                    self._say_nothing_compressed()
            self._membership = self._join_membership()
            self._context = SyncContext(
                model=self.model,
                optimizer=self.optimizer,
                group=self.group,
                compressor=self.compressor,
                bucket_mb=exchange.bucket_mb,
                record_spans=self.record_spans,
                skip_nonfinite=self.options.checks.skip_nonfinite,
                watch=self._watch,
                register_checkpoint_hooks=self._checkpoints.register_hooks,
                layout=self.layout,
                rank=self.rank,
                scaler=self.scaler,
                gate=self._gate,
                before_collective=self._join_gate,
                collective_ready=self._gate_open,
                hierarchy=self._hierarchy,
                membership=self._membership,
                find_unused_parameters=self._finds_unused(exchange.find_unused_parameters),
            )
            self.strategy.setup(self._context)
            self._checkpoints.check_strategy()
        except BaseException:
            # what the strategy put on the user's model or optimizer (hooks, ZeRO's rows
            # layout) is taken off, so that a retry builds on them as they were
            with contextlib.suppress(Exception):
                self.strategy.close()
            self._release_timeout()
            if self._membership is not None:
                self._membership.close()
            raise

    def _finds_unused(self, asked: bool) -> bool:
        """``find_unused_parameters``, where the strategy honours it; said where it does not
        (a script ported from DDP keeps its flag under any strategy, as the front door's)."""
        live = self._membership is not None  # the flags would cover this replica group only
        if not asked or (self.strategy.drops_unused_gradients and not live):
            return asked
        if self.rank == 0:
            where = "membership='torchft'" if live else self.strategy.name
            warnings.warn(
                f"gradsync: find_unused_parameters=True is honoured under bsp; under {where} "
                "a parameter that no rank used gets a zero gradient (an optimizer with "
                "momentum or weight decay still moves it)",
                RuntimeWarning,
                stacklevel=4,
            )
        return False

    def _join_membership(self) -> Any:
        """Under ``membership="torchft"``: this replica group's torchft Manager, which heals a
        replacement with what a checkpoint would give it (``ReplicaState``); else None."""
        if self._live is None:
            return None
        from gradsync.membership.ft_manager import ReplicaState, TorchftMembership

        state = ReplicaState(
            model=self.model,
            optimizer=self.optimizer,
            strategy=self.strategy,
            sync_state=self.state_dict,
            load_sync_state=self.load_state_dict,
            registry=self._checkpoints.registry,
        )
        run = self._run
        membership = TorchftMembership(
            self._live,
            state,
            timeout_s=self.timeout_s,
            group=self.group,
            on_healed=run.healed if run is not None else None,
            on_step=run.quorum if run is not None else None,  # membership.jsonl
        )
        if run is not None:
            run.wait_for_groups()  # every group's Manager up before the first quorum
        return membership

    @property
    def _broadcasts_buffers(self) -> bool:
        """DDP broadcasts buffers from rank 0 at the first forward after a gradient-syncing one:
        once per step, at its first micro-batch. The start of the step block is the same
        point."""
        return (
            self.options.exchange.broadcast_buffers
            and self.world_size > 1
            and self.strategy.replicates_every_step
        )

    # The settings by the names they had before the option groups (``self.options`` holds
    # them): read-only.
    @property
    def timeout_s(self) -> float:
        """``options.limits.timeout_s``, resolved: the bound on gradsync's own waits."""
        timeout_s = self.options.limits.timeout_s
        assert timeout_s is not None  # resolved() filled it in
        return timeout_s

    @property
    def allreduce(self) -> str:
        """``options.exchange.allreduce``."""
        return self.options.exchange.allreduce

    @property
    def accumulation(self) -> Literal["mean", "sum"]:
        """``options.exchange.accumulation``."""
        return "sum" if self.options.exchange.accumulation == "sum" else "mean"

    @property
    def telemetry_enabled(self) -> bool:
        """Whether steps are timed and records gathered (``telemetry=False`` turns it off)."""
        return self.options.telemetry is not None

    @property
    def record_spans(self) -> bool:
        """``options.telemetry.record_spans`` (False with telemetry off)."""
        return self.options.telemetry is not None and self.options.telemetry.record_spans

    @property
    def check_every(self) -> int:
        """``options.checks.check_every``: steps between replica checks (0: none)."""
        return self.options.checks.check_every

    @classmethod
    def _arrival_scope(cls, group: dist.ProcessGroup | None) -> str:
        name = str(getattr(group, "group_name", "")) if group is not None else ""
        n = cls._created.get(name, 0)
        cls._created[name] = n + 1
        return "/".join(part for part in (name, str(n) if n else "") if part)

    def _make_balancer(self, balance: bool | ShardBalancer) -> ShardBalancer | None:
        if balance is False:
            return None
        if not self.strategy.weights_samples:
            raise UsageError(
                f"balance needs bsp, zero:1 or zero:2 (got {self.strategy.name}): "
                "other strategies do not average one global batch per step"
            )
        if isinstance(balance, ShardBalancer):
            if balance.world_size != self.world_size:
                raise UsageError(
                    f"ShardBalancer is for {balance.world_size} ranks, the group has "
                    f"{self.world_size}"
                )
            return balance
        return ShardBalancer(self.world_size)

    def _on_gathered(self, records: list[StepRecord]) -> None:
        # Every rank sees the same gathered records, so balancers stay in agreement.
        if self.balancer is not None:
            self.balancer.observe(records)
        if self._run is not None and self._run.sink is not None:
            self._run.sink(records)
        sink = self.options.telemetry.on_records if self.options.telemetry else None
        if sink is not None:
            sink(records)

    def shard_sizes(self, global_batch: int) -> list[int]:
        """With ``balance``: how many samples of this step's global batch each rank takes (the
        same list on every rank). Call it before each step; the step weights this rank's
        gradient by its share so the update stays the mean over the whole global batch."""
        if self.balancer is None:
            workers = self.num_workers  # parameter servers take no samples
            if global_batch % workers:
                raise UsageError(
                    f"global batch {global_batch} does not split evenly over {workers} "
                    "workers; pass balance=True for uneven shards"
                )
            return [global_batch // workers] * workers
        self._sizes = self.balancer.sizes(global_batch)
        return list(self._sizes)

    @property
    def attached_run(self) -> AttachedRun | None:
        """The run directory this Synchronizer writes (``run_dir``), or None."""
        return self._run

    @property
    def watch(self) -> ArrivalWatch:
        """The timeout diagnosis every synchronizing wait of this Synchronizer goes through."""
        return self._watch

    @property
    def is_server(self) -> bool:
        """True on parameter-server ranks: call ``serve()`` there instead of training."""
        return self.layout.role(self.rank) == "server"

    @property
    def num_workers(self) -> int:
        """Ranks that train (all of them, except parameter servers)."""
        return self.layout.workers

    def serve(self) -> Any:
        """On a parameter-server rank: serve until every worker is done, then take part in the
        final telemetry gather. Returns the server's statistics (``ServerStats``).

        When the workers call ``save()``, the server writes its own part of that checkpoint
        from here; after ``load()`` on this rank, it starts from the loaded state."""
        role = self.strategy.server_role()
        if role is None or not self.is_server:
            raise UsageError("serve() is for parameter-server ranks (ssp:S or async strategies)")
        self._enter_gradsync()  # a server runs gradsync's waits only, until the end
        checkpoints = self._checkpoints
        if "flush" in inspect.signature(role.serve).parameters:
            serve: Any = role.serve  # ``ServerRole.serve`` may take ``flush`` (its docstring)
            stats = serve(checkpoints.save_server, flush=checkpoints.flush_server)
        else:
            stats = role.serve(checkpoints.save_server)
        checkpoints.flush_server()  # the workers' last checkpoint, held: written now
        if self.check_every and not self._final_checked:
            self._final_checked = True
            self._check_replicas(-1, final=True)
        self._final_flush()
        self._final_handshake()
        if self._run is not None:  # report.json; each rank appends its own spans
            self._write_own_spans()
            self._run.finish(RunReport.from_records(self._collector.records), None)
        return stats

    @property
    def step_count(self) -> int:
        """Steps completed so far."""
        return self._step

    @contextmanager
    def step(self, micro_batches: int = 1, samples: int = 0) -> Iterator[StepHandle]:
        """One superstep. The block runs ``micro_batches`` backward passes; gradients accumulate
        locally and are averaged over the ranks and, with ``accumulation="mean"``, over the
        micro-batches too; communication starts on the last."""
        self._check_step_call(micro_batches)
        weight, samples = self._sample_weight(samples)
        self._check_no_outside_update()
        if self._run is not None:
            self._run.before_step(self._step)  # a --kill due at this step
        handle, ready = self._new_handle(micro_batches, samples)
        self._in_step = True
        self._watch.enter(BLOCK, self._step)
        leaving = False  # a KeyboardInterrupt or SystemExit ends the block
        try:
            self._settle_gate()  # the wait of a step a KeyboardInterrupt left, if caught
            gated = self.strategy.gate_at(self._step) if self._ahead is not None else None
            if self._ahead is not None and gated is not None:
                # Joined before the step's first collective: the forward hides its round trips.
                self._ahead.arm(self._step, gated)
            else:
                if self.strategy.replicates_every_step:
                    self._pass_gate(self._step, "the step")
                self._enter_gradsync()
            wall0, t0 = time.time(), time.perf_counter()
            self._gate_waited = 0.0
            self._mark_start()
            slept = self._begin(micro_batches, weight)
            # a replacement that healed in _begin (live membership) took its peer's step
            handle.step = ready._step = self._step
            if self._run is not None:
                self._run.began(self._step)  # the records a load left until this quorum
            in_block = (
                self._watch.in_block(self._step, "the step's forward and backward collectives")
                if self.strategy.collectives_in_block
                else contextlib.nullcontext()
            )
            try:
                with in_block:
                    yield handle
            except Exception as exc:
                self._abandon(handle, ready, exc, wall0, t0)
                raise
            t1 = time.perf_counter()
            # the block's own optimizer.step() calls: the update below would be a second one
            stepped_in_block = self._optimizer_steps - self._expected_steps
            # The gate's wait joined inside the block (before its first collective) was a wait
            # for peers still in their own code, an evaluation on rank 0 say: sync time. In
            # compute it made the waiting rank look like the one that set the pace. (A join
            # inside synchronize() is in its seconds already.)
            waited = self._gate_waited - ready.gate_waited_in_call
            self._mark_block_end()
            self._join_gate()  # where the strategy posted nothing in the block
            outcome = ready.outcome()
            with compat.annotate("gradsync.update"):
                outcome = self.strategy.update(self._step, outcome)
            self._expected_steps = self._optimizer_steps
            # A synchronize() inside the block waited for the exchange, and a strategy's
            # collectives in the block (zero:3) waited for the peers: that is sync time.
            sync_in_block = ready.seconds_in_block + waited
            self._natural = t1 - t0 - sync_in_block - outcome.comm_in_block - slept
            self._end_step(handle, outcome, wall0, t0, t1, sync_in_block)
            if stepped_in_block:
                # Raised once the step is complete on every rank (its collectives in step).
                where = f"inside step {handle.step}'s sync.step() block"
                raise _stepped_twice(stepped_in_block, where, "inside")
        except BaseException as exc:
            leaving = not isinstance(exc, Exception)
            if leaving:
                with contextlib.suppress(Exception):  # the interrupt is what propagates
                    self.strategy.interrupted()
            raise
        finally:
            self._in_step = False
            handle._ready = None
            if not leaving:
                self._settle_gate()
            self._back_to_user()

    def _new_handle(self, micro_batches: int, samples: int) -> tuple[StepHandle, _GradientReady]:
        """The handle a step's block gets, and what tells it when the gradients are ready."""
        handle = StepHandle(step=self._step, micro_batches=micro_batches, samples=samples)
        ready = _GradientReady(self.strategy, self._step, self._clock, lambda: self._gate_waited)
        handle._ready = ready
        handle._params = self._trainable
        handle._strategy = self.strategy
        return handle, ready

    def _check_step_call(self, micro_batches: int) -> None:
        """What a ``sync.step()`` call is refused for before anything happens: a closed
        Synchronizer, a bad ``micro_batches``, a block inside another, no process group."""
        self._check_open("sync.step()")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise UsageError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
        if self._in_step:
            raise UsageError("sync.step() blocks cannot be nested")
        runtime.require_initialized("sync.step()")

    def _sample_weight(self, samples: int) -> tuple[float, int]:
        """This rank's gradient weight and sample count for the step about to begin."""
        if self.balancer is None:
            return 1.0, samples
        if self._sizes is None:
            raise UsageError(
                "balance=True: call sync.shard_sizes(global_batch) before each step and "
                "take that many samples on this rank"
            )
        sizes, self._sizes = self._sizes, None
        weight = sizes[self.rank] * self.world_size / sum(sizes)
        return weight, samples or sizes[self.rank]

    def _begin(self, micro_batches: int, weight: float) -> float:
        """The begin-step phase (buffers, the strategy's own); returns the injected sleep."""
        plan = StepPlan(
            step=self._step,
            micro_batches=micro_batches,
            accumulation=self.accumulation,
            sample_weight=weight,
        )
        with compat.annotate("gradsync.begin_step"):
            # Read each step, as DDP does: a module may have replaced a buffer since.
            syncs = self._has_buffers and self._broadcasts_buffers
            buffers = list(self.model.buffers()) if syncs else []
            if buffers:
                self._join_gate()
                self._broadcast(buffers, self._step, "buffer broadcast")
            self.strategy.begin_step(plan)
        if not self.slowdowns:
            return 0.0
        return apply_slowdowns(self.slowdowns, self.rank, self._step, self._natural)

    def _end_step(
        self,
        handle: StepHandle,
        outcome: StepOutcome,
        wall0: float,
        t0: float,
        t1: float,
        sync_in_block: float,
    ) -> None:
        """Telemetry, the step count and the periodic divergence check, after the update."""
        t2 = time.perf_counter()
        sync_in_block += outcome.comm_in_block
        # Floored: the waits subtracted are timed apart (the gate's join, synchronize(), a
        # strategy's collectives in the block) and a nested call may be in two of them for a
        # few microseconds; a negative duration would fail every reader of the records.
        sync_in_block = min(sync_in_block, t1 - t0)
        compute, sync = t1 - t0 - sync_in_block, t2 - t1 + sync_in_block
        marks, self._marks = self._marks, None
        if marks is not None and self._clock is not None:
            marks.step_end = self._clock.mark()
            # The exchange's share of the block, as device time where synchronize() ran in it
            # (its host wait also covers the backward still queued); a strategy's collectives
            # in the block (zero:3) stay host-timed.
            ready = handle._ready
            marks.in_block_wait = ready.device_wait if isinstance(ready, _GradientReady) else None
            marks.in_block_sync = outcome.comm_in_block if marks.in_block_wait else sync_in_block
        self._verdict_of(handle, outcome)
        if self.telemetry_enabled:
            if self.record_spans:  # first: a gather in _record writes them up to this step
                self._add_spans(outcome.spans, wall0, compute, sync)
            self._record(handle, wall0, compute, sync, outcome, marks)
        if self._verdicts.due():  # where telemetry is off, or gathers only at the end
            self._read_verdicts()
        self._step += 1
        self._stepped_here = True
        if self.check_every and self._step % self.check_every == 0:
            self._check_replicas(self._step - 1)

    def _verdict_of(self, handle: StepHandle, outcome: StepOutcome) -> None:
        """Tell ``handle`` whether its step was skipped, and why where a rank's block raised;
        a verdict still on the device is held and read later with others (``_verdicts``)."""
        why = self._skip_reason if self.world_size > 1 else None
        if outcome.found_inf is None:
            handle._why_skipped = why
            handle._settle(outcome.skipped)
            return
        handle._found_inf, handle._why_skipped = outcome.found_inf, why
        self._verdicts.add(outcome.found_inf, handle._settle)

    def _read_verdicts(self) -> None:
        """Read the verdicts held on the device, in one copy (``checks.verdicts``)."""
        self._verdicts.read()

    def _abandon(
        self, handle: StepHandle, ready: _GradientReady, exc: Exception, wall0: float, t0: float
    ) -> None:
        """This rank's block raised ``exc``: leave word for the peers, take part in the step's
        exchange so that every rank skips it together, and count the step, so that training
        goes on in step on every rank if the exception is caught. Failures here become notes
        on ``exc``, which the caller re-raises."""
        step = handle.step
        text = f"{type(exc).__name__}: {exc}".strip()
        self._watch.note_failure(step, text[:500])
        t1 = time.perf_counter()
        self._mark_block_end()
        try:
            outcome = ready.abandoned()
            outcome = self.strategy.update(step, outcome)
            self._expected_steps = self._optimizer_steps
            self._end_step(handle, outcome, wall0, t0, t1, ready.seconds_in_block)
        except Exception as inner:  # noqa: BLE001 - the user's exception is the one to raise
            exc.add_note(
                f"gradsync: step {step} could not be completed for the other ranks after this "
                f"exception: {type(inner).__name__}: {inner}"
            )

    def _skip_reason(self, step: int) -> str | None:
        """Why every rank skipped ``step``, when a rank's block raised (its failure note)."""
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            failed = self._watch.failure_of(rank)
            if failed is not None and failed[0] == step:
                reason = f"rank {rank}'s step {step} block raised {failed[1]}"
                warnings.warn(
                    f"gradsync: step {step} skipped on every rank: {reason}",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return reason
        return None

    def _pass_gate(self, step: int, what: str) -> None:
        """Wait (in the store) until every rank is back from its own code; see checks.gate."""
        if self._gate is not None:
            self._gate.ensure(step, what)

    def _join_gate(self) -> None:
        """Before gradsync's collectives of a step: the gate's wait armed at the block's entry
        has ended (its ``SyncTimeoutError`` otherwise), and ``timeout_s`` bounds them from here
        (``checks.gate_ahead``). Cheap once joined: strategies call it before every collective."""
        if self._ahead is not None:
            started = time.perf_counter()
            self._ahead.join()
            self._gate_waited += time.perf_counter() - started
            self._enter_gradsync()

    def _gate_open(self) -> bool:
        """Whether ``_join_gate`` would return at once: the gate's wait armed at the block's
        entry has ended (its error raised then, as the join raises it). Asked at each
        gradient's hook under ``bsp``, so that a bucket ready before a late peer arrives waits
        for a later hook, or the block's end, to be posted, and the backward pass goes on."""
        if self._ahead is None:
            return True
        if not self._ahead.poll():
            return False
        self._enter_gradsync()
        return True

    def _settle_gate(self) -> None:
        """At the end of a block that raised before joining: let the armed wait end, so that
        the thread is free for the next step (its error is the block's to report, not this).
        Not while a KeyboardInterrupt or SystemExit unwinds the block: a peer interrupted too
        never arrives, so the wait would last the gate's whole bound (and a Ctrl-C'd worker
        outlive the launcher's grace); a step begun after one was caught settles it first."""
        if self._ahead is not None and self._ahead.pending:
            with contextlib.suppress(Exception):
                self._ahead.join()

    def _enter_gradsync(self) -> None:
        """gradsync's collectives follow: ``timeout_s`` bounds them."""
        if self._group_timeout is not None:
            self._group_timeout.enter()

    def _back_to_user(self) -> None:
        """Control returns to the user's code: their collective timeout, and a gate before
        gradsync's next collective."""
        self._watch.enter(BETWEEN, self._step - 1 if self._step else START)
        if self._gate is not None:
            self._gate.left()
        if self._group_timeout is not None:
            self._group_timeout.leave()

    @contextmanager
    def _gradsync_call(self, step: int, what: str) -> Iterator[None]:
        """A collective API call made between steps (save, load, report): gate, then
        ``timeout_s``, then back to the user."""
        self._watch.enter(BLOCK, step, what)
        self._calls += 1
        try:
            self._pass_gate(step, what)
            self._enter_gradsync()
            yield
        finally:
            self._calls -= 1
            self._back_to_user()

    @property
    def busy(self) -> bool:
        """Inside a step block or one of gradsync's own API calls (``save``, ``report``,
        ``full_state_dict``, ...): what touches the model now is gradsync's doing."""
        return self._in_step or self._calls > 0

    def _count_optimizer_step(self, *_: Any) -> None:
        self._optimizer_steps += 1

    def _check_no_outside_update(self) -> None:
        extra = self._optimizer_steps - self._expected_steps
        if extra:
            self._expected_steps = self._optimizer_steps
            raise _stepped_twice(extra, f"after step {self._step - 1}'s block exited", "after")

    def _check_replicas(self, step: int, final: bool = False) -> None:
        """Collective every ``check_every`` steps (and at the end): compare fingerprints. The
        periodic check compares those it posted a period before and posts this step's
        (``checks.divergence_behind``); the final one compares at once."""
        with compat.annotate("gradsync.divergence_check"):
            self._check_unfrozen()
            self._take_posted_check()
            if not self.strategy.replicas_identical(step, final):
                return
            if not final:
                workers = list(range(self.num_workers))
                named: list[tuple[str, torch.Tensor]] = list(self.model.named_parameters())
                self._posted_check = divergence_behind.post(named, self.group, step, workers)
                if self._posted_check is not None:
                    return
            self._compare_fingerprints(step, final)

    def _check_unfrozen(self) -> None:
        """``UsageError`` naming a parameter frozen when the Synchronizer was built and
        trainable now: its gradient is no strategy's to exchange (the plan, the hooks and the
        shards were made without it), so each rank would step it on its own gradient and the
        replicas drift apart, which the divergence check would report only as a difference.
        Checked at the divergence check's steps (``check_every``) and the end, not at every
        step: a walk of the model's parameters costs every step of a large model."""
        if not self._frozen_at_build:
            return
        for name, p in self.model.named_parameters():
            if p.requires_grad and id(p) in self._frozen_at_build:
                raise UsageError(
                    f"parameter {name!r} was frozen (requires_grad=False) when the Synchronizer "
                    "was built and trains now: gradsync does not exchange its gradient, so "
                    "every rank steps it on its own and the replicas drift apart. Set "
                    "requires_grad as training will need it before building the Synchronizer, "
                    "or close() it and build a new one after unfreezing (docs/porting.md)"
                )

    def _take_posted_check(self) -> None:
        """Compare the fingerprints the last periodic check posted, if any."""
        posted, self._posted_check = self._posted_check, None
        if posted is None:
            return
        what = f"divergence check posted after step {posted.step} (fingerprint gather)"
        prints = self._watch.run(posted.step, what, lambda: divergence_behind.fingerprints(posted))
        divergence_behind.compare(posted, prints)

    def _compare_fingerprints(self, step: int, final: bool) -> None:
        workers = list(range(self.num_workers))
        what = "final divergence check" if final else "divergence check"
        what += " (fingerprint gather)"

        def run(gather: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
            return self._watch.run(END if final else step, what, gather)

        check_replicas(
            list(self.model.named_parameters()), self.group, step, workers, run=run, final=final
        )

    def _mark_start(self) -> None:
        if self._clock is not None:
            self._marks = StepMarks(self._clock.mark())

    def _mark_block_end(self) -> None:
        if self._marks is not None and self._clock is not None:
            self._marks.block_end = self._clock.mark()

    def _record(
        self,
        h: StepHandle,
        wall0: float,
        compute: float,
        sync: float,
        out: StepOutcome,
        marks: StepMarks | None = None,
    ) -> None:
        self._collector.add(
            h.step,
            wall0,
            compute,
            sync,
            h.samples,
            self._bytes_sent(out),
            h.loss,
            out.skipped if out.found_inf is None else out.found_inf,
            out.barrier,
            out.idle,
            marks,
        )
        if self._collector.due() and not self.strategy.barrier_free:
            self._read_verdicts()  # at the same step: the host waits for the device once
            with compat.annotate("gradsync.telemetry_gather"):
                self._collector.flush_behind(h.step)
            self._write_own_spans()  # kept if this attempt dies: records come back, spans not

    def _bytes_sent(self, out: StepOutcome) -> int:
        """The step's payload bytes, none in a world of one: its collectives are no-ops that
        send nothing, so a one-rank run reports 0 MB sent, not the gradient's size (under live
        membership a group of one still sends to the other groups)."""
        alone = self.world_size == 1 and self._membership is None
        return 0 if alone else out.bytes_sent

    def _add_spans(self, spans: list[Span], wall0: float, compute: float, sync: float) -> None:
        step = self._step
        added = [
            Span(self.rank, step, "compute", wall0, compute, "step"),
            Span(self.rank, step, "sync", wall0 + compute, sync, "step"),
        ]
        for s in spans:
            s.rank, s.step = self.rank, step
            added.append(s)
        self.spans += added
        if self._run is not None:
            self._unwritten_spans += added

    def _write_own_spans(self) -> None:
        """This rank's spans not written yet, into the run directory by this rank alone."""
        if self._run is None or not self._unwritten_spans:
            return
        spans, self._unwritten_spans = self._unwritten_spans, []
        run = self._run
        self._write_own("its timeline spans", lambda: run.write_own_spans(spans))

    def _write_own(self, what: str, write: Callable[[], None]) -> None:
        """``write()`` this rank's ``what`` into the run directory; a failure is warned of,
        not raised: the run directory is gone or full, the run itself is not."""
        assert self._run is not None
        try:
            write()
        except OSError as exc:
            warnings.warn(
                f"gradsync: rank {self.rank}: could not write {what} into "
                f"{self._run.directory}: {exc}",
                RuntimeWarning,
                stacklevel=3,
            )

    def flush_telemetry(self) -> list[StepRecord]:
        """Collective: gather pending step records from every rank now."""
        if not self.telemetry_enabled:
            return []
        with self._gradsync_call(self._step, "telemetry gather"):
            return self._collector.flush()

    def _final_flush(self) -> None:
        # Positioned after every step, like the final check: see gradsync.checks.diagnose.
        if self.telemetry_enabled:
            self._collector.flush(END)

    def _final_handshake(self) -> None:
        """Collective: the last one of ``report()`` and ``serve()``, a barrier every rank meets
        after its final collectives, so no rank leaves while a peer still talks to it.

        Its Work is also what makes exiting safe. gloo runs collectives on its own threads; the
        thread that drops a finished collective's last reference frees its tensors, and freeing
        a tensor Python knows needs the GIL. If that happens after the interpreter began to shut
        down, the thread is killed mid-destructor and the process aborts ("terminate called
        without an active exception", SIGABRT), typically under torchrun, where nothing
        destroys the group before exit. A gloo barrier holds weak references to every
        collective still queued or in progress when it is posted, so none of them is freed
        before the barrier itself is; collectives that finished earlier were freed before it was
        posted. Keeping the barrier's Work referenced until the exit has waited for it
        (``exit_safety.keep``; a later handshake replaces it, on this thread, after its own
        barrier is posted) thus leaves no tensor for a gloo thread to free at exit."""
        if self.world_size == 1:
            return
        work = dist.barrier(group=self.group, async_op=True)
        assert work is not None
        self._watch.run(END, "final handshake (barrier)", work.wait)
        exit_safety.keep("final handshake", work)

    def gather_spans(self) -> list[Span] | None:
        """Collective, after ``report()``: every rank's timeline spans (``record_spans=True``),
        on rank 0; None on the other ranks. It ends on a final handshake of its own, as
        ``report()`` does, so exiting right after it stays safe."""
        gathered: list[list[Span] | None] = [None] * self.world_size
        if self.world_size == 1:
            gathered[0] = list(self.spans)
        else:
            self._watch.run(
                END,
                "gather of timeline spans to rank 0",
                lambda: dist.all_gather_object(gathered, self.spans, group=self.group),
            )
            self._final_handshake()
        if self.rank != 0:
            return None
        return [span for part in gathered for span in part or []]

    def report(self) -> RunReport:
        """Collective (every rank calls it): per-rank, per-step timings and totals so far.

        With a parameter server this ends training: workers fetch the final parameters."""
        self._check_no_outside_update()
        self._read_verdicts()
        with self._gradsync_call(END, "report()"):
            with compat.annotate("gradsync.finalize"):
                self.strategy.finalize()
            self.finalized_at = self._step
            if self.check_every and not self._final_checked:
                self._final_checked = True
                self._check_replicas(self._step - 1, final=True)
            self._final_flush()
            self._final_handshake()
        report = RunReport.from_records(self._collector.records)
        if self._membership is not None and self._run is not None and self.rank == 0:
            self._record_final_model(self._run.directory)
        if self._run is not None:  # report.json; each rank appends its own spans
            self._write_own_spans()
            self._run.finish(report, self.strategy.summary())
        return report

    def _record_final_model(self, directory: Path) -> None:
        """This replica group's final model, by its rank 0 at the end of ``report()``: a short
        digest of its parameters' fingerprint, which ``gradsync run``'s summary compares
        across groups (docs/membership.md, "Final models"). No collective: a group cut off
        from the others, which is what makes the models differ, records its own all the
        same."""
        from gradsync.attached_run import restart_count
        from gradsync.checks.guards import fingerprint
        from gradsync.telemetry.membership import model_digest, write_final_model

        rows = fingerprint(list(self.model.named_parameters()))
        digest = model_digest(rows.numpy().tobytes())
        write_final_model(directory, step=self._step, fingerprint=digest, restart=restart_count())

    def state_dict(self) -> dict[str, Any]:
        """Strategy and compressor state (not the model or optimizer: save those as usual)."""
        return {"step": self._step, "strategy": self.strategy.state_dict()}

    def save(
        self, directory: str | Path, *, keep: int = 2, wait: bool = True, **extra: Any
    ) -> float:
        """Collective: checkpoint model, optimizer, strategy/compressor state, RNG and the
        step records not yet gathered into ``directory`` (atomic, checksummed, last ``keep``
        kept); ``extra`` holds plain values such as the data position. Returns the seconds it
        took on this rank. With parameter servers the workers call it (after the same step)
        and the servers, inside ``serve()``, write their part.

        ``wait=False`` returns as soon as the state is copied: a background thread writes the
        file and rank 0's commits the checkpoint once every rank's file is on disk, so a
        checkpoint can be taken every step. Until then the newest complete checkpoint is an
        earlier one. ``close()`` (and ``wait_for_checkpoints()``) wait for the writes; errors
        of the background thread are raised by the next ``save``, ``wait_for_checkpoints`` or
        ``close``. With ``wait=True`` the checkpoint is complete when this returns."""
        if not wait:  # posts no collective, so no gate either: a copy and a hand-over
            self._calls += 1  # still gradsync's own call (the front door's warnings)
            try:
                return self._checkpoints.save(directory, keep=keep, extra=extra, wait=False)
            finally:
                self._calls -= 1
        with self._gradsync_call(self._step, "sync.save()"):
            return self._checkpoints.save(directory, keep=keep, extra=extra, wait=True)

    def wait_for_checkpoints(self, timeout_s: float | None = None) -> None:
        """Until every checkpoint this rank saved is written (and, on rank 0, committed).

        With a checkpoint every step under ``bsp`` or ``zero:N``, the newest snapshots are
        held in memory rather than written (docs/checkpoints.md, "Held snapshots"): call it on
        every rank then, as ``load`` and ``close`` are; rank 0 alone would wait for its peers'
        files of the newest step and fail after ``timeout_s`` naming the ranks missing."""
        self._checkpoints.wait(timeout_s)

    def register_state(
        self,
        key: str,
        state_fn: Callable[[], Any],
        load_fn: Callable[[Any], Any],
        *,
        replicated: bool = False,
    ) -> None:
        """Save ``state_fn()`` under ``key`` with every checkpoint of this rank, and call
        ``load_fn(saved)`` in ``load()`` once the model and optimizer are restored: e.g.
        ``sync.register_state("scheduler", sched.state_dict, sched.load_state_dict,
        replicated=True)``. The state holds tensors, numbers, strings and containers of them.
        ``replicated``: the same on every rank, so a resume on another number of ranks loads
        rank 0's (other entries are per rank, and are then not restored, with a warning).
        Register on every rank, before ``load()``. See ``gradsync.checkpoint.registry``."""
        self._checkpoints.registry.register(key, state_fn, load_fn, replicated=replicated)

    def unregister_state(self, key: str) -> None:
        """Stop saving ``key``'s registered state (``register_state``)."""
        self._checkpoints.registry.unregister(key)

    def load(self, directory: str | Path) -> dict[str, Any] | None:
        """Collective: resume from the newest intact checkpoint in ``directory``; returns its
        extras plus ``step`` (the next step to run), or None when there is no checkpoint.
        With parameter servers every rank calls it, servers before ``serve()``."""
        self._check_open("sync.load()")
        if not isinstance(directory, str | Path):
            raise UsageError(
                f"sync.load() takes the checkpoint directory as a str or Path, got {directory!r}"
            )
        if Path(directory).is_file():  # a file holds no checkpoint: None would say "none yet"
            raise UsageError(
                f"sync.load({str(directory)!r}): a file, not a checkpoint directory; pass the "
                "directory sync.save() was given (it holds step-NNNNNN/ directories)"
            )
        if self._stepped_here and self.layout.workers < self.world_size:
            # its servers are in serve() now, which loads nothing: the collective would wait
            # for them until timeout_s and then fail with a raw error of the backend
            raise UsageError(
                "sync.load() after this worker's first step: under a parameter-server strategy "
                "the servers load only before serve(), so every rank calls sync.load() before "
                "training starts (servers before serve())"
            )
        with self._gradsync_call(self._step, "sync.load()"):
            if self._run is not None:
                self._run.loading()
            extra = self._checkpoints.load(directory)
            if extra is not None and self._context is not None:
                # the optimizer's state is the checkpoint's, which may predate its first applied
                # update (fused SGD's momentum then made by a device-skipped step): the host
                # decides again until an update is applied (every rank loads: they agree)
                self._context.applied_once = False
            if self.telemetry_enabled:
                # The records restored from the checkpoint are gathered now, while every rank
                # is here: their number differs between ranks after a resume on more ranks
                # (a new rank has none), and the periodic gathers, which come after a fixed
                # number of pending records, must come after the same steps on every rank.
                self._collector.flush(self._step)
                if extra is not None:
                    self._collector.rolled_back_to(int(extra["step"]))
            # the spans of the steps that run again go, from here and (rank 0's ``loaded``,
            # after the gather above: every rank's earlier spans are written) from the file
            self.spans = [s for s in self.spans if s.step < self._step]
            self._unwritten_spans = [s for s in self._unwritten_spans if s.step < self._step]
            if self._run is not None:
                self._run.loaded(self._step, until_quorum=self._membership is not None)
            return extra

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise UsageError(
                f"{what} after sync.close(): this Synchronizer is closed (its strategy and "
                "timeouts released); make a new gs.Synchronizer to train on"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = int(state["step"])
        self.strategy.load_state_dict(state["strategy"])

    def close(self) -> None:
        """Wait for the checkpoints still being written, then release what this holds. Posts
        no collective (it may follow an exception on one rank): step records not gathered yet,
        up to twice ``telemetry_every`` steps, are gathered by ``report()`` only."""
        self._closed = True
        try:
            self._checkpoints.close()
        finally:
            if self._run is not None:
                status = ending_status()  # an error this close() follows: FAILED
                self._write_own_records(status)
                self._run.close(status)
            self._close()

    def _write_own_records(self, status: str) -> None:
        """This rank's step records that no gather took (closed or ended without
        ``report()``), and its spans not written yet, into the run directory by this rank
        alone: no collective. ``status``: how the attempt ended, for rank 0's trackers."""
        if self._run is None or not self.telemetry_enabled:
            return
        run, pending = self._run, self._collector.take_own_pending(self.rank)
        self._write_own("its last step records", lambda: run.write_own_records(pending, status))
        self._write_own_spans()

    def _close(self) -> None:
        self._collector.hold_in_flight()
        if self._posted_check is not None:  # its tensors and Work outlive the backend thread
            exit_safety.keep("divergence check in flight", self._posted_check)
            self._posted_check = None
        self._step_hook.remove()
        self.strategy.close()
        if self._hierarchy is not None:
            self._hierarchy.close()
        if self._membership is not None:
            self._membership.close()
        self._release_timeout()

    def _release_timeout(self) -> None:
        """Stop the heartbeat thread; give the group back the collective timeout it had before
        this Synchronizer."""
        if self._ahead is not None:
            self._ahead.stop()
        if self._gate is not None:
            self._gate.close()
        self._watch.stop()
        if self._group_timeout is not None:
            self._group_timeout.restore()

    def _check_same_model(self) -> None:
        """Collective: every rank built the same model (names, shapes, dtypes, trainability).
        Otherwise the initial broadcast would abort inside the backend (shapes), hang (a
        different number of tensors) or, worse, train (a transposed weight of the same size)."""
        if self.world_size == 1:
            return
        mine = model_signature(self.model)
        digest = hashlib.sha256(repr(mine).encode()).digest()[:8]
        fingerprint = torch.tensor(
            [int.from_bytes(digest, "little", signed=True)], device=runtime.device()
        )
        everyone = [torch.zeros_like(fingerprint) for _ in range(self.world_size)]
        what = "model check (a fingerprint of every rank's parameter names and shapes)"
        self._watch.run(
            START, what, lambda: dist.all_gather(everyone, fingerprint, group=self.group)
        )
        if all(torch.equal(f, everyone[0]) for f in everyone):
            return
        signatures: list[Any] = [None] * self.world_size
        self._watch.run(
            START, what, lambda: dist.all_gather_object(signatures, mine, group=self.group)
        )
        raise UsageError(describe_model_mismatch(signatures))

    def _broadcast_initial_state(self) -> None:
        if self.world_size == 1:
            return
        save_id = self._checkpoints.save_id
        token = torch.tensor([int(save_id, 16) - (1 << 63)], dtype=torch.int64)
        token = token.to(runtime.device())
        # A model sharded with FSDP2 already holds one shard per rank, not a replica.
        tensors = [
            t for t in [*self.model.parameters(), *self.model.buffers()] if not compat.is_dtensor(t)
        ]
        self._broadcast([*tensors, token], START, "initial broadcast", "parameter/buffer")
        # the same on every rank: rank 0's (``Checkpointer.save_id``)
        self._checkpoints.save_id = f"{int(token.item()) + (1 << 63):016x}"

    def _broadcast(
        self, tensors: list[torch.Tensor], step: int, name: str, kind: str = "buffer"
    ) -> None:
        """Rank 0's values of ``tensors`` on every rank, through the hang diagnosis: one
        broadcast per dtype and device (as DDP coalesces), not one per tensor, in runs of at
        most ``BROADCAST_CHUNK_BYTES``: a flat copy of the whole model would add a model's
        bytes to the peak at construction (about 400 MB of a 100M-parameter model in fp32,
        more than ``zero:3`` holds per rank in training on 4 ranks)."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        runs = [run for group in groups.values() for run in chunks(group, BROADCAST_CHUNK_BYTES)]

        def broadcast() -> None:
            for run in runs:  # one run's flat copy at a time
                flat = flatten(run)
                dist.broadcast(flat, src=src, group=self.group)
                copy_into(flat, run)

        what = f"{name} of {len(tensors)} {kind} tensors from rank 0"
        self._watch.run(step, what, broadcast)

    @contextmanager
    def unsharded(self) -> Iterator[None]:
        """Collective on entry (every rank enters it): every parameter whole on every rank
        until exit, so that a forward on some ranks only needs no peer, as DDP's rank-0
        evaluation expects::

            with sync.unsharded():
                if rank == 0:
                    evaluate(model)

        Under ``zero:3`` a forward of the sharded model is a collective (FSDP2 gathers the
        parameters); here they are gathered once on entry and freed on exit (on each rank
        alone), at the cost of the whole model's memory meanwhile. Under every other strategy
        the parameters are whole already: nothing happens. No ``sync.step()`` inside it."""
        if self._in_step:
            raise UsageError(
                "sync.unsharded() inside a sync.step() block: the step's forward needs the "
                "parameters sharded; enter it between steps, on every rank"
            )
        with contextlib.ExitStack() as held:
            with self._gradsync_call(self._step, "sync.unsharded()"):
                held.enter_context(self.strategy.unsharded())
            yield

    def full_state_dict(self) -> dict[str, Any] | None:
        """Collective (every rank calls it): ``{"model": ..., "optimizer": ...}`` as one
        process would hold them, on rank 0 (None on the others): what a DDP script's rank-0
        checkpoint saves, loadable by a plain model's ``load_state_dict`` and its optimizer's,
        or by ``load_full_state_dict``. Under ``zero:1``-``zero:3`` it gathers every rank's
        shards (as CPU tensors: the whole optimizer state, and under ``zero:3`` the whole
        model, on rank 0's host), where ``optimizer.state_dict()`` holds one rank's shard and
        is refused; under ``bsp`` it is rank 0's own state, as ``model.state_dict()`` gives."""
        with self._gradsync_call(self._step, "sync.full_state_dict()"):
            state = self.strategy.full_state_dict(self.model, self.optimizer)
        return state if self.rank == 0 else None

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Collective: resume from a whole state (``full_state_dict``'s, or a DDP script's
        ``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}``), given on every
        rank (each one ``torch.load``s the same file): each rank takes what it holds of it,
        its shards under ZeRO. gradsync's own state (the step count, compressors) is not part
        of it: ``sync.save`` / ``sync.load`` keep that."""
        with self._gradsync_call(self._step, "sync.load_full_state_dict()"):
            self.strategy.load_full_state_dict(self.model, self.optimizer, state)


def _check_sharded_model(model: torch.nn.Module, strategy: Strategy) -> None:
    if not strategy.takes_sharded_models and any(compat.is_dtensor(p) for p in model.parameters()):
        raise UsageError(
            f"this model's parameters are FSDP2 DTensors (it went through fully_shard), which "
            f"strategy {strategy.name} cannot synchronize: it exchanges whole tensors. Use "
            "strategy='zero:3' (--strategy zero:3), which takes the sharded model as it is"
        )


def _check_arguments(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
) -> None:
    """``UsageError`` naming the first bad object given to the ``Synchronizer`` and what is
    valid (its settings are checked by their option groups, ``gradsync.options``)."""
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, got {_described(model)}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(
            f"optimizer must be a torch.optim.Optimizer over the model's parameters (e.g. "
            f"torch.optim.SGD(model.parameters(), lr=0.1)), got {_described(optimizer)}"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise UsageError(
            f"model {type(model).__name__} has no trainable parameters "
            "(none with requires_grad=True): there is nothing to synchronize"
        )
    if steps_none_of(model, optimizer):
        # built on another model, or on a copy: gradients would be averaged that this
        # optimizer never applies, and the model would never move, silently
        raise UsageError(
            f"optimizer {type(optimizer).__name__} holds none of model "
            f"{type(model).__name__}'s parameters: build it on model.parameters() (the same "
            "tensors, not a copy of the model) before the Synchronizer"
        )
    _check_dense_gradients(model)
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise UsageError(
            f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
        )


def steps_none_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds none of ``model``'s parameters (a model without any holds
    nothing to miss)."""
    mine = {id(p) for p in model.parameters()}
    held = (id(p) for group in optimizer.param_groups for p in group["params"])
    return bool(mine) and not any(p in mine for p in held)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _described(value: object) -> str:
    shown = repr(value)
    return f"{type(value).__name__} {shown[:60]}{'...' if len(shown) > 60 else ''}"


def _check_dense_gradients(model: torch.nn.Module) -> None:
    """Sparse gradients (an embedding built with ``sparse=True``) have no storage of their own
    to flatten into buckets: every strategy would fail at the first step with torch's raw
    "Cannot access data pointer" error. Refused here, naming the module."""
    for name, module in model.named_modules():
        if (
            isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag)
            and module.sparse
            and module.weight.requires_grad
        ):
            raise UsageError(
                f"model's {type(module).__name__} {repr(name) if name else '(the model)'} was "
                "built with "
                "sparse=True: its gradients are sparse tensors, which gradsync's strategies do "
                "not exchange (they send dense gradients); build it with sparse=False"
            )


def _gate_group_server(host: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """A store for the step gate's group (``gradsync.checks.gate_groups``), listening on
    ``host`` only, as every store gradsync serves (README, "Trust model")."""
    return server_store(host, 0, timeout=timeout)


def _write_unreported(ref: weakref.ref[Synchronizer], status: str | None = None) -> None:
    """At the process's exit (``status`` None: as the exit says, ``ending_status``): the step
    records of a Synchronizer never closed (``close()`` writes them itself)."""
    sync = ref()
    if sync is not None and not sync._closed:
        sync._write_own_records(status or ending_status(at_exit=True))


#: the Synchronizers of this process attached to a ``gradsync run`` directory
_ATTACHED: weakref.WeakSet[Synchronizer] = weakref.WeakSet()


def _stepped_twice(times: int, where: str, side: str) -> UsageError:
    """The error of the script's own optimizer.step() calls (``where``: inside the block, or
    after it) beside the update the block's exit applies: the parameters moved twice."""
    return UsageError(
        f"optimizer.step() ran {times} time(s) {where}: gradsync already applies the update "
        "when a sync.step() block exits, so the parameters moved twice. Remove "
        f"optimizer.step() (and scaler.step(), scaler.update()) from {side} the block; pass "
        "scaler= to the Synchronizer"
    )


def scripts_ended(how: str) -> None:
    """This process's script has ended (``how``: "returned", "sys.exit(0)") while it still
    runs: each attached Synchronizer not closed leaves word for its peers and stops its
    heartbeat (``ArrivalWatch.note_ended``), so that a peer waiting for it fails at once,
    naming how it ended, rather than taking it for a rank busy between steps
    (``gradsync.runner.worker``, whose process waits for its peers after the script)."""
    for sync in list(_ATTACHED):
        if not sync._closed:
            sync._watch.note_ended(sync._step - 1, how)


def write_unreported_records() -> None:
    """The step records of every attached Synchronizer not closed, written now: for a rank
    stopped by a signal, whose process runs no exit hook (``gradsync.runner.worker``)."""
    for sync in list(_ATTACHED):
        _write_unreported(weakref.ref(sync), KILLED)


class _GradientReady:
    """The gradient-ready phase of one step: run once, from ``StepHandle.synchronize()``
    inside the block or at the block's exit, whichever comes first."""

    def __init__(
        self,
        strategy: Strategy,
        step: int,
        clock: DeviceClock | None = None,
        gate_waited: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._strategy, self._step, self._clock = strategy, step, clock
        self._outcome: StepOutcome | None = None
        self.seconds_in_block = 0.0
        #: the Synchronizer's gate wait so far (``_join_gate``), and how much of it fell inside
        #: synchronize() in the block, whose ``seconds_in_block`` holds it already
        self._gate_waited = gate_waited
        self.gate_waited_in_call = 0.0
        #: device events around synchronize() in the block (CUDA): the wait as device time
        self.device_wait: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def __call__(self) -> StepOutcome:
        if self._outcome is not None:
            raise UsageError(f"synchronize() was already called in step {self._step}")
        t0, gate0 = time.perf_counter(), self._gate_waited()
        start = self._clock.mark() if self._clock is not None else None
        self._outcome = self._run()
        if start is not None and self._clock is not None:
            self.device_wait = (start, self._clock.mark())
        self.seconds_in_block = time.perf_counter() - t0
        self.gate_waited_in_call = self._gate_waited() - gate0
        return self._outcome

    def outcome(self) -> StepOutcome:
        if self._outcome is None:
            self._outcome = self._run()
        return self._outcome

    def abandoned(self) -> StepOutcome:
        """The outcome when the block raised: the exchange's, if synchronize() had run;
        otherwise what the strategy makes of an abandoned step."""
        if self._outcome is None:
            self._outcome = self._strategy.abandon(self._step)
        return self._outcome

    def _run(self) -> StepOutcome:
        with compat.annotate("gradsync.gradients_ready"):
            return self._strategy.gradients_ready(self._step)


def finish_exchange(handle: StepHandle) -> None:
    """``handle.synchronize()`` without reading its verdict, for callers that do nothing
    different on a skipped step (the front door under ``bsp``): a verdict left on the device
    stays there, and the host does not wait for it."""
    handle._exchange()


def _skipped(outcome: StepOutcome) -> bool:
    """Whether the step is skipped, its verdict read from the device if it is there."""
    if outcome.found_inf is not None:
        return bool(outcome.found_inf)
    return outcome.skipped


Signature = list[tuple[str, str, tuple[int, ...], str, bool]]


def model_signature(model: torch.nn.Module) -> Signature:
    """What every rank's model must agree on: each parameter's and buffer's name, shape, dtype
    and whether it trains, in registration order."""
    params = [
        ("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in model.named_parameters()
    ]
    buffers = [
        ("buffer", name, tuple(b.shape), str(b.dtype), False) for name, b in model.named_buffers()
    ]
    return params + buffers


def describe_model_mismatch(signatures: list[Signature]) -> str:
    """Which rank's model differs from rank 0's, and the first tensor where it does."""
    reference = signatures[0]
    for rank, theirs in enumerate(signatures[1:], start=1):
        if theirs == reference:
            continue
        for ours, other in zip(reference, theirs, strict=False):
            if ours != other:
                return (
                    f"rank {rank} built a different model than rank 0: {_show(ours)} on rank 0, "
                    f"{_show(other)} on rank {rank}. Every rank must build the same model "
                    "before the Synchronizer (same code, same arguments)"
                )
        longer, count = (rank, len(theirs)) if len(theirs) > len(reference) else (0, len(reference))
        extra = (theirs if longer else reference)[min(len(theirs), len(reference))]
        return (
            f"rank {rank} built a different model than rank 0: {len(reference)} tensors on "
            f"rank 0, {len(theirs)} on rank {rank}; the first one only rank {longer} has "
            f"({count} in all) is {_show(extra)}. Every rank must build the same model before "
            "the Synchronizer"
        )
    return "the ranks' models differ (their fingerprints do not match)"


def _show(entry: tuple[str, str, tuple[int, ...], str, bool]) -> str:
    kind, name, shape, dtype, trains = entry
    frozen = "" if trains or kind == "buffer" else ", frozen"
    return f"{kind} {name!r} {list(shape)} {dtype.removeprefix('torch.')}{frozen}"
