"""Process-group set-up: ``gs.init()`` from torchrun's (or SLURM's) environment, backend choice,
world info."""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import re
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from gradsync import exit_safety
from gradsync.checks import secret
from gradsync.errors import UsageError
from gradsync.processes import elastic_env
from gradsync.processes.stores import process_group_store

#: the process group's collective timeout when gs.init() is not given one: torch's default,
#: as for a DDP script. It bounds the user's own collectives; gradsync's are bounded by the
#: Synchronizer's ``timeout_s`` while it runs (see gradsync.checks.diagnose).
DEFAULT_TIMEOUT_S = default_pg_timeout.total_seconds()
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Under SLURM without a MASTER_PORT, rank 0's store listens on this base plus the job id modulo
#: SLURM_PORT_SPAN: the same on every task of the job with nothing exchanged, below Linux's
#: ephemeral ports (32768 and up), and different for jobs whose ids differ by less than the span.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000
#: Where rank 0's host is found under SLURM: the first host of the first of these that is set.
NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


BACKENDS = ("gloo", "nccl")
logger = logging.getLogger("gradsync.runtime")


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
    """Join the process group described by torchrun's environment variables, or by SLURM's
    under ``srun`` when torchrun's are absent (:func:`slurm_environment`: they are exported as
    torchrun's, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, for
    the script's own use too), or, when neither is set (``python train.py``), make a world of
    one: a single-process group whose store lives in this process (no store port; gloo's
    transport still listens on 127.0.0.1), and every strategy that needs no second rank runs
    unchanged.

    ``timeout_s`` is the group's collective timeout (torch's default, 30 minutes, unless
    given); gradsync's own waits have the Synchronizer's ``timeout_s`` instead.

    Idempotent: a second call (or a call after the user initialised torch.distributed
    themselves) does nothing. Picks NCCL on CUDA, gloo on CPU, unless ``backend`` is given;
    ``backend="nccl"`` in a world of one on a machine without CUDA takes gloo, with a notice on
    the ``gradsync.runtime`` logger.
    """
    if dist.is_initialized():
        return
    slurm = slurm_environment(os.environ)
    if slurm is not None:
        for name, value in slurm.items():
            os.environ.setdefault(name, value)  # a MASTER_ADDR or MASTER_PORT set stays
    missing = [k for k in _REQUIRED_ENV if k not in os.environ]
    if missing and len(missing) < len(_REQUIRED_ENV):
        raise UsageError(
            f"gs.init() found part of the torchrun environment, but {', '.join(missing)} "
            "is not set: launch with `torchrun --nproc_per_node=N script.py`, `gradsync run` "
            "or `srun` (docs/launching.md), or unset RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT to run as one process"
        )
    chosen = backend or default_backend()
    if chosen not in BACKENDS:
        raise UsageError(f"backend {chosen!r} is not supported; valid: 'gloo', 'nccl'")
    if chosen == "nccl" and missing and not _sees_cuda():
        chosen = _world_of_one_without_cuda()
    if chosen == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        check_nccl(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)))
        torch.cuda.set_device(local_rank)
    _make_group(chosen, datetime.timedelta(seconds=timeout_s), world_of_one=bool(missing))
    if not missing and not secret.from_environment() and dist.get_world_size() > 1:
        # Under plain torchrun no run secret is given: the ranks agree on one now, over the
        # group and never through its store, which any local process can reach.
        os.environ[secret.SECRET_ENV] = secret.agree(None)
    # Made here, so destroyed at exit, after gloo's threads are done (gradsync.exit_safety).
    exit_safety.own_the_group()


def _make_group(backend: str, timeout: datetime.timedelta, *, world_of_one: bool) -> None:
    if world_of_one:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    # Where rank 0 serves the store itself, torch's env:// would have it listen on every
    # interface: make it here, on MASTER_ADDR only (None: env:// does no such thing).
    store = process_group_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank_, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, store=store, rank=rank_, world_size=world, timeout=timeout)


def _sees_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _world_of_one_without_cuda() -> str:
    """The backend for ``gs.init(backend="nccl")`` run alone (``python train.py``) on a machine
    without CUDA: gloo, with a notice. The DDP script being ported makes no process group
    when run alone, so it runs there; refusing would make the port fail where the original
    does not. Several ranks asking for NCCL without a GPU are still refused (``check_nccl``):
    the backend must be the same on every rank, and only the user can pick it."""
    logger.warning(
        "gs.init(backend='nccl'): this process sees no CUDA device and runs alone (no "
        "torchrun, gradsync run or srun environment), so it makes a world of one on 'gloo' "
        "instead; pass backend='gloo', or no backend, to do so without this notice"
    )
    return "gloo"


def slurm_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """torchrun's variables for a task that ``srun`` started, made from SLURM's: ``RANK`` from
    ``SLURM_PROCID``, ``WORLD_SIZE`` from ``SLURM_NTASKS``, ``LOCAL_RANK`` from
    ``SLURM_LOCALID``, ``MASTER_ADDR`` the first host of the step's node list
    (:data:`NODELIST_VARIABLES`), ``MASTER_PORT`` the environment's, else ``SLURM_PORT_BASE`` plus
    ``SLURM_JOB_ID`` modulo ``SLURM_PORT_SPAN``; ``LOCAL_WORLD_SIZE`` from
    ``SLURM_NTASKS_PER_NODE`` where that is one number.

    None where SLURM does not describe the world: no ``SLURM_PROCID`` (not a task of ``srun``),
    or torchrun's ``RANK`` or ``WORLD_SIZE`` is set (torchrun under ``srun``: its are the
    workers'). A variable that is there but malformed is refused, named, with its value."""
    if "SLURM_PROCID" not in environ or "RANK" in environ or "WORLD_SIZE" in environ:
        return None
    world = _slurm_int(environ, "SLURM_NTASKS", minimum=1)
    rank_ = _slurm_int(environ, "SLURM_PROCID", minimum=0)
    if rank_ >= world:
        raise UsageError(f"SLURM_PROCID={rank_} is not below SLURM_NTASKS={world}")
    out = {
        "RANK": str(rank_),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(_slurm_int(environ, "SLURM_LOCALID", minimum=0)),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or _slurm_master(environ),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(slurm_default_port(environ)),
    }
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "")
    if per_node.isdigit():  # else a list such as "2(x3),1": no one number for every node
        out["LOCAL_WORLD_SIZE"] = per_node
    return out


def _slurm_int(environ: Mapping[str, str], name: str, minimum: int) -> int:
    text = environ.get(name)
    if text is None:
        raise UsageError(
            f"gs.init() under SLURM (SLURM_PROCID is set) needs {name}, which is not set: "
            "launch the script with srun (docs/launching.md)"
        )
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise UsageError(f"{name}={text!r} is not an integer >= {minimum}")
    return value


def _slurm_master(environ: Mapping[str, str]) -> str:
    # The step's hosts first: srun places task 0 on the first host of its step, which may be
    # fewer hosts than the job's.
    for name in NODELIST_VARIABLES:
        if environ.get(name):
            return next(expand_nodelist(environ[name], name))
    raise UsageError(
        "gs.init() under SLURM needs the hosts for rank 0's address: none of "
        f"{', '.join(NODELIST_VARIABLES)} is set; set MASTER_ADDR"
    )


def slurm_default_port(environ: Mapping[str, str]) -> int:
    """Rank 0's port under SLURM when ``MASTER_PORT`` is not set: one every task of the job
    computes alike from ``SLURM_JOB_ID``."""
    text = environ.get("SLURM_JOB_ID", "")
    if not text.isdigit():
        raise UsageError(
            f"SLURM_JOB_ID={text!r} is not a job number, and rank 0's port is derived from it "
            "when MASTER_PORT is not set: set MASTER_PORT (the same on every task)"
        )
    return SLURM_PORT_BASE + int(text) % SLURM_PORT_SPAN


# One host pattern of a node list: text, then optionally [ranges], repeated ("rack[1-2]-n[1-4]").
_NODE_PART = re.compile(r"([^\[\],]*)(?:\[([^\[\]]*)\])?")


def expand_nodelist(text: str, variable: str = "SLURM_JOB_NODELIST") -> Iterator[str]:
    """The hosts of SLURM's compact node list, in order: ``node[01-03,07],gpu-a1`` gives node01,
    node02, node03, node07, gpu-a1 (a range keeps its zero padding). The whole list is checked
    first, and nothing is yielded from a malformed one: the error names ``variable``."""
    patterns: list[list[tuple[str, list[str]]]] = []
    for item in _split_top_level(text, variable):
        parts: list[tuple[str, list[str]]] = []
        pos = 0
        while pos < len(item):
            m = _NODE_PART.match(item, pos)
            if m is None or m.end() == pos:  # a stray bracket
                raise _bad_nodelist(text, variable, f"unbalanced brackets in {item!r}")
            prefix, ranges = m.group(1), m.group(2)
            parts.append((prefix, [""] if ranges is None else _ranges(ranges, text, variable)))
            pos = m.end()
        patterns.append(parts)
    return (
        "".join(prefix + suffix for (prefix, _), suffix in zip(parts, pick, strict=True))
        for parts in patterns
        for pick in itertools.product(*(values for _, values in parts))
    )


def _split_top_level(text: str, variable: str) -> list[str]:
    """``text`` cut at its commas outside brackets; an empty host refused."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise _bad_nodelist(text, variable, "unbalanced brackets")
        if char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    if depth != 0:
        raise _bad_nodelist(text, variable, "unbalanced brackets")
    if not all(items):
        raise _bad_nodelist(text, variable, "an empty host")
    return items


def _ranges(body: str, text: str, variable: str) -> list[str]:
    out = []
    for part in body.split(","):
        low, sep, high = part.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise _bad_nodelist(text, variable, f"[{body}] holds {part!r}, not N or N-M")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise _bad_nodelist(text, variable, f"the range {part!r} runs backwards")
        out += [str(n).zfill(len(low)) for n in range(first, last + 1)]
    return out


def _bad_nodelist(text: str, variable: str, why: str) -> UsageError:
    return UsageError(
        f"{variable}={text!r} is not a SLURM host list ({why}); expected host names and "
        "bracketed ranges, e.g. node[01-04,07],gpu-a1"
    )


def restart_count() -> int:
    """Which attempt of the run this process belongs to (``gradsync.processes.elastic_env``),
    for the modules that do not reach into ``processes``."""
    return elastic_env.restart_count()


def restarts_left() -> bool:
    """Whether torch's elastic agent restarts this rank's group when it fails (torchrun's and
    ``gradsync run``'s ``--max-restarts``, as the agent tells its workers)."""
    try:
        return elastic_env.restart_count() < elastic_env.max_restarts()
    except UsageError:  # asked on the way out of a failure: that failure is the one to report
        return False


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank: torch.distributed's once a group exists, else the one its launcher
    gave it (torchrun's ``RANK``, SLURM's ``SLURM_PROCID``), else 0: usable before
    ``gs.init()``, to have rank 0 alone download a data set, say."""
    if is_initialized():
        return dist.get_rank(group)
    return int(_launch_environment().get("RANK", "0"))


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """The number of ranks, as :func:`rank` finds them (1 without a launcher)."""
    if is_initialized():
        return dist.get_world_size(group)
    return int(_launch_environment().get("WORLD_SIZE", "1"))


def is_main(group: dist.ProcessGroup | None = None) -> bool:
    """Whether this is rank 0, the rank that logs, evaluates and saves."""
    return rank(group) == 0


def _launch_environment() -> Mapping[str, str]:
    """torchrun's ``RANK`` and ``WORLD_SIZE`` as ``gs.init()`` would take them: the
    environment's own, or SLURM's task id and count; checked as :func:`init` checks them.
    Only those two: the rank is known before the hosts are (a task without a node list raised
    here, though only ``gs.init()`` needs rank 0's address)."""
    env: Mapping[str, str] = os.environ
    if "SLURM_PROCID" in env and "RANK" not in env and "WORLD_SIZE" not in env:
        env = {
            "RANK": str(_slurm_int(env, "SLURM_PROCID", minimum=0)),
            "WORLD_SIZE": str(_slurm_int(env, "SLURM_NTASKS", minimum=1)),
        }
    for name in ("RANK", "WORLD_SIZE"):
        if name in env and not env[name].isdigit():
            raise UsageError(f"{name}={env[name]!r} is not an integer >= 0")
    return env


def device() -> torch.device:
    """The device this rank's tensors belong on for its backend."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def require_initialized(what: str) -> None:
    if not is_initialized():
        raise UsageError(
            f"{what} needs torch.distributed: call gs.init() first (plain `python train.py` "
            "works too: it makes a world of one; under torchrun, gradsync run or srun it joins "
            "their world), or init_process_group yourself"
        )
