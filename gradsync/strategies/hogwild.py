"""Hogwild (``hogwild``): every worker of one host updates one shared copy of the parameters,
without locks and without barriers (Recht, Re, Wright and Niu, 2011).

Each rank computes its gradient on whatever parameters are current and steps the user's own
optimizer on them; the step writes straight into memory every rank maps, so the other ranks
see it as soon as it is written, partly written included. No rank ever waits for another
between setup and the end of training: a slow rank slows only itself.

Why our own rather than PyTorch's Hogwild example (``examples/mnist_hogwild``): that example
forks its workers from one parent after ``model.share_memory()``, so they inherit the shared
tensors. gradsync's ranks are separate processes started by torchrun or ``gradsync run``, with
no parent to inherit from, so the sharing is done here by name: rank 0 creates a file in
``/dev/shm`` (the temporary directory where there is none), writes the parameters into it, and
every rank maps it with ``torch.from_file(shared=True)``; each parameter's ``.data`` then
becomes its view of that mapping. What this wraps: the user's optimizer, stepped as usual (its
state, such as momentum, stays private to each rank, as in the example), and
torch.distributed only at setup (a host check, the file's name, one barrier) and at the end.
Once every rank has mapped the file, rank 0 unlinks it: the mapping lives on until the last
rank lets go of it, and a rank killed at any later point leaves nothing behind.

Versions and staleness: the mapping begins with one row of counters per rank, written only by
that rank (so no increment is ever lost without a lock): updates applied, the sum and the
maximum of their staleness. The version is the sum of every rank's applied updates. A step
reads it at its start; just before its own write it reads it again, and the difference is the
step's staleness: how many updates of other ranks landed between what it read and what it
writes. ``stats()`` reads the counters (every rank's, from the mapping), and rank 0 prints them
when training ends.

Barrier-bound options are refused: compression (nothing is sent), ``--balance`` (no global
batch per step), hierarchical all-reduce, several hosts (``--hosts`` or torchrun across
nodes). Checkpoints: each rank saves its own optimizer state and counters and the shared
parameters as it sees them at its save; on load, rank 0's saved parameters go into the new
mapping and one barrier follows, so no rank trains before every rank has restored.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync.checks.diagnose import END, START
from gradsync.errors import UsageError
from gradsync.logs import get_logger
from gradsync.strategies.base import (
    StepOutcome,
    StepPlan,
    Strategy,
    SyncContext,
    local_gradient,
    optimizer_step,
)
from gradsync.strategies.passes import PassCounter
from gradsync.telemetry.records import Span
from gradsync.topology import host_key

logger = get_logger("strategies.hogwild")

#: where the shared file is created: memory-backed on Linux
SHM_DIR = Path("/dev/shm")
#: the shared file's name starts with this (tests look for leftovers by it)
FILE_PREFIX = "gradsync-hogwild-"
#: bytes per rank's row of counters and alignment of every tensor in the mapping: one cache
#: line, so that ranks writing their own counters do not invalidate each other's lines
_LINE = 64
_SLOTS = _LINE // 8
_UPDATES, _STALE_SUM, _STALE_MAX = 0, 1, 2


@dataclass(frozen=True, slots=True)
class HogwildStats:
    """What the shared counters say: per rank, updates applied and their staleness (updates
    of other ranks written between the parameters a step read and its own write)."""

    updates: list[int]
    staleness_sum: list[int]
    staleness_max: list[int]

    @property
    def applied(self) -> int:
        """Updates applied by every rank together: the shared parameters' version."""
        return sum(self.updates)

    @property
    def mean_staleness(self) -> float:
        return sum(self.staleness_sum) / self.applied if self.applied else 0.0

    def describe(self) -> str:
        per_rank = ", ".join(
            f"rank {r}: {n} (staleness mean {s / n if n else 0.0:.2f}, max {m})"
            for r, (n, s, m) in enumerate(
                zip(self.updates, self.staleness_sum, self.staleness_max, strict=True)
            )
        )
        return (
            f"hogwild: {self.applied} lock-free updates applied to the shared parameters, "
            f"staleness (updates of other ranks between a step's read and its write) mean "
            f"{self.mean_staleness:.2f}, max {max(self.staleness_max, default=0)}; {per_rank}"
        )


def _aligned(n: int) -> int:
    return -(-n // _LINE) * _LINE


def _shared_dir() -> Path:
    return SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())


class Hogwild(Strategy):
    """``hogwild``: lock-free updates of parameters shared in memory by the ranks of one host."""

    name = "hogwild"
    barrier_free = True

    def __init__(self) -> None:
        self._ctx: SyncContext | None = None
        self._params: list[torch.Tensor] = []
        self._passes = PassCounter([])
        self._mapping: torch.Tensor | None = None  # the whole shared file, as bytes
        self._counters: torch.Tensor | None = None  # (world, _SLOTS) int64, shared
        self._average_over = 1
        self._read = 0  # the version this step's parameters were read at
        self._finished = False

    # -- setup ----------------------------------------------------------------------------------
    def setup(self, ctx: SyncContext) -> None:
        self._refuse(ctx)
        self._ctx = ctx
        self._params = [p for p in ctx.model.parameters() if p.requires_grad]
        self._passes = PassCounter(self._params)
        world = ctx.layout.world_size
        if world > 1:
            self._check_one_host(ctx)
        offsets, size = self._layout(world)
        made: tuple[str | None, str | None] = (None, None)
        if ctx.rank == 0:
            try:
                made = (self._create(offsets, size), None)
            except (OSError, RuntimeError) as exc:  # a value: the peers must hear of it
                made = (None, f"rank 0 cannot create hogwild's shared parameter file: {exc}")
        if world > 1:
            made = self._share_name(ctx, made)
        path, failure = made
        if failure is not None or path is None:
            raise UsageError(failure or "hogwild's shared parameter file has no name")
        try:
            error = self._map(Path(path), size, offsets)
        finally:
            if world == 1:
                os.unlink(path)
        if world > 1:
            self._agree_mapped(ctx, Path(path), error)
        elif error is not None:
            raise UsageError(error)

    def _refuse(self, ctx: SyncContext) -> None:
        if ctx.compressor.spec != "none":
            raise UsageError(refusal_of_compression(ctx.compressor.spec))
        off_host = [p.device for p in ctx.model.parameters() if p.device.type != "cpu"]
        if off_host:
            raise UsageError(
                f"hogwild shares the parameters in host memory between the processes of one "
                f"machine; this model has parameters on {off_host[0]}. Keep the model on the "
                "CPU, or use bsp / local:H / async on accelerators"
            )

    def _check_one_host(self, ctx: SyncContext) -> None:
        """Refuse, on every rank alike, a group spread over several hosts: a memory mapping
        is shared only within one."""
        keys: list[Any] = [None] * ctx.layout.world_size

        def gather() -> None:
            dist.all_gather_object(keys, host_key(), group=ctx.group)

        self._wait(ctx, START, "host check of hogwild (a gather of host names)", gather)
        hosts = sorted(set(keys))
        if len(hosts) > 1:
            raise UsageError(
                f"hogwild runs on one host (its workers share the parameters in memory), but "
                f"the ranks are on {len(hosts)} hosts ({', '.join(hosts)}). Drop --hosts (or "
                "launch every rank on one node), or use async, local:H or bsp across hosts"
            )

    def _layout(self, world: int) -> tuple[list[int], int]:
        """Byte offsets of each parameter in the mapping, after the counters; total size."""
        offsets, at = [], _aligned(world * _LINE)
        for p in self._params:
            offsets.append(at)
            at += _aligned(p.numel() * p.element_size())
        return offsets, at

    def _create(self, offsets: list[int], size: int) -> str:
        """Rank 0: a new shared file holding the (just broadcast) parameters, counters at 0."""
        where = _shared_dir()
        free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
        if free < size:  # a write past a full tmpfs would kill the rank with SIGBUS instead
            raise OSError(
                f"{where} has {free / 2**20:.1f} MiB free, the parameters need "
                f"{size / 2**20:.1f} MiB (enlarge it: docker run --shm-size ...)"
            )
        fd, path = tempfile.mkstemp(prefix=FILE_PREFIX, dir=where)
        try:
            os.ftruncate(fd, size)  # zero-filled: every counter starts at 0
        finally:
            os.close(fd)
        try:
            mapping = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            for p, at in zip(self._params, offsets, strict=True):
                _view(mapping, at, p).copy_(p.detach())
        except BaseException:
            os.unlink(path)
            raise
        return path

    def _share_name(
        self, ctx: SyncContext, made: tuple[str | None, str | None]
    ) -> tuple[str | None, str | None]:
        """Rank 0's file name (or why it has none) on every rank."""
        name: list[Any] = [made]
        src = dist.get_global_rank(ctx.group, 0) if ctx.group is not None else 0

        def broadcast() -> None:
            dist.broadcast_object_list(name, src=src, group=ctx.group)

        self._wait(ctx, START, "name of hogwild's shared parameter file", broadcast)
        return name[0][0], name[0][1]

    def _map(self, path: Path, size: int, offsets: list[int]) -> str | None:
        """Map the shared file and point every parameter at its view; the reason on failure
        (a value, so that every rank still meets the barrier that follows)."""
        try:
            mapping = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError) as exc:
            return f"cannot map hogwild's shared parameter file {path}: {exc}"
        world = self._ctx.layout.world_size if self._ctx else 1
        self._mapping = mapping
        self._counters = mapping[: world * _LINE].view(torch.int64).view(world, _SLOTS)
        for p, at in zip(self._params, offsets, strict=True):
            p.data = _view(mapping, at, p)
        return None

    def _agree_mapped(self, ctx: SyncContext, path: Path, error: str | None) -> None:
        """The one barrier of training: every rank has mapped the file (or says why not);
        then rank 0 unlinks it, so nothing is left behind whatever happens next."""
        errors: list[Any] = [None] * ctx.layout.world_size

        def gather() -> None:
            dist.all_gather_object(errors, error, group=ctx.group)

        try:
            self._wait(ctx, START, "mapping of hogwild's shared parameters", gather)
        finally:
            if ctx.rank == 0:
                path.unlink(missing_ok=True)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            rank, why = failed[0]
            raise UsageError(
                f"rank {rank}: {why}. hogwild needs every rank on the host that created it, "
                "with the same /dev/shm (or temporary directory)"
            )

    @staticmethod
    def _wait(ctx: SyncContext, step: int | None, what: str, fn: Any) -> None:
        if ctx.watch is None:
            fn()
        else:
            ctx.watch.run(step, what, fn)

    # -- steps ----------------------------------------------------------------------------------
    def _version(self) -> int:
        assert self._counters is not None, "setup() has not run"
        return int(self._counters[:, _UPDATES].sum())

    def begin_step(self, plan: StepPlan) -> None:
        assert self._ctx is not None
        if self._finished:
            raise UsageError("training already finished (report() ended it): no more steps")
        self._ctx.optimizer.zero_grad(set_to_none=True)
        self._average_over = plan.average_over
        self._read = self._version()
        self._passes.arm(plan.micro_batches)

    def gradients_ready(self, step: int) -> StepOutcome:
        """This rank's own gradient (the mean over micro-batches); a non-finite one skips this
        rank's update only."""
        assert self._ctx is not None
        self._passes.check()
        outcome = local_gradient(self._params, self._ctx, self._average_over)
        if outcome.skipped:
            self._ctx.optimizer.zero_grad(set_to_none=True)
        return outcome

    def abandon(self, step: int) -> StepOutcome:
        """This rank's block raised: it writes nothing; nobody else waits for it."""
        assert self._ctx is not None
        self._ctx.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(barrier=False, skipped=True)

    def update(self, step: int, outcome: StepOutcome) -> StepOutcome:
        """The user's optimizer step, written straight into the shared parameters."""
        assert self._ctx is not None and self._counters is not None
        outcome.barrier, outcome.idle = False, 0.0
        if outcome.skipped:
            return outcome
        wall0, t0 = time.time(), time.perf_counter()
        staleness = self._version() - self._read
        outcome.skipped = not optimizer_step(self._ctx)
        if outcome.skipped:  # a GradScaler found this rank's gradient not finite
            return outcome
        row = self._counters[self._ctx.rank]
        # Only this rank writes its row: plain stores, no lost increments.
        row[_UPDATES] += 1
        row[_STALE_SUM] += staleness
        row[_STALE_MAX] = max(int(row[_STALE_MAX]), staleness)
        if self._ctx.record_spans:
            args = {"version_read": self._read, "staleness": staleness}
            dur = time.perf_counter() - t0
            outcome.spans.append(Span(-1, -1, "hogwild_update", wall0, dur, "step", args))
        return outcome

    def stats(self) -> HogwildStats:
        """Every rank's counters as they are now (they go on changing until training ends)."""
        assert self._counters is not None, "setup() has not run"
        rows = self._counters.clone().tolist()
        return HogwildStats(
            updates=[r[_UPDATES] for r in rows],
            staleness_sum=[r[_STALE_SUM] for r in rows],
            staleness_max=[r[_STALE_MAX] for r in rows],
        )

    # -- end of training and checkpoints --------------------------------------------------------
    def finalize(self) -> None:
        """Training ends: one barrier, after which no rank writes, so every rank leaves with
        the same parameters (they are the same memory); rank 0 prints the counters."""
        if self._finished or self._ctx is None:
            return
        self._finished = True
        ctx = self._ctx
        if ctx.layout.world_size > 1:
            self._wait(ctx, END, "end of hogwild training (barrier)", _barrier(ctx))
        if ctx.rank == 0:
            logger.info("%s", self.stats().describe())

    def replicas_identical(self, step: int, final: bool) -> bool:
        """Mid-run the ranks read one memory at different moments; at the end, after the
        final barrier, the check confirms they share it."""
        return final

    def state_dict(self) -> dict[str, Any]:
        assert self._ctx is not None
        return {"counters": self.stats_row()}

    def summary(self) -> dict[str, Any]:
        stats = self.stats()
        return {
            "updates_applied": stats.applied,
            "updates_per_rank": list(stats.updates),
            "staleness_mean": stats.mean_staleness,
            "staleness_max": max(stats.staleness_max, default=0),
        }

    def stats_row(self) -> list[int]:
        """This rank's counters (updates, staleness sum, staleness max)."""
        assert self._ctx is not None and self._counters is not None
        return [int(v) for v in self._counters[self._ctx.rank, :3]]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Collective: this rank's counters back, then one barrier, so that no rank trains
        before every rank has restored (``sync.load()`` calls it after the model's and the
        optimizer's state, so the barrier covers the shared parameters too)."""
        assert self._ctx is not None and self._counters is not None
        saved = state.get("counters")
        if saved is not None:
            self._counters[self._ctx.rank, :3] = torch.tensor(saved, dtype=torch.int64)
        if self._ctx.layout.world_size > 1:
            self._wait(self._ctx, None, "restore of hogwild's shared state", _barrier(self._ctx))

    def load_model_state_dict(self, model: torch.nn.Module, state: dict[str, Any]) -> None:
        """Rank 0's saved parameters go into the shared memory (the other ranks' would race
        with it), each rank's buffers into its own model; ``load_state_dict`` then waits for
        every rank."""
        assert self._ctx is not None
        if self._ctx.rank == 0:
            model.load_state_dict(state)
            return
        shared = {name for name, p in model.named_parameters() if p.requires_grad}
        model.load_state_dict({k: v for k, v in state.items() if k not in shared}, strict=False)

    def close(self) -> None:
        """Give every parameter a private copy of its values and let go of the mapping (the
        file was unlinked at setup: the memory is freed once the last rank lets go)."""
        self._passes.close()
        if self._mapping is None:
            return
        with torch.no_grad():
            for p in self._params:
                p.data = p.data.clone()
        self._mapping = self._counters = None


def _view(mapping: torch.Tensor, at: int, p: torch.Tensor) -> torch.Tensor:
    nbytes = p.numel() * p.element_size()
    return mapping[at : at + nbytes].view(p.dtype).view(p.shape)


def _barrier(ctx: SyncContext) -> Any:
    def wait() -> None:
        work = dist.barrier(group=ctx.group, async_op=True)
        assert work is not None
        work.wait()

    return wait


def refusal_of_compression(spec: str) -> str:
    """Why hogwild takes no ``--compress`` (the same words before launch and in ``setup``)."""
    return (
        f"hogwild sends nothing (its workers write one shared copy of the parameters), so "
        f"there is nothing to compress: drop --compress {spec} (compression=None), or use "
        "bsp, local:H, diloco:H, ssp:S or async with it"
    )


__all__ = ["FILE_PREFIX", "Hogwild", "HogwildStats", "refusal_of_compression"]
