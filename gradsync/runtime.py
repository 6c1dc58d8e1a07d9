"""Process-group set-up: ``gs.init()`` from torchrun's environment, backend choice, world info."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from gradsync.errors import UsageError
from gradsync.stores import process_group_store

#: the process group's collective timeout when gs.init() is not given one: torch's default,
#: as for a DDP script. It bounds the user's own collectives; gradsync's are bounded by the
#: Synchronizer's ``timeout_s`` while it runs (see gradsync.checks.diagnose).
DEFAULT_TIMEOUT_S = default_pg_timeout.total_seconds()
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


BACKENDS = ("gloo", "nccl")


def default_backend() -> str:
    """NCCL when this process can see a CUDA device, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def choose_backend(requested: str, local_processes: int) -> str:
    """The backend ``gradsync run --backend`` means: ``auto`` takes NCCL where every process
    on this machine gets a GPU of its own (NCCL cannot share one between ranks), else gloo
    (the model then trains on the CPU); ``gloo`` and ``nccl`` are taken as they are."""
    if requested != "auto":
        return requested
    if default_backend() == "nccl" and torch.cuda.device_count() >= local_processes:
        return "nccl"
    return "gloo"


def check_nccl(local_rank: int, local_processes: int) -> None:
    """Refuse NCCL, before any process group is made, where a rank would have no GPU of its
    own: torch's own errors come later and do not say what to change."""
    if not dist.is_nccl_available():
        raise UsageError("backend 'nccl' is not available in this torch build; use 'gloo'")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UsageError(
            "backend 'nccl' needs a CUDA device and this process sees none; use 'gloo' "
            "(gs.init(backend='gloo'), gradsync run --backend gloo)"
        )
    if local_rank >= count:
        raise UsageError(
            f"backend 'nccl' needs one GPU per process: this machine runs {local_processes} "
            f"process(es) and this process sees {count} GPU(s) (local rank {local_rank}); "
            f"launch at most {count} per machine, or use 'gloo' (gradsync run --backend gloo)"
        )


def init(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group described by torchrun's environment variables, or, when none of
    them is set (``python train.py``), make a world of one: a single-process group whose store
    lives in this process, so nothing listens on a port and every strategy that needs no
    second rank runs unchanged.

    ``timeout_s`` is the group's collective timeout (torch's default, 30 minutes, unless
    given); gradsync's own waits have the Synchronizer's ``timeout_s`` instead.

    Idempotent: a second call (or a call after the user initialised torch.distributed
    themselves) does nothing. Picks NCCL on CUDA, gloo on CPU, unless ``backend`` is given.
    """
    if dist.is_initialized():
        return
    missing = [k for k in _REQUIRED_ENV if k not in os.environ]
    if missing and len(missing) < len(_REQUIRED_ENV):
        raise UsageError(
            f"gs.init() found part of the torchrun environment, but {', '.join(missing)} "
            "is not set: launch with `torchrun --nproc_per_node=N script.py` or `gradsync run`, "
            "or unset RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT to run as one process"
        )
    chosen = backend or default_backend()
    if chosen not in BACKENDS:
        raise UsageError(f"backend {chosen!r} is not supported; valid: 'gloo', 'nccl'")
    if chosen == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        check_nccl(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)))
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if missing:  # none of it: a world of one
        dist.init_process_group(
            chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    # Where rank 0 serves the store itself, torch's env:// would have it listen on every
    # interface: make it here, on MASTER_ADDR only (None: env:// does no such thing).
    store = process_group_store(timeout)
    if store is None:
        dist.init_process_group(chosen, timeout=timeout)
        return
    rank_, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(chosen, store=store, rank=rank_, world_size=world, timeout=timeout)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def device() -> torch.device:
    """The device this rank's tensors belong on for its backend."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def require_initialized(what: str) -> None:
    if not is_initialized():
        raise UsageError(
            f"{what} needs torch.distributed: call gs.init() first "
            "(under torchrun or gradsync run), or init_process_group yourself"
        )
