"""The ranks' side of ``benchmarks.checkpoint_vs_dcp``: gradsync's checkpointer and torch's DCP
``async_save`` in alternating blocks of steps of the same processes, on the same model.

One run (both ranks) trains one workload under ``bsp`` and times blocks of two kinds per
cadence N, plus blocks without saves, in an order that rotates repeat by repeat
(``benchmarks.harness.order``); a block is ``steps`` steps (``block_steps``):

- ``none``: ``steps`` training steps, no save;
- ``gradsync@N``: ``steps / N`` periods of a ``sync.save(DIR, wait=False)`` followed by ``N``
  training steps: the time on the training thread per save is the call;
- ``dcp@N``: the same periods with ``dcp.async_save({"model": model.state_dict(), "optimizer":
  optimizer.state_dict()})`` (process-based where this torch has it) in place of the save; as
  a real loop must, each save's future is waited for before the next save, so a save's time on
  the training thread is the call plus that wait, taken ``N`` steps later. The last save of a
  block is waited for at the block's end, ``N`` steps after it as the next save would, inside
  the block: the next block (another kind) must not share the machine with its write.

Every block starts and ends at a barrier (``bsp``), so both ranks' blocks cover the same steps.
Untimed first: one DCP save (its checkpoint process starts then, its log going to a file
beside the checkpoints), then a short block of each kind, two saves a step apart (gradsync's
writer process starts, every buffer is allocated). DCP writes a ring of two directories
(its checkpoint ``k`` into ``slot-{k % 2}``, the one two saves back, complete by then), as
gradsync keeps its newest two checkpoints (``keep=2``).

At the end each checkpointer saves the same state once more, and the checks load it back:
DCP's with ``dcp.load`` into zeroed copies of the state dicts, gradsync's with ``sync.load``
after the parameters and the optimizer's state were overwritten; both must equal the state
saved, bit for bit. Which step directories gradsync wrote during the timed blocks is read off
its directory after every block (outside the timing): under ``bsp`` it holds most snapshots in
memory and writes one file every ``FILES_EVERY`` steps (docs/checkpoints.md, "Held snapshots"),
while DCP writes every save.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import gradsync as gs
from benchmarks.harness import order
from gradsync.workloads import make_workload

BATCH = 16  # per worker, as ``gradsync run``'s default
NONE = "none"
#: AdamW for both workloads (charlm's own optimizer; mlp's default, SGD with momentum, keeps
#: one buffer per parameter, AdamW two): the state is three times the parameters
LR = 1e-3


def dcp_kind(asked: str = "process") -> tuple[Any, str]:
    """The ``async_checkpointer_type`` to pass (None: the argument does not exist here) and
    what it is, in words."""
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError:
        return None, "thread-based (this torch has no AsyncCheckpointerType)"
    if asked == "thread":
        return AsyncCheckpointerType.THREAD, "thread-based (asked for)"
    if hasattr(AsyncCheckpointerType, "PROCESS"):
        return AsyncCheckpointerType.PROCESS, "process-based"
    return AsyncCheckpointerType.THREAD, "thread-based (this torch has no PROCESS type)"


class Dcp:
    """torch's async_save into a ring of two directories, one save in flight at most."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        root: Path,
        asked: str = "process",
    ) -> None:
        self.model, self.optimizer, self.root = model, optimizer, root
        self.kind, self.how = dcp_kind(asked)
        # A thread-based save runs its collectives in a thread of this process, alongside the
        # training thread's: on a group of their own (torch's advice), not the training one's.
        # Collective: every rank builds its Dcp at the same point.
        self.group = dist.new_group(backend="gloo") if self.how.startswith("thread") else None
        self.pending: Future | None = None
        self.saves = 0
        self.completed = 0

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def save(self, checkpoint_id: Path | None = None) -> None:
        """Start a save; the previous one must have been waited for."""
        assert self.pending is None, "wait() before the next save"
        if checkpoint_id is None:
            checkpoint_id = self.root / f"slot-{self.saves % 2}"
            self.saves += 1
        kwargs: dict[str, Any] = {"process_group": self.group}
        if self.kind is not None:
            kwargs["async_checkpointer_type"] = self.kind
        response = dcp.async_save(self.state(), checkpoint_id=str(checkpoint_id), **kwargs)
        # torch 2.9+ may answer an AsyncSaveResponse (async staging); the upload is what ends.
        self.pending = getattr(response, "upload_completion", response)

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()
            self.completed += 1


def block_steps(block: int, every: int) -> int:
    """Steps in a block with a save every ``every`` steps: ``block`` or more, a multiple of
    ``every``, at least two saves (a block without saves: ``block``)."""
    return every * max(2, -(-block // every)) if every > 1 else block


def worker(job: dict[str, Any]) -> dict[str, Any]:
    gs.init()
    torch.set_num_threads(1)
    if job.get("prefix_store", True):
        # DCP's checkpoint process joins a gloo group of its own; by default rank 0's hosts a
        # new TCP store, which binds every interface. With this it uses the store the launcher
        # already serves on loopback instead (a client of it, under a prefix): nothing new
        # listens. The saves themselves are the same.
        os.environ.setdefault("DCP_USE_PREFIX_STORE", "1")
    extra = {"params": job["params"]} if job["workload"] == "mlp" else {}
    workload = make_workload(job["workload"], seed=job["seed"], **extra)
    model = workload.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sync = gs.Synchronizer(model, optimizer, strategy="bsp")
    rank, workers = sync.rank, sync.layout.workers
    root = Path(job["directory"])
    gs_dir, dcp_root = root / "gradsync", root / "dcp"
    ckpt = Dcp(model, optimizer, dcp_root, job.get("dcp", "process"))
    at = [0]  # the next step's data position

    def train() -> None:
        i = at[0]
        with sync.step(samples=BATCH) as s:
            x, y = workload.batch(i, BATCH * workers, rank * BATCH, (rank + 1) * BATCH)
            loss = workload.loss(model, x, y)
            loss.backward()
            s.loss = loss.detach()
        at[0] = i + 1

    gs_saves: dict[int, str] = {}  # the step each gradsync save was taken at -> its kind

    def gs_save(kind: str) -> float:
        t0 = time.perf_counter()
        sync.save(gs_dir, wait=False, data_position=at[0])
        seconds = time.perf_counter() - t0
        gs_saves[sync.step_count] = kind
        return seconds

    def block(kind: str, steps: int, every: int) -> tuple[float, list[float], list[float]]:
        """Mean seconds per step of one block of ``steps`` steps (a save before every
        ``every``), and each save's seconds on the training thread (for DCP, also the part of
        them spent waiting for it)."""
        name = kind.partition("@")[0]
        saves: list[float] = []
        waits: list[float] = []
        dist.barrier()
        t0 = time.perf_counter()
        if name == NONE:
            for _ in range(steps):
                train()
        elif name == "gradsync":
            for _ in range(steps // every):
                saves.append(gs_save(kind))
                for _ in range(every):
                    train()
        else:
            for _ in range(steps // every):
                s0 = time.perf_counter()
                ckpt.save()
                call = time.perf_counter() - s0
                for _ in range(every):
                    train()
                w0 = time.perf_counter()
                ckpt.wait()
                waits.append(time.perf_counter() - w0)
                saves.append(call + waits[-1])
        dist.barrier()
        return (time.perf_counter() - t0) / steps, saves, waits

    # DCP's checkpoint process starts at the first save and logs every save at INFO to the
    # stderr it inherits (torch sets that level): it inherits a file instead. Its errors come
    # back to the training process, which raises them.
    log = root / f"dcp-process-{rank}.log"
    with _stderr_to(log):
        try:
            ckpt.save(dcp_root / "start")
            ckpt.wait()
        except BaseException:
            print(log.read_text()[-4000:], file=sys.__stderr__)
            raise
    kinds = [NONE] + [f"{c}@{n}" for n in job["every"] for c in ("gradsync", "dcp")]
    seen: set[str] = set()  # gradsync's step directories, as listed after each block
    for kind in kinds:  # warm-up, untimed: two saves of each checkpointer, a step after each
        block(kind, 2, 1)
        seen.update(_step_dirs(gs_dir))
    warm_saves = dict(gs_saves)
    step_times: dict[str, list[float]] = {k: [] for k in kinds}
    save_times: dict[str, list[float]] = {k: [] for k in kinds}
    wait_times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(job["repeats"]):
        for kind in order(kinds, r):
            every = int(kind.partition("@")[2] or 1)
            mean, saves, waits = block(kind, block_steps(job["block"], every), every)
            step_times[kind].append(mean)
            save_times[kind] += saves
            wait_times[kind] += waits
            seen.update(_step_dirs(gs_dir))
    timed = {s: k for s, k in gs_saves.items() if s not in warm_saves}
    files = {k: sum(1 for s in timed if timed[s] == k and f"step-{s:06d}" in seen) for k in kinds}
    checks = _check(sync, ckpt, model, optimizer, gs_dir, dcp_root, at[0])
    sync.report()
    sync.close()
    return {
        "rank": rank,
        "step_times": step_times,
        "save_times": save_times,
        "wait_times": wait_times,
        "gradsync_saves": {k: sum(1 for s in timed if timed[s] == k) for k in kinds},
        "gradsync_files": files,
        "dcp_saves": ckpt.saves,
        "dcp_completed": ckpt.completed,
        "dcp_how": ckpt.how,
        "dcp_prefix_store": "with prefix store" in log.read_text(),
        "checks": checks,
        "state_bytes": sum(t.numel() * t.element_size() for t in _tensors(ckpt.state())),
    }


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 into ``path`` meanwhile: what a child started now inherits."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _step_dirs(directory: Path) -> set[str]:
    """gradsync's committed step directories (a manifest written) in ``directory`` now."""
    if not directory.exists():
        return set()
    return {p.parent.name for p in directory.glob("step-*/MANIFEST.json")}


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _tensors(v)]
    return []


def _map(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, fn) for v in tree]
    return copy.deepcopy(tree)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _check(
    sync: Any,
    ckpt: Dcp,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    gs_dir: Path,
    dcp_root: Path,
    position: int,
) -> dict[str, Any]:
    """Save the same state with both, load each back, compare with the state saved."""
    reference = _map(ckpt.state(), lambda t: t.detach().clone())
    step = sync.step_count
    sync.save(gs_dir, wait=False, data_position=position)
    sync.wait_for_checkpoints()  # every rank: the held snapshot is written, rank 0 commits
    final = dcp_root / "final"
    ckpt.save(final)
    ckpt.wait()
    dist.barrier()
    out: dict[str, Any] = {}
    # The ring's newest save, from the timed blocks: complete (its metadata written).
    out["dcp_ring_complete"] = all((dcp_root / f"slot-{k}" / ".metadata").exists() for k in (0, 1))
    target = _map(reference, lambda t: torch.zeros_like(t))
    dcp.load(target, checkpoint_id=str(final))
    out["dcp_loads_equal"] = _equal(target, reference)
    out["dcp_bytes"] = _size(final)
    # gradsync: overwrite what it must restore, then load.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    v.zero_()
    extra = sync.load(gs_dir)
    out["gradsync_loads_equal"] = _equal(ckpt.state(), reference)
    out["gradsync_extra_ok"] = (
        extra is not None and extra.get("data_position") == position and extra["step"] == step
    )
    out["gradsync_bytes"] = _size(gs_dir / f"step-{step:06d}")
    return out
