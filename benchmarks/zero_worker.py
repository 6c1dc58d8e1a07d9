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
import threading
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
from gradsync.strategies import ZeroStage1, ZeroStage2
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
#: after ``zero:1`` or ``zero:2`` in ``--strategies``: its whole-tensor layout forced
#: (``layout="whole"``), beside the rows layout it takes by default for AdamW (issue 47)
WHOLE = "/whole"


def strategy_of(spec: str) -> Any:
    """What ``gs.Synchronizer`` is given for a spec of ``--strategies``."""
    if spec == "zero:1" + WHOLE:
        return ZeroStage1(layout="whole")
    if spec == "zero:2" + WHOLE:
        return ZeroStage2(layout="whole")
    return spec


class DeepMLP:
    """A plain deep MLP: ``layers`` ``Linear(dim, dim)``, each followed by a ReLU, regressing a
    fixed random target; AdamW with weight decay 0.01, as the transformer. ``plain``: the
    layers are attributes of one module (no ``nn.Sequential``), as a user's own model often
    is, which no list-based wrapping rule sees."""

    name = "mlp"
    default_lr = 1e-4

    def __init__(self, dim: int, layers: int, plain: bool = False) -> None:
        self.dim, self.layers, self.plain = dim, layers, plain

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        linears = [nn.Linear(self.dim, self.dim) for _ in range(self.layers)]
        if self.plain:
            return _PlainMLP(linears)
        return nn.Sequential(*(m for lin in linears for m in (lin, nn.ReLU())))

    def make_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)

    def batch(self, i: int, size: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(size, self.dim, generator=g)
        return x[lo:hi], x[lo:hi].flip(1)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(x), y)


class _PlainMLP(nn.Module):
    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        for k, lin in enumerate(linears):
            self.add_module(f"fc{k}", lin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.children():
            x = torch.relu(lin(x))
        return x


def workload(job: dict[str, Any]) -> Any:
    """The model a part trains: the charlm transformer, widened and deepened to the job's
    size, or a deep MLP (``job["model"]["kind"]``); AdamW with weight decay 0.01."""
    m = job["model"]
    kind = m.get("kind", "charlm")
    if kind in ("mlp", "plain-mlp"):
        return DeepMLP(m["dim"], m["layers"], plain=kind == "plain-mlp")
    return CharLM(seed=0, dim=m["dim"], layers=m["layers"], heads=m["heads"], context=m["context"])


def blocks(model: nn.Module) -> list[nn.Module]:
    """The per-block units torch's FSDP2 examples wrap: a transformer's blocks, an MLP's
    layers."""
    listed = getattr(model, "blocks", model)
    return [m for m in listed.children() if next(m.parameters(), None) is not None]


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
    that are not None (the parameters' and the optimizer's tensors'), and every tensor in the
    optimizer's state."""
    params = list(model.parameters())
    params += [p for g in optimizer.param_groups for p in g["params"]]
    # the tensors the optimizer holds state for: under zero:1/2 by rows this rank's pieces,
    # views of the parameters, whose .grad are its rows of the gradient (zero:2)
    params += [p for p in optimizer.state if torch.is_tensor(p)]
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


class _RssSampler:
    """Samples this process's resident memory every few milliseconds on a thread of its own,
    keeping the most seen in each phase of the step (``phase(name)`` switches): where a peak
    comes from, which the process's high-water mark alone does not say."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.peaks: dict[str, int] = {}
        self._phase = "build"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def phase(self, name: str) -> None:
        self._sample()
        self._phase = name
        self._sample()

    def _sample(self) -> None:
        rss = _rss_bytes()
        self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), rss)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._sample()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peaks


def memory_rank(job: dict[str, Any]) -> dict[str, Any]:
    """Train ``job["steps"]`` steps under one configuration (a gradsync strategy through
    ``gs.Synchronizer`` with its defaults but DDP's bucket size, as a user's loop would, or
    one of torch's own pieces driven directly, as a DDP script would) and say what this rank
    held after the last step, its peak resident memory, and the most seen in each phase."""
    _start(job)
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_start = _rss_bytes()
    sampler = _RssSampler()
    wl = workload(job)
    with torch.device("meta"):  # the sizes, without a second model's memory
        numels = [p.numel() for p in wl.build_model().parameters()]
    per_rank = job["batch"]
    name = job["strategy"]
    sync = None
    if name in (ZERO_OPT, FSDP, DDP):
        config = build(name, wl, per_rank)
        model, net, optimizer = config.model, config.net, config.optimizer
        stepper: Any = config.stepper
    else:
        model = net = wl.build_model()
        optimizer = stepper = wl.make_optimizer(model, wl.default_lr)
        sync = gs.Synchronizer(model, optimizer, strategy=strategy_of(name), bucket_mb=BUCKET_MB)
    for i in range(job["steps"]):
        x, y = wl.batch(i, per_rank * world, rank * per_rank, (rank + 1) * per_rank)
        if sync is not None:
            with sync.step(samples=per_rank):
                sampler.phase("forward")
                loss = wl.loss(net, x, y)
                sampler.phase("backward")
                loss.backward()
                sampler.phase("exchange and update")
        else:
            stepper.zero_grad(set_to_none=True)
            sampler.phase("forward")
            loss = wl.loss(net, x, y)
            sampler.phase("backward")
            loss.backward()
            sampler.phase("exchange and update")
            stepper.step()
        sampler.phase("between steps")
    phases = sampler.stop()
    out = {
        "held": held(model, optimizer),
        "peak_rss": _peak_rss_bytes(),
        "rss_start": rss_start,
        "rss_end": _rss_bytes(),
        "phases": {k: v - rss_start for k, v in phases.items()},
        "numels": numels,
    }
    if sync is not None:
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
    #: torch's pieces: the module the forward calls (DDP's wrapper) and the optimizer stepped
    net: Any = None
    stepper: Any = None


def _plain(wl: Any, per_rank: int, net: nn.Module, opt: Any) -> Callable[[int], Any]:
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


def build(name: str, wl: Any, per_rank: int) -> Config:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    if name.startswith(GRADSYNC) or name in (DDP, COMPUTE):
        mode = "gradsync" if name.startswith(GRADSYNC) else "ddp" if name == DDP else name
        options: dict[str, Any] = {}
        if mode == "gradsync":
            options["strategy"] = strategy_of(name.removeprefix(GRADSYNC))
        t = Trainer(mode, wl, per_rank * world, bucket_mb=BUCKET_MB, report_loss=False, **options)
        sync = t.sync
        close = sync.close if sync is not None else lambda: None
        return Config(t.step, t.model, t.opt, close, net=t.net, stepper=t.opt)
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
        return Config(_plain(wl, per_rank, net, zero), model, zero.optim, net=net, stepper=zero)
    if name in (FSDP, FSDP_NO_RESHARD):
        mesh = init_device_mesh("cpu", (world,))
        reshard = name == FSDP
        # one unit per transformer block (MLP layer) and one for the rest, as FSDP2's examples
        for block in blocks(model):
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=wl.default_lr, weight_decay=WEIGHT_DECAY)
        return Config(_plain(wl, per_rank, model, opt), model, opt, net=model, stepper=opt)
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
