"""The ranks' side of ``benchmarks.zero``, run as a subprocess of its own:

    python -m benchmarks.zero_worker JOB.json OUT.json

``JOB`` says which part (``memory``: one strategy, fresh processes, so that each rank's peak
resident memory is that strategy's own; ``time``: every configuration interleaved in the same
2 processes) and the model; the ranks are started by gradsync's launcher (torchrun's machinery,
gloo on loopback, a free port), and ``OUT`` receives every rank's result as JSON. The parent
gives this process a timeout and kills its whole process group when it runs out.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from benchmarks.harness import time_interleaved
from benchmarks.steps import Trainer
from gradsync.workloads.charlm import CharLM

BUCKET_MB = 25.0  # gradsync's default, and DDP's
# torch's names of the configurations the timing part can run (gradsync's are "gradsync SPEC")
DDP, ZERO_OPT, FSDP_NO_RESHARD, FSDP, COMPUTE = (
    "DDP",
    "DDP + ZeroRedundancyOptimizer",
    "FSDP2 fully_shard, reshard_after_forward=False",
    "FSDP2 fully_shard",
    "compute-only",
)
GRADSYNC = "gradsync "


def workload(job: dict[str, Any]) -> CharLM:
    """The model every part trains: the charlm transformer, widened and deepened to the job's
    size; AdamW (the workload's own optimizer, weight decay 0.01)."""
    m = job["model"]
    return CharLM(seed=0, dim=m["dim"], layers=m["layers"], heads=m["heads"], context=m["context"])


def _start(job: dict[str, Any]) -> None:
    gs.init(backend="gloo", timeout_s=job["timeout_s"])
    torch.set_num_threads(1)
    # FSDP2 warns on every forward that the model returns a view (this loss does no in-place op
    # on it), and zero:3 may warn as it lands: the tables, not the warnings, are the output.
    warnings.filterwarnings("ignore", category=UserWarning)


# What a rank holds ------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters, gradients and optimizer state), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped): what this rank holds
    for them, a view of a bucket counting as the whole bucket, padding included, and a
    storage freed to zero bytes (a parameter resharded away) as nothing."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        if s.nbytes() > 0:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def held(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds between steps: parameters (or their local shards), the gradients
    that are not None, and every tensor in the optimizer's state."""
    params = list(model.parameters())
    params += [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params),
        "optimizer": storage_bytes(state),
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# Part 1: memory, one strategy per launch ---------------------------------------------------------


def memory_rank(job: dict[str, Any]) -> dict[str, Any]:
    """Train ``job["steps"]`` steps under one gradsync strategy, as a user's loop would, and
    say what this rank held after the last step and its peak resident memory."""
    _start(job)
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_start = _rss_bytes()
    wl = workload(job)
    model = wl.build_model()
    optimizer = wl.make_optimizer(model, wl.default_lr)
    sync = gs.Synchronizer(model, optimizer, strategy=job["strategy"], bucket_mb=BUCKET_MB)
    per_rank = job["batch"]
    for i in range(job["steps"]):
        with sync.step(samples=per_rank):
            x, y = wl.batch(i, per_rank * world, rank * per_rank, (rank + 1) * per_rank)
            wl.loss(model, x, y).backward()
    out = {
        "held": held(model, optimizer),
        "peak_rss": _peak_rss_bytes(),
        "rss_start": rss_start,
        "rss_end": _rss_bytes(),
        "numels": [p.numel() for p in wl.build_model().parameters()],
    }
    sync.close()
    return out


# Part 2: step time, every configuration interleaved in the same processes ------------------------


@dataclass
class Config:
    """One configuration on this rank: its step, and what holds its tensors."""

    step: Callable[[int], Any]
    model: nn.Module
    optimizer: torch.optim.Optimizer  # the one that holds the optimizer state
    close: Callable[[], None] = field(default=lambda: None)


def _plain(wl: CharLM, per_rank: int, net: nn.Module, opt: Any) -> Callable[[int], Any]:
    """torch's own pieces driven directly, as a DDP script does."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(i: int) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        x, y = wl.batch(i, per_rank * world, rank * per_rank, (rank + 1) * per_rank)
        loss = wl.loss(net, x, y)
        loss.backward()
        opt.step()
        return loss

    return step


def build(name: str, wl: CharLM, per_rank: int) -> Config:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    if name.startswith(GRADSYNC) or name in (DDP, COMPUTE):
        mode = "gradsync" if name.startswith(GRADSYNC) else "ddp" if name == DDP else name
        options: dict[str, Any] = {}
        if mode == "gradsync":
            options["strategy"] = name.removeprefix(GRADSYNC)
        t = Trainer(mode, wl, per_rank * world, bucket_mb=BUCKET_MB, report_loss=False, **options)
        sync = t.sync
        return Config(t.step, t.model, t.opt, sync.close if sync is not None else lambda: None)
    model = wl.build_model()
    if name == ZERO_OPT:
        net = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=wl.default_lr,
            weight_decay=WEIGHT_DECAY,
        )
        # the state lives in the AdamW that steps this rank's partition
        return Config(_plain(wl, per_rank, net, zero), model, zero.optim)
    if name in (FSDP, FSDP_NO_RESHARD):
        mesh = init_device_mesh("cpu", (world,))
        reshard = name == FSDP
        # one unit per transformer block and one for the rest, as FSDP2's examples wrap a model
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=wl.default_lr, weight_decay=WEIGHT_DECAY)
        return Config(_plain(wl, per_rank, model, opt), model, opt)
    raise ValueError(f"unknown configuration {name!r}")


WEIGHT_DECAY = 0.01  # as CharLM.make_optimizer


def _full(p: torch.Tensor) -> torch.Tensor:
    full = getattr(p, "full_tensor", None)  # FSDP2: a collective, every rank in the same order
    return (full() if callable(full) else p).detach()


def time_rank(job: dict[str, Any]) -> dict[str, Any] | None:
    """Every configuration's blocks of steps, interleaved, order rotated by repeat; then what
    each held and how far its parameters are from DDP's after the same steps."""
    _start(job)
    wl = workload(job)
    configs: dict[str, Config] = {}
    notes: dict[str, str] = {}
    for name in job["configs"]:
        error = ""
        try:
            configs[name] = build(name, wl, job["batch"])
        except Exception as exc:  # a strategy that refuses this set-up: a note, not a crash
            error = f"{type(exc).__name__}: {exc}"
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        if any(errors):
            configs.pop(name, None)
            notes[name] = next(e for e in errors if e)
    steps = {name: c.step for name, c in configs.items()}
    times = time_interleaved(steps, job["repeats"], job["steps"], warmup=job["warmup"])
    holdings = {name: held(c.model, c.optimizer) for name, c in configs.items()}
    diffs: dict[str, float] = {}
    if DDP in configs:
        ref = [_full(p) for p in configs[DDP].model.parameters()]
        for name, c in configs.items():
            got = [_full(p) for p in c.model.parameters()]
            diffs[name] = max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True))
    for c in configs.values():
        c.close()
    numel = sum(p.numel() for p in wl.build_model().parameters())
    comm = collectives(numel, job["repeats"])
    if dist.get_rank() != 0:
        return {"held": holdings}
    out = {"times": times, "held": holdings, "diffs": diffs, "notes": notes}
    return {**out, "comm": comm, "comm_mb": numel * 4 / 1e6}


def collectives(numel: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of the exchanges the stages are built of, for a float32 tensor of
    ``numel`` elements split in ``world`` chunks: what zero:1/2 send (the parameters by one
    all-gather on NCCL, by one broadcast from each rank of its chunk on gloo; zero:2's gradient
    by one reduce-scatter on NCCL, by a ring of send/receive pairs on gloo) beside what BSP
    sends (one all-reduce). Interleaved, between barriers."""
    from gradsync.strategies.zero_shards import (
        all_gather_flat,
        reduce_scatter_flat,
        ring_reduce_scatter,
    )

    world = dist.get_world_size()
    chunk = -(-numel // world)
    full, mine = torch.zeros(chunk * world), torch.ones(chunk)
    chunks = list(full.chunk(world))

    def broadcasts() -> None:
        works = [dist.broadcast(c, src=r, async_op=True) for r, c in enumerate(chunks)]
        for w in works:
            w.wait()

    ops: dict[str, Callable[[], Any]] = {
        "all_gather": lambda: all_gather_flat(full, mine),
        "broadcasts": broadcasts,
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: reduce_scatter_flat(mine, full),
        "ring": lambda: ring_reduce_scatter(mine, full, dist.get_rank(), world),
    }
    times: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(repeats):
        for name in ops:
            dist.barrier()
            t0 = time.perf_counter()
            ops[name]()
            times[name].append(time.perf_counter() - t0)
            full.fill_(1.0)  # no overflow across repeats of the all-reduce
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> int:
    from benchmarks import zero_worker  # the ranks unpickle the entry point by this name
    from gradsync.processes.launch import launch

    job_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    job = json.loads(job_path.read_text())
    results = launch(getattr(zero_worker, f"{job['part']}_rank"), (job,), nproc=job["nproc"])
    out_path.write_text(json.dumps({str(r): v for r, v in sorted(results.items())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
