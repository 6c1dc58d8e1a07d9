"""Save and resume a whole training state through ``CheckpointStore``: ``sync.save()``/``load()``.

A checkpoint holds, per rank: the model and optimizer state dicts, the Synchronizer's strategy
and compressor state, RNG states, the step records not gathered yet, the registered states and
the caller's extras. Both calls are collective, and every strategy resumes exactly where its
checkpoint left it. Every rank hands a snapshot of its state to its background writer
(``checkpoint.writer_process``); rank 0's commits the checkpoint once every rank's file is
written. No collective is posted, so ``save(wait=False)`` costs the step a copy; ``save()``
waits for the commit.

Parameter servers (``ssp:S``, ``async``) hold the parameters and the optimizer state, so they
write a file too, snapshotted inside ``sync.serve()`` once every worker's request has arrived
(``save_server``); resuming needs the same numbers of workers and servers. Resuming on another
number of ranks is for ``resizable`` strategies (BSP: each rank writes a share of the replicas'
state, ``replicas``, joined on load) and ``reshardable`` ones; the others refuse.
docs/checkpoints.md tells the whole story ("Parameter servers", "Changing the number of ranks").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync.checkpoint import replicas
from gradsync.checkpoint.packing import Share, constant
from gradsync.checkpoint.registry import REGISTERED, StateRegistry
from gradsync.checkpoint.rng import rng_state, set_rng_state
from gradsync.checkpoint.row_log import RowLogError, RowLogs, read_rows
from gradsync.checkpoint.settings import STRATEGY_SPEC, check_strategy_spec
from gradsync.checkpoint.store import (
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    CheckpointWarning,
    snapshot,
)
from gradsync.checkpoint.writer_inline import InlineCheckpointWriter
from gradsync.checkpoint.writer_locks import wait_for_writers
from gradsync.checkpoint.writer_process import ProcessCheckpointWriter, make_writer
from gradsync.checks.diagnose import ArrivalWatch
from gradsync.errors import UsageError
from gradsync.strategies.base import CheckpointHooks, Layout, Strategy, own_optimizer_state
from gradsync.telemetry.timing import LEGACY_ROW_COLUMNS, ROW_COLUMNS, TelemetryCollector

Writer = InlineCheckpointWriter | ProcessCheckpointWriter

#: the Strategy protocol's checkpoint members before ``CheckpointHooks`` replaced them
RETIRED_MEMBERS = ("prepare_checkpoint", "checkpoint_held", "flush_checkpoints", "holds_snapshots")


class Checkpointer:
    """One rank's checkpoints: what its saves and loads need of the training loop, given at
    construction (its parts, not itself: nothing here reaches into the Synchronizer), and what
    they keep between calls (the writer, the row logs, the directory published to parameter
    servers, the run's save id). ``sync_state`` / ``load_sync_state``: the loop's own state
    (the step and the strategy's state); ``collector``: the step records not gathered yet."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        layout: Layout,
        group: dist.ProcessGroup | None,
        strategy: Strategy,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        compression: str,
        timeout_s: float,
        watch: ArrivalWatch,
        collector: TelemetryCollector,
        step: Callable[[], int],
        sync_state: Callable[[], dict[str, Any]],
        load_sync_state: Callable[[dict[str, Any]], None],
    ) -> None:
        self.rank, self.world_size, self.layout, self.group = rank, world_size, layout, group
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.compression, self.timeout_s = compression, timeout_s
        self.watch, self.collector = watch, collector
        self.step, self.sync_state, self.load_sync_state = step, sync_state, load_sync_state
        self.writer: Writer | None = None
        #: the ``directory`` argument of the save that last used ``writer``
        self._directory: str | Path | None = None
        #: this rank's step-record logs beside its checkpoints (barrier-free strategies only)
        self.row_logs = RowLogs(rank, ROW_COLUMNS)
        #: rank 0: the checkpoint directory servers were told (the object, keep, the value
        #: published, its number); a server: the number and value it read last
        self.published: tuple[Any, int, str, int] | None = None
        self.published_seen: tuple[int, tuple[str, int]] | None = None
        #: what the strategy asked of the checkpoints in its ``setup`` (parameter servers)
        self.hooks = CheckpointHooks()
        #: the states registered to go with every checkpoint (``sync.register_state``)
        self.registry = StateRegistry()
        #: names this run's checkpoint files, the same on every rank (the Synchronizer sets
        #: rank 0's, broadcast with the initial state): a commit never pairs them with files of
        #: a rolled-back attempt
        self.save_id = secrets.token_hex(8)
        #: the strategy's spec where its name does not say it all (``local:4``), recorded in
        #: every checkpoint and held against the one a load reads (``settings``)
        self.strategy_spec = strategy.settings_spec()

    @property
    def is_server(self) -> bool:
        return self.layout.role(self.rank) == "server"

    def register_hooks(self, hooks: CheckpointHooks) -> None:
        """The strategy's ``CheckpointHooks`` (``SyncContext.register_checkpoint_hooks``)."""
        self.hooks = hooks

    def check_strategy(self) -> None:
        """After the strategy's ``setup``: refuse one that still defines the protocol members
        ``CheckpointHooks`` replaced and registered no hooks, whose methods would otherwise
        silently never be called."""
        if self.hooks != CheckpointHooks():
            return
        defined = [
            name
            for name in RETIRED_MEMBERS
            if any(name in vars(klass) for klass in type(self.strategy).__mro__)
        ]
        if defined:
            raise UsageError(
                f"strategy {self.strategy.name!r} defines {', '.join(defined)}, which the "
                "Strategy protocol no longer calls: register them in setup() with "
                "ctx.register_checkpoint_hooks(CheckpointHooks(before_save=..., "
                "handed_over=..., flush=..., holds_snapshots=...)) (docs/architecture.md)"
            )

    def _flush_strategy(self) -> None:
        if self.hooks.flush is not None:
            self.hooks.flush()

    def save(
        self,
        directory: str | Path,
        *,
        keep: int = 2,
        extra: dict[str, Any] | None = None,
        wait: bool = True,
    ) -> float:
        """Every rank snapshots its state and hands it to its background writer; rank 0's writer
        commits the manifest once every rank's file is written. With ``wait`` this returns once
        the checkpoint is complete; without, right after the snapshot. Returns the seconds this
        rank spent here."""
        if self.is_server:
            raise UsageError(
                "this rank is a parameter server: it checkpoints inside sync.serve() when the "
                "workers call sync.save(); call save() on worker ranks only"
            )
        started = time.perf_counter()
        step = self.step()
        where = 0
        if self.layout.servers > 0 and self.rank == 0:
            where = _publish_directory(self, directory, keep)
        # Parameter servers snapshot once every worker's request (sent behind its step-th push)
        # has arrived; the request goes out after the directory is published.
        if self.hooks.before_save is not None:
            self.hooks.before_save(step)
        state: dict[str, Any] = {}
        if self.strategy.resizable:
            # Every replica holds the same model and optimizer state (what makes the strategy
            # resizable): each rank writes a share of it, so the bytes written do not grow with
            # the ranks and no rank's step pays for all of them (``replicas``). First in the
            # state, so that its encoding, alike from one step to the next, is reused.
            shared, groups = _replicated_share(self)
            state["replicated"] = shared
            state["replicated_owners"] = _owners_encoded(shared.owner)
            if groups is not None:
                state[PARAM_GROUPS] = groups
        else:
            # The model as a share this rank writes whole: packed as it is, its encoding, alike
            # from one step to the next, reused (``replicas.whole``). Not the optimizer's state
            # dict: a learning-rate schedule changes it at every step.
            model_state = self.strategy.model_state_dict(self.model)
            state["model"] = replicas.whole(model_state, self.rank)
            state["optimizer"] = own_optimizer_state(self.optimizer)
        state |= {
            "sync": self.sync_state(),
            "rng": rng_state(),
            "strategy": self.strategy.name,
            "compression": self.compression,  # load() refuses another compressor's state
            "layout": _layout(self),
            "extra": extra or {},
        }
        if self.strategy_spec is not None:
            state[STRATEGY_SPEC] = self.strategy_spec
        if len(self.registry):
            state[REGISTERED] = self.registry.states()
        writer = self.writer_for(directory, keep)
        if self.strategy.barrier_free:
            # Nothing is gathered before the end: the rows new since the last save go to
            # this rank's row log, the range of row numbers this checkpoint needs here.
            first, end = self.collector.pending_range()
            self.row_logs.cover(writer.store.directory, first, end, self.collector.rows_from)
            state[TELEMETRY_LOG] = [first, end]
        else:
            state["telemetry"] = self.collector.pending_flat_rows()
            state[TELEMETRY_COLUMNS] = ROW_COLUMNS
        packed = snapshot(state, pool=writer.pool)
        writer.submit(step, packed, durable=wait)
        # After the submit: a rank that dies from here on leaves this snapshot to its writer
        # (parameter servers are asked to snapshot here: ``CheckpointHooks.handed_over``).
        if self.hooks.handed_over is not None:
            self.hooks.handed_over(step, wait, where)
        if wait:
            writer.wait(step)
        return time.perf_counter() - started

    def save_server(
        self, server_state: dict[str, Any], durable: bool = False, where: int = 0
    ) -> None:
        """A parameter server's part of a checkpoint, called from ``serve()`` once every worker's
        request has arrived: its own file, written in the background like the workers' (held in
        memory as theirs are, unless ``durable``: a worker's save waits for the files). ``where``:
        rank 0's number for the directory (``_publish_directory``; 0: unknown)."""
        pushed = server_state["pushed"]
        step = min(pushed)
        if any(c != step for c in pushed):
            raise CheckpointError(
                f"parameter server rank {self.rank}: the workers asked for a checkpoint with "
                f"{pushed} pushes applied of workers 0..{len(pushed) - 1}: every worker must save "
                "after the same step"
            )
        directory, keep = _published_directory(self, where)
        self.load_sync_state({"step": step, "strategy": {}})
        state = {
            "server": _server_tree(server_state, self.rank),
            "sync": self.sync_state(),
            "strategy": self.strategy.name,
            "compression": self.compression,  # load() refuses another compressor's state
            "layout": _layout(self),
            "telemetry": self.collector.pending_flat_rows(),
            TELEMETRY_COLUMNS: ROW_COLUMNS,
            "extra": {},
        }
        if len(self.registry):
            state[REGISTERED] = self.registry.states()
        writer = self.writer_for(directory, keep)
        packed = snapshot(state, pool=writer.pool)
        writer.submit(step, packed, durable=durable)

    def flush_server(self) -> None:
        """A worker waits for its checkpoints: a parameter server writes the newest snapshot it
        holds, without waiting for the file (rank 0's commit waits for it)."""
        if self.writer is not None:
            self.writer.write_newest()

    def load(self, directory: str | Path) -> dict[str, Any] | None:
        """Collective (parameter servers included): restore the newest valid checkpoint; return
        its extras plus ``step`` (None if there is none). A server keeps its state for
        ``serve()``."""
        # A save still being written would be missed or half-seen: written first. And a new
        # writer after a load: the old one's counts of steps written would take the steps saved
        # again after a rollback for ones already written.
        self.close_writer()
        # Step-record logs too: rows past the checkpoint may be in them (the load reopens its own).
        self.row_logs.close()
        store = CheckpointStore(directory)
        choice: list[Any] = [None]
        mine: dict[str, Any] | None = None
        if self.rank == 0 and Path(directory).exists():
            # At most half the group's timeout: the other ranks wait in the broadcast below.
            ended = _wait_for_writers(directory, self.save_id, min(self.timeout_s / 2, 60.0))
            info = store.latest(allow_world_change=True)
            if info is not None:
                mine, decision = self._read_newest_on_rank_zero(store, info, ended)
                choice = [decision]
        # Rank 0 decides, so every rank resumes from the same step even if a file is being judged
        # differently elsewhere (a warning it already printed says why it skipped a newer one).
        zero = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(choice, src=zero, group=self.group)
        if choice[0] is None:
            return None
        step, saved_world, saved_strategy, saved_layout, saved_compression, spec, error = choice[0]
        if error is not None:
            raise CheckpointError(error)
        _check_compatible(self, step, saved_world, saved_strategy, saved_layout)
        # the settings too (local:2 against local:4), as gradsync run --resume refuses them
        check_strategy_spec(step, spec, self.strategy_spec)
        _check_compression(step, saved_compression, self.compression)
        changed = saved_world != self.world_size
        if mine is None:
            info = store.at(step)
            state = store.load(info, self.rank, source_rank=0 if changed else None)
        else:
            assert info is not None  # rank 0 read ``mine`` from it
            state = mine
        join_replicated(store, info, state, 0 if changed or mine is not None else self.rank)
        # ZeRO's state cut by another layout (rows, whole tensors) than this run's, at the same
        # world size: dealt out anew as on another world size (``Strategy.relayout``)
        saved_sync = state.get("sync") or {}
        relaid = None if changed else self.strategy.relayout(saved_sync.get("strategy"))
        if (changed or relaid is not None) and not self.strategy.resizable:
            first = 0 if changed else self.rank  # the rank whose file ``state`` is
            every = [state if r == first else store.load(info, r) for r in range(saved_world)]
            state.update(self.strategy.reshard(every))
        if relaid is not None:
            state["sync"] = {**state["sync"], "strategy": relaid}
        # The records of the steps before the checkpoint, not gathered: put back last, once
        # nothing else can fail, so that a load that raised leaves none on any rank.
        rows = _own_telemetry(store, info, state, self.rank, changed)
        self._restore_training_state(state, info, changed, saved_world)
        # After the model and optimizer: a registered scheduler's state refers to its optimizer.
        warn = self.rank == 0
        self.registry.load(state.get(REGISTERED), step=step, world_changed=changed, warn=warn)
        _restore_rows(self, rows, store.directory)
        return {**(state.get("extra") or {}), "step": self.step()}

    def _read_newest_on_rank_zero(
        self, store: CheckpointStore, info: CheckpointInfo, ended: bool
    ) -> tuple[dict[str, Any] | None, tuple[Any, ...]]:
        """Rank 0 in ``load``, given the newest checkpoint ``info``: removes the directories
        above it that earlier attempts' writers left (once they have all ``ended``) and reads
        its own file. Returns that file's state (None: it could not be read) and the decision
        every rank is sent: the step, the world size, what wrote the checkpoint (strategy,
        layout, compression, strategy spec) and the error that reading the file raised."""
        if ended:
            # Directories above it that earlier attempts' writers left and no commit can
            # complete: skipped with a warning just now, and removed, not warned about again
            # at every later resume (``remove_abandoned`` keeps any that could be committed).
            store.remove_abandoned(
                above=info.step, world_size=info.world_size, own_save_id=self.save_id
            )
        # Rank 0's file tells every rank what wrote the checkpoint (strategy, workers and
        # servers), so all of them refuse alike; a file it cannot read fails every rank.
        mine: dict[str, Any] | None = None
        saved: tuple[Any, Any, Any, Any, str | None]
        try:
            mine = store.load(info, 0)
            saved = (
                mine.get("strategy"),
                mine.get("layout"),
                mine.get("compression"),
                mine.get(STRATEGY_SPEC),
                None,
            )
        except CheckpointError as exc:
            saved = (None, None, None, None, str(exc))
        return mine, (info.step, info.world_size, *saved)

    def _restore_training_state(
        self, state: dict[str, Any], info: CheckpointInfo, changed: bool, saved_world: int
    ) -> None:
        """``load``'s restore of the checkpoint's ``state`` (read from ``info``) into the loop: a
        parameter server's own state, or the model, the optimizer and the Synchronizer's state
        (and the RNG where the world size has not ``changed`` from ``saved_world``)."""
        role = self.strategy.server_role()
        if role is not None:
            role.restore(state["server"])
            self.load_sync_state(state["sync"])
            return
        _load_model(self, state, info)
        self.optimizer.load_state_dict(state["optimizer"])
        lost = bool(state["sync"].get("strategy", {}).get("compressor"))
        if changed and lost and self.rank == 0:
            warnings.warn(
                f"resuming BSP from {saved_world} ranks on {self.world_size}: the model and "
                "optimizer state come from the checkpoint; per-rank compressor state (error "
                "feedback) restarts from zero",
                CheckpointWarning,
                # the caller of load, which this runs inside
                stacklevel=3,
            )
        if changed:
            # The strategy keeps the state it was built with (fresh compressor state): an
            # empty dict would make error feedback look for saved residuals (KeyError 'inner').
            sync = {"step": state["sync"]["step"], "strategy": self.strategy.state_dict()}
            self.load_sync_state(sync)
        else:
            self.load_sync_state(state["sync"])
            set_rng_state(state["rng"])

    def writer_for(self, directory: str | Path, keep: int) -> Writer:
        """This rank's background writer for ``directory`` (one directory at a time)."""
        if self.writer is not None and directory is self._directory:
            # The same object as the last save's (every step, in most loops): no path to build
            # and compare, which took 35 us a save right after a step.
            self.writer.store.keep = keep
            return self.writer
        store_dir = Path(directory)
        if self.writer is not None and self.writer.store.directory != store_dir:
            # Closing waits for the old directory's newest checkpoint, which parameter
            # servers write only when told to (they never see this call).
            self._flush_strategy()
            self.close_writer()
        if self.writer is None:
            self.writer = make_writer(
                CheckpointStore(store_dir, keep=keep),
                rank=self.rank,
                world_size=self.world_size,
                save_id=self.save_id,
                timeout_s=self.timeout_s,
                hold=self.strategy.lockstep or self.hooks.holds_snapshots,
            )
        self.writer.store.keep = keep
        self._directory = directory
        return self.writer

    def wait(self, timeout_s: float | None = None) -> None:
        """Until every checkpoint this rank saved is written (and, on rank 0, committed)."""
        if self.writer is not None:
            # Parameter servers write theirs when told to (they never call this).
            self._flush_strategy()
            self.writer.flush(self.timeout_s if timeout_s is None else timeout_s)

    def close_writer(self) -> None:
        """Write what this rank's checkpoint writer holds and stop it; the next save starts
        a new one."""
        writer, self.writer, self._directory = self.writer, None, None
        if writer is not None:
            writer.close(self.timeout_s)

    def close(self) -> None:
        """Write what is held and stop; posts no collective (it may follow an exception)."""
        try:
            if self.writer is not None:
                # Parameter servers write their newest snapshot when told to; after an
                # exception they may be gone, which the writer's own wait then reports.
                with contextlib.suppress(Exception):
                    self._flush_strategy()
            self.close_writer()
        finally:
            self.row_logs.close()

    def before_gather(self, first: int, end: int, rows_from: Callable[[int], torch.Tensor]) -> None:
        """Log the step records ``[first, end)`` beside the checkpoints before a telemetry
        gather takes them (barrier-free strategies: a checkpoint names them in the log)."""
        # A gather is collective: a log that cannot be written must not fail this rank's part
        # of it (the others would wait for it); a later resume then warns of the rows missing.
        try:
            self.row_logs.before_gather(first, end, rows_from)
        except (OSError, RowLogError) as exc:
            warnings.warn(
                f"rank {self.rank}: could not log step records {first} to {end} beside the "
                f"checkpoints before a telemetry gather ({exc}); a resume from an earlier "
                "checkpoint will miss them",
                CheckpointWarning,
                stacklevel=2,
            )


def _layout(cp: Checkpointer) -> dict[str, int]:
    """The layout as a checkpoint records it (plain values, for ``weights_only`` loading)."""
    return {"workers": cp.layout.workers, "servers": cp.layout.servers}


def _describe(world: int, layout: dict[str, int] | None) -> str:
    if not layout or not layout.get("servers"):
        return f"{world} ranks"
    w, k = layout["workers"], layout["servers"]
    return f"{world} ranks ({w} worker{'s' * (w != 1)} + {k} server{'s' * (k != 1)})"


_OWNERS_KEPT: list[tuple[tuple[int, ...], Any]] = []  # the newest owners, encoded


def _owners_encoded(owner: Sequence[int]) -> Any:
    """``replicated_owners`` (a list of ints in the file) encoded once per layout
    (``packing.constant``): the writer process gets its text once instead of a pickled copy
    with every snapshot (120 numbers on charlm)."""
    owners = tuple(owner)
    kept = _OWNERS_KEPT[0] if _OWNERS_KEPT else None  # one read: another thread may replace it
    if kept is not None and kept[0] == owners:
        return kept[1]
    made = constant(list(owners))
    _OWNERS_KEPT[:] = [(owners, made)]
    return made


def _replicated_share(cp: Checkpointer) -> tuple[Share, list[Any] | None]:
    """The model and optimizer state as this rank writes its share of it (built in full),
    and the optimizer's ``param_groups``, kept beside the share."""
    model_state = cp.strategy.model_state_dict(cp.model)
    replicated = {"model": model_state, "optimizer": own_optimizer_state(cp.optimizer)}
    replicated["optimizer"], groups = _without_param_groups(replicated["optimizer"])
    buffers = _buffer_indices(cp.model, model_state)
    return replicas.share_of(replicated, cp.rank, cp.world_size, buffers), groups


def _buffer_indices(model: torch.nn.Module, model_state: dict[str, Any]) -> frozenset[int]:
    """Where the model's buffers are among the replicated state's tensors (the model's come
    first). Rank 0 writes them all: under ``bsp`` buffers such as BatchNorm's running
    statistics are rank 0's only at the start of a step (they are broadcast from it there),
    and each rank has updated its own by the save after it; rank 0's are the ones an
    uninterrupted run would go on with."""
    # Kept per model and key list: walking the modules for their buffers took about 60 us a
    # save on charlm, and a buffer added or removed changes the state dict's keys.
    keys = tuple(model_state)
    kept = _BUFFERS_KEPT.get(model)
    if kept is not None and kept[0] == keys:
        return kept[1]
    names = {name for name, _ in model.named_buffers()}
    found: list[int] = []
    index = 0
    for key, value in model_state.items():
        count = replicas.tensor_count(value)
        if key in names:
            found.extend(range(index, index + count))
        index += count
    indices = frozenset(found)
    _BUFFERS_KEPT[model] = (keys, indices)
    return indices


#: ``_buffer_indices``' last answer per model (weakly held: a model that goes takes it along)
_BUFFERS_KEPT: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[str, ...], frozenset[int]]]
_BUFFERS_KEPT = weakref.WeakKeyDictionary()


#: Where a barrier-free strategy's checkpoint names its rank's step records: ``[first, end)``
#: of the rank's row log (``row_log``), in place of the rows themselves.
TELEMETRY_LOG = "telemetry_log"
#: The values per row of a checkpoint's ``"telemetry"``: a checkpoint without it was written
#: before the rows named their attempt (``timing.LEGACY_ROW_COLUMNS``).
TELEMETRY_COLUMNS = "telemetry_columns"


#: Where a resizable strategy's checkpoint keeps the optimizer's ``param_groups``: beside the
#: replicated share rather than in it (``_without_param_groups``).
PARAM_GROUPS = "optimizer_param_groups"


def _without_param_groups(
    optimizer_state: dict[str, Any],
) -> tuple[dict[str, Any], list[Any] | None]:
    """The optimizer's state dict less its ``param_groups``, and those groups (None when it has
    none): a learning-rate schedule changes them at every step, which inside the replicated
    share made ``pack`` encode the whole share anew (docs/checkpoints.md)."""
    if "param_groups" not in optimizer_state:
        return optimizer_state, None
    rest = {k: v for k, v in optimizer_state.items() if k != "param_groups"}
    return rest, optimizer_state["param_groups"]


def _server_tree(server_state: dict[str, Any], rank: int) -> dict[str, Any]:
    """The server's part of its checkpoint, laid out as ``_Server.state_dict()``, with its
    shard of the parameters and its optimizer's per-parameter state as shares it writes whole
    (``replicas.whole``): packed as they are, their encoding reused from one checkpoint to the
    next. The optimizer's state dict around them is built in full (``optimizer.state_dict()``
    where the state holds the optimizer itself, ``_Server.checkpoint_state``): its groups
    change at every checkpoint."""
    tree = dict(server_state)
    tree["params"] = replicas.whole([p.detach() for p in server_state["params"]], rank)
    optimizer = server_state.get("optimizer")
    if optimizer is None:
        optimizer = {}  # a server without an optimizer, as ``_Server.state_dict`` says it
    elif not isinstance(optimizer, dict):
        optimizer = optimizer.state_dict()  # the optimizer itself, whatever its class
    if isinstance(optimizer, dict) and "state" in optimizer:
        optimizer = {**optimizer, "state": replicas.whole(optimizer["state"], rank)}
    tree["optimizer"] = optimizer
    return tree


def _directory_key(cp: Checkpointer, where: int) -> str:
    # One key per directory: a request still in flight for one directory must not read the
    # next one's (two saves at one step, into two directories).
    return f"{cp.watch.prefix}/checkpoint-directory/{where}"


def _publish_directory(cp: Checkpointer, directory: str | Path, keep: int) -> int:
    """Rank 0 tells the servers where this save goes (they never see the call), through the
    store, before its request: a server reads it once every request has arrived. Returns a
    number for it (never 0), under which it is stored and which rank 0's request carries: a
    server reads the store only for a number it has not read (a read took 0.2 ms median, 0.5
    mean, of the server's snapshot with a checkpoint every step, while the workers may wait
    for it)."""
    last = cp.published
    if last is not None and last[0] is directory and last[1] == keep:
        return last[3]  # the same object as the last save's: no JSON to build
    value = json.dumps({"directory": str(directory), "keep": keep})
    digest = hashlib.blake2b(value.encode(), digest_size=8).digest()
    where = int.from_bytes(digest, "little", signed=True) or 1
    if (last is None or value != last[2]) and cp.watch.store is not None:
        cp.watch.store.set(_directory_key(cp, where), value)
    cp.published = (directory, keep, value, where)
    return where


def _published_directory(cp: Checkpointer, where: int) -> tuple[str, int]:
    """The directory and ``keep`` rank 0 published under ``where``: read from the store unless
    read last."""
    seen = cp.published_seen
    if seen is not None and seen[0] == where:
        return seen[1]
    if cp.watch.store is None:
        raise CheckpointError("parameter-server checkpoints need the process group's store")
    if not where:
        raise CheckpointError(
            f"parameter server rank {cp.rank}: the workers asked for a checkpoint, but rank 0 "
            "named no directory for it"
        )
    data = json.loads(cp.watch.store.get(_directory_key(cp, where)))
    found = str(data["directory"]), int(data["keep"])
    cp.published_seen = (where, found)
    return found


@dataclass(frozen=True, slots=True)
class _OwnRows:
    """This rank's step records not gathered before the checkpoint: the rows (None: none),
    and, where they came from its row log, the range of row numbers the checkpoint named."""

    rows: torch.Tensor | list[float] | None
    span: tuple[int, int] | None = None
    #: the values per row of ``rows`` (fewer in a checkpoint of an earlier gradsync)
    columns: int = ROW_COLUMNS


def _load_model(cp: Checkpointer, state: dict[str, Any], info: Any) -> None:
    """The model's state from the checkpoint; one saved from another model (a run resumed with
    another workload or size, a changed script) named as such, where torch's message alone
    names neither the checkpoint nor the cause."""
    try:
        cp.strategy.load_model_state_dict(cp.model, state["model"])
    except RuntimeError as exc:
        if "state_dict" not in str(exc):
            raise
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = "; ".join(lines).replace(":; ", ": ")  # one line: the run shows a failure's last
        raise CheckpointError(
            f"the checkpoint {info.path} does not fit this model (saved from another model: "
            f"another workload or size, or a changed script?): {why}"
        ) from None


def _restore_rows(cp: Checkpointer, own: _OwnRows, directory: Path) -> None:
    if own.span is None:
        if own.rows is not None:
            cp.collector.restore_pending(own.rows, columns=own.columns)
        return
    first, end = own.span
    # The log cut at ``end``: the rows of the steps rolled back go, this run appends after.
    cp.row_logs.adopt(directory, end)
    rows = own.rows if own.rows is not None else torch.zeros(0, ROW_COLUMNS)
    cp.collector.restore_pending(rows, first=first if own.rows is not None else end)


def _own_telemetry(
    store: CheckpointStore, info: CheckpointInfo, state: dict[str, Any], rank: int, changed: bool
) -> _OwnRows:
    """This rank's step records not gathered before the checkpoint: from its own file (or its
    row log), also when the world size changed (``state`` is then rank 0's); none for a rank
    the saved run did not have, whose steps were never run."""
    if not changed or rank == 0:
        own = state
    elif rank >= info.world_size:
        return _OwnRows(None)
    else:
        own = store.load(info, rank)
    span = own.get(TELEMETRY_LOG)
    if span is None:
        return _OwnRows(
            own.get("telemetry"), columns=int(own.get(TELEMETRY_COLUMNS, LEGACY_ROW_COLUMNS))
        )
    first, end = int(span[0]), int(span[1])
    try:
        rows = read_rows(store.directory, rank, first, end, ROW_COLUMNS)
    except RowLogError as exc:
        warnings.warn(
            f"the checkpoint of step {info.step} names rank {rank}'s step records {first} to "
            f"{end} in its row log, which does not hold them ({exc}); training resumes "
            "whole, but the report will miss those steps",
            CheckpointWarning,
            stacklevel=3,
        )
        return _OwnRows(None, (first, end))
    return _OwnRows(rows, (first, end))


def join_replicated(
    store: CheckpointStore, info: CheckpointInfo, state: dict[str, Any], source: int = 0
) -> None:
    """Put the model and optimizer state of a resizable strategy's checkpoint (``source``'s
    file is ``state``, as ``store.load(info, source)`` read it) back together from every
    rank's share, into ``state``: for ``load``, and for readers of a checkpoint outside a job
    (``checkpoint.export``)."""
    if "replicated" in state:
        owner = state["replicated_owners"]
        shares = [
            state["replicated"] if r == source else store.load(info, r)["replicated"]
            for r in range(info.world_size)
        ]
        state.update(replicas.join(shares, owner))
        if PARAM_GROUPS in state:  # every replica saved the same groups: this file's
            state["optimizer"]["param_groups"] = state.pop(PARAM_GROUPS)
    elif "model" not in state and state.get("replica_of") == 0:
        # Written before the shares (gradsync 0.x): rank 0's file held the replica's state.
        shared = store.load(info, 0)
        state.update(model=shared["model"], optimizer=shared["optimizer"])


def _wait_for_writers(directory: str | Path, own: str | None, timeout_s: float) -> bool:
    """Until the writer processes of earlier attempts have written what their ranks left
    and committed it (``writer_locks``), so the newest checkpoint is read, not one before.
    Whether they have all ended (False: some still held their lock at ``timeout_s``)."""
    held = wait_for_writers(directory, except_save_id=own, timeout_s=timeout_s)
    if held:
        warnings.warn(
            f"checkpoint writers of an earlier attempt still hold {', '.join(held)} in "
            f"{directory} after {timeout_s:g} s; resuming from the newest checkpoint committed "
            "so far",
            CheckpointWarning,
            stacklevel=3,
        )
    return not held


def check_resumable(directory: str | Path, compression: str, strategy: str | None = None) -> None:
    """Before ``gradsync run --resume`` starts a worker: ``UsageError`` when ``directory``
    holds checkpoints but none is usable (each one's reason named), or when the one the run
    would resume from was written with another compression than ``compression`` (a spec), or
    (given this run's ``strategy`` spec) by streaming DiLoCo with other fragments.
    A directory without checkpoints passes: the run starts at step 0, as ``load`` does."""
    store = CheckpointStore(directory)
    _wait_for_writers(directory, None, 60.0)
    # The workers warn about each skipped checkpoint again when they load: not twice here.
    info, _caught, skipped = latest_skipping(store)
    if info is None:
        if skipped:
            reasons = "; ".join(skipped)
            raise UsageError(
                f"--resume: none of the {len(skipped)} checkpoint(s) in {directory} is usable "
                f"({reasons}); resuming would silently start over at step 0. Restore a good "
                "checkpoint, or pass --overwrite instead of --resume to start over (it deletes "
                "them)"
            )
        return
    try:
        state = store.load(info, 0)
        _check_compression(info.step, state.get("compression"), compression)
        if strategy is not None:
            _check_fragments(state, strategy)
            _check_saved_spec(info.step, state, strategy)
    except (CheckpointError, UsageError) as exc:
        raise UsageError(f"--resume: {exc}") from None


def _check_fragments(state: dict[str, Any], strategy: str) -> None:
    """Streaming DiLoCo's fragments as the workers' ``DiLoCo.load_state_dict`` would judge
    them, so a mismatch stops the run before it starts rather than as a worker failure. Other
    strategies, and a checkpoint of another strategy (which the workers refuse, naming it),
    are not judged here."""
    from gradsync.spec import SPLITS, parse_strategy_spec
    from gradsync.strategies.streaming import check_saved_fragments

    spec = parse_strategy_spec(strategy)
    if spec.kind != "diloco" or state.get("strategy") != "diloco":
        return
    saved = state.get("sync", {}).get("strategy", {}).get("streaming", {})
    check_saved_fragments(saved, spec.fragments or 1, spec.split or SPLITS[0], str(spec))


def _check_saved_spec(step: int, state: dict[str, Any], strategy: str) -> None:
    """The spec the checkpoint was saved under against this run's ``strategy`` (a spec), as
    ``load`` judges it in the workers (``settings.check_strategy_spec``). A checkpoint of another
    strategy is left to the workers, which refuse it naming both."""
    from gradsync.spec import parse_strategy_spec

    if state.get("strategy") == parse_strategy_spec(strategy).kind:
        check_strategy_spec(step, state.get(STRATEGY_SPEC), strategy)


def latest_skipping(
    store: CheckpointStore,
) -> tuple[CheckpointInfo | None, list[warnings.WarningMessage], list[str]]:
    """``store.latest()``, the warnings it gave (caught, not shown), and why it skipped each
    newer checkpoint: ``step-000020: rank-0.pt is corrupted: ...``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        info = store.latest(allow_world_change=True)
    skipped = [
        str(w.message)
        .removeprefix("skipping checkpoint ")
        .removesuffix("; falling back to an earlier checkpoint")
        .removeprefix(f"{store.directory}/")
        for w in caught
        if issubclass(w.category, CheckpointWarning)
    ]
    return info, caught, skipped


def _check_compatible(
    cp: Checkpointer,
    step: int,
    saved_world: int,
    saved_strategy: str | None,
    saved_layout: dict[str, int] | None,
) -> None:
    """Refuse, on every rank alike, a checkpoint this run cannot continue."""
    name = cp.strategy.name
    if saved_strategy != name:
        raise CheckpointError(
            f"checkpoint at step {step} was written by strategy {saved_strategy!r}, "
            f"this run uses {name!r}: a strategy's state (its replicas, periods, outer "
            f"optimizer, shards) has no meaning under another. Resume with a {saved_strategy!r} "
            "strategy (strategy=..., gradsync run --strategy), or start in a new directory"
        )
    layout = _layout(cp)
    if cp.layout.servers > 0 and (saved_world, saved_layout) != (cp.world_size, layout):
        raise CheckpointError(
            f"checkpoint at step {step} was written by {_describe(saved_world, saved_layout)}; "
            f"this run has {_describe(cp.world_size, layout)}: resuming {name} needs the same "
            "numbers of workers and servers (each server's shard of the parameters and its "
            "per-worker clocks are saved). Resume with the saved numbers (--nproc, --servers)."
        )
    if saved_world != cp.world_size and not (cp.strategy.resizable or cp.strategy.reshardable):
        raise CheckpointError(
            f"checkpoint at step {step} was written by {saved_world} ranks; resuming "
            f"{name} with {cp.world_size} is not supported (its per-rank state "
            "has no meaning at another size). Resume with the same number of ranks, or use bsp."
        )


def _check_compression(step: int, saved: str | None, current: str) -> None:
    """Refuse a checkpoint written with another compressor (or none): its state (error-feedback
    residuals, PowerSGD factors) belongs to that compressor, and loading it into another one
    fails or, worse, seems to work. Starting the new compressor's state from zero instead would
    quietly make the resumed run a different one than the checkpoint's: refused, as a changed
    strategy is. Checkpoints from before gradsync recorded the compressor (None) are not checked."""
    if saved is None or saved == current:
        return
    raise CheckpointError(
        f"checkpoint at step {step} was written with compression {saved}, this run uses "
        f"{current}: its compressor state cannot continue under another compressor. Resume with "
        f"the checkpoint's compression ({compression_flag(saved)}), or start a new run"
    )


def compression_flag(spec: str) -> str:
    """How a user asks for compression ``spec`` on the command line."""
    return "no --compress" if spec == "none" else f"--compress {spec}"
