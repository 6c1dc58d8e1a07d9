"""Every private torch API gradsync uses, in one place, each with its fallback.

torch offers no public way to do these things, and each has changed name or shape across
releases. Callers get a plain answer (None, False, an empty list) when the private API is
missing, so a torch that drops one degrades a feature instead of breaking a run; each fallback
is tested in ``tests/unit/test_compat.py``.

- ``default_group`` / ``default_store``: the process group and store ``init_process_group``
  made (``distributed_c10d._get_default_group`` / ``_get_default_store``).
- ``collective_timeout`` / ``set_collective_timeout``: read and change a live group's
  collective timeout (the backends' ``options._timeout`` and ``_set_default_timeout``), so
  that ``Synchronizer(timeout_s=...)`` bounds every wait without a new group.
- ``mark_optimizer_stepped``: the flag torch's ``optimizer.step`` wrapper sets
  (``_opt_called``), for strategies whose update runs elsewhere (parameter servers), so an LR
  scheduler stepped on the worker does not warn that the optimizer never stepped.
- ``scaler_unscaled`` / ``scaler_found_inf``: whether ``GradScaler.unscale_(optimizer)`` has
  run since the last ``update()``, and the inf/NaN counts it recorded for ``optimizer`` (its
  ``_per_optimizer_states``), so that ``zero:2``, where each rank unscales only its shard of the
  gradient, can make every rank's scaler decide on the whole gradient (as torch's FSDP
  ``ShardedGradScaler`` does by all-reducing the same counts).
- ``override_shared_store_server``: have torch's rendezvous handler make the TCPStore it shares
  with its workers through our function (its ``_create_tcp_store_server``), so that the store
  listens on the run's address instead of every interface (see ``gradsync.processes.stores``; this
  one
  and its fallback are tested in ``tests/unit/test_stores.py``).
- ``fsdp2``: FSDP2's ``fully_shard``, ``DTensor`` and ``DeviceMesh``, public from torch 2.6
  (``torch.distributed.fsdp``, ``torch.distributed.tensor``) and private before
  (``torch.distributed._composable.fsdp``, ``torch.distributed._tensor``); None where this
  torch has neither, so ``zero:3`` is refused with that reason.
- ``is_fsdp_module`` / ``fsdp_comms``: which modules ``fully_shard`` wrapped, and the
  all-gather and reduce-scatter objects each of their FSDP2 parameter groups calls
  (``_get_fsdp_state()._fsdp_param_groups``, or ``_fsdp_param_group`` in earlier torch, their
  ``_all_gather_comm`` and ``_reduce_scatter_comm``), so that ``zero:3`` can hand FSDP2, through
  the public ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (torch >= 2.9), timed
  collectives that wrap whatever the module had, a user's own custom collectives included.
  None where torch lacks those setters or hides the groups: ``zero:3`` then leaves FSDP2's
  collectives alone, and their time counts as compute.
- ``fsdp_forget_forwards``: clears the forward order FSDP2 keeps for its backward prefetch
  (``comm_ctx.post_forward_order`` and each parameter group's ``_post_forward_indices``), which
  only a backward empties: a forward run by rank 0 alone between steps (an evaluation inside
  ``sync.unsharded()``) left entries that made rank 0's next backward prefetch one all-gather
  its peers never post (tested in ``tests/ranks/test_zero_traps.py``). Nothing where torch
  names them otherwise: the ranks then hang as before, until the step's timeout names them.
- ``in_backward_pass``: whether a backward pass is running on this thread
  (``torch._C._current_graph_task_id``), where a torch function mode entered would not
  outlive the pass (``zero_shards.LocalClipGuard``, armed from ``gs.DistributedDataParallel``'s
  end-of-backward callback).
- ``foreach_copy`` / ``foreach_div``: torch's fused list operations (``_foreach_copy_``,
  ``_foreach_div_``), one call for a whole list of tensors instead of one per tensor (a
  checkpoint snapshot copies a hundred-odd tensors every step, ``zero:3`` averages each of
  its gradient shards). A loop of the public ``copy_`` / ``div_`` where torch lacks them, and
  nothing to do for an empty list, which the fused calls refuse.
- ``pin_host_memory``: page-locks a CPU buffer in place through ``torch.cuda.cudart()``'s
  ``cudaHostRegister`` (torch has no public call that pins memory it did not allocate, such
  as the checkpoint writer's shared buffers), so a GPU model's snapshot copies into it
  asynchronously.
- ``compiler_errors``: the exceptions ``torch.compile`` raises when it cannot compile
  (``torch._dynamo.exc.TorchDynamoException``, which its backend's failures, Inductor's and a
  missing Triton's among them, subclass), so that a codec's fused kernel falls back to the
  codec's own ops on those and on nothing else (an out-of-memory error is the caller's). Every
  exception where this torch names them otherwise.
- ``forkserver_started``: not torch's but Python's: whether multiprocessing's forkserver of this
  process runs already (``multiprocessing.forkserver._forkserver._forkserver_pid``), so that
  ``gradsync.processes.forkserver`` forks workers only from a server whose environment it knows.
  True
  where Python hides it: workers are spawned then.
- ``run_exit_handlers``: not torch's but Python's: runs this process's ``atexit`` handlers now
  (``atexit._run_exitfuncs``: last registered first, each once, the registry emptied after),
  for a ``gradsync run`` rank forked by multiprocessing, which ends with ``os._exit`` and so
  never reaches the interpreter's exit that runs them (``gradsync.runner.worker``). False where
  Python hides it: the handlers then do not run, as before.
- ``elastic_worker_failure``: not an API but the wording of the record torch's elastic agent
  logs when a worker process fails (``failed (exitcode: %s) local_rank: %s (pid: %s) ...``), so
  that ``gradsync run`` can say which worker died before the agent restarts the group. None
  for a record worded otherwise: the death then goes unreported, as before (tested in
  ``tests/unit/test_worker_deaths.py``).
- ``elastic_signal``: the signal behind torch's elastic agent's ``SignalException`` (its
  ``sigval``), which it raises in the launcher for a Ctrl-C instead of ``KeyboardInterrupt``, so
  that ``gradsync run`` ends with one line and 128 + the signal; None where torch lacks it.
- ``queue_end_of_backward`` / ``end_of_backward_callbacks``: the autograd engine's
  ``queue_callback`` (``torch.autograd.Variable._execution_engine``), which runs a function once
  the backward pass running now has finished, as DDP finishes its reduction there; the front
  door (``gradsync.ddp``) completes the exchange with it, so ``loss.backward()`` returns with
  ``p.grad`` final. False where torch hides it: the front door is then refused at construction,
  naming the explicit ``sync.step()`` form.
- ``takes_found_inf`` / ``step_with_found_inf``: whether an optimizer's ``step()`` honours
  the ``found_inf`` tensor GradScaler hands it (``_step_supports_amp_scaling``, set by torch's
  fused Adam, AdamW, SGD and Adagrad), and a step with one set as GradScaler sets it (the
  ``found_inf`` attribute, read by ``step()`` and deleted after): the update is then skipped on
  the device where the tensor holds 1.0, with no read on the host. False where torch drops the
  flag: the non-finite verdict is then read on the host, as for any other optimizer.
- ``annotate``: ``torch.profiler.record_function`` only while a profiler records
  (``torch.autograd._profiler_enabled``): entering one costs about 16 us even when nothing
  records (measured here, 20,000 calls, 2 cores), and the step enters five or six, about 4% of
  a 2 ms step that DDP, which annotates in C++, does not pay. Always annotated where torch
  hides the check.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_c10d: Any = getattr(dist, "distributed_c10d", None)


def default_group() -> dist.ProcessGroup | None:
    """The default (world) process group, or None where it is not initialized or hidden."""
    try:
        return _c10d._get_default_group()
    except (RuntimeError, ValueError, AttributeError):
        return None


def default_store() -> Any | None:
    """The default group's store, or None where it is not initialized or hidden."""
    try:
        return _c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def backends(group: dist.ProcessGroup | None) -> list[Any]:
    """The backend objects (gloo, NCCL) behind ``group`` (None: the default group); empty where
    torch hides them."""
    pg: Any = group if group is not None else default_group()
    if pg is None:
        return []
    try:
        found: list[Any] = []
        for device in pg._device_types:
            backend = pg._get_backend(torch.device(device))
            if all(backend is not b for b in found):
                found.append(backend)
        return found
    except (RuntimeError, ValueError, AttributeError):
        return []


def collective_timeout(group: dist.ProcessGroup | None) -> float | None:
    """``group``'s collective timeout in seconds (the longest of its backends'), or None where
    torch does not tell."""
    seconds = []
    for backend in backends(group):
        try:
            seconds.append(backend.options._timeout.total_seconds())
        except AttributeError:
            continue
    return max(seconds) if seconds else None


def set_collective_timeout(group: dist.ProcessGroup | None, seconds: float) -> bool:
    """Make ``seconds`` the collective timeout of every backend of ``group``; False where torch
    does not allow it (the group keeps its own timeout then)."""
    return set_backends_timeout(backends(group), datetime.timedelta(seconds=seconds))


def set_backends_timeout(found: list[Any], timeout: datetime.timedelta) -> bool:
    """``set_collective_timeout`` on backends found once with ``backends(group)``: a group's
    backends are made with it, and the Synchronizer sets the timeout twice a step (issue 44:
    looking them up again was most of that)."""
    if not found:
        return False
    try:
        for backend in found:
            backend._set_default_timeout(timeout)
    except (RuntimeError, AttributeError):
        return False
    return True


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Record that ``optimizer``'s update ran, as torch's ``step()`` wrapper does; harmless
    where torch no longer reads the flag (schedulers then just may warn)."""
    stepped: Any = optimizer
    stepped._opt_called = True


def _scaler_states(scaler: Any) -> dict[int, Any] | None:
    states = getattr(scaler, "_per_optimizer_states", None)
    return states if isinstance(states, dict) else None


def scaler_unscaled(scaler: Any, optimizer: torch.optim.Optimizer) -> bool | None:
    """Whether ``scaler.unscale_(optimizer)`` already ran since the scaler's last ``update()``
    (calling it twice raises); None where torch does not tell."""
    states = _scaler_states(scaler)
    try:
        from torch.amp.grad_scaler import OptState
    except ImportError:
        return None
    if states is None:
        return None
    state = states.get(id(optimizer))  # .get: indexing the defaultdict would add an entry
    if state is None:
        return False
    stage = state.get("stage") if isinstance(state, dict) else None
    return None if stage is None else stage is OptState.UNSCALED


def scaler_found_inf(scaler: Any, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The inf/NaN counts (one tensor per device) that ``unscale_`` recorded for ``optimizer``
    and that ``step()`` and ``update()`` read; changing them in place changes the decision.
    Empty where torch hides them or nothing was recorded."""
    state = (_scaler_states(scaler) or {}).get(id(optimizer))
    found = state.get("found_inf_per_device") if isinstance(state, dict) else None
    if not isinstance(found, dict):
        return []
    return [t for t in found.values() if isinstance(t, torch.Tensor)]


def forkserver_started() -> bool:
    """Whether multiprocessing's forkserver of this process is already running (True where
    this Python does not say: then the caller cannot know its environment either)."""
    import multiprocessing.forkserver

    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_pid", True) is not None


def run_exit_handlers() -> bool:
    """Run this process's ``atexit`` handlers now, as the interpreter's exit would (last
    registered first; one that raises is reported and the others still run); each runs once,
    the registry is empty after. False where this Python hides the call: nothing runs."""
    import atexit

    run = getattr(atexit, "_run_exitfuncs", None)
    if not callable(run):
        return False
    run()
    return True


def override_shared_store_server(handler: Any, make: Callable[[str, int], Any]) -> bool:
    """Make ``handler`` (torch's ``DynamicRendezvousHandler``) create the store it shares with
    its workers as ``make(addr, port)``; False where the handler has no such step (the caller
    then shares no store)."""
    if not callable(getattr(handler, "_create_tcp_store_server", None)):
        return False
    handler._create_tcp_store_server = make
    return True


__all__ = [
    "backends",
    "collective_timeout",
    "default_group",
    "default_store",
    "foreach_copy",
    "foreach_div",
    "pin_host_memory",
    "untracked_alias",
    "write_count",
    "fsdp2",
    "fsdp_comms",
    "fsdp_forget_forwards",
    "is_dtensor",
    "is_fsdp_module",
    "mark_optimizer_stepped",
    "override_shared_store_server",
    "set_collective_timeout",
]


@functools.lru_cache(maxsize=1)
def fsdp2() -> tuple[Any, Any, Any] | None:
    """``(fully_shard, DTensor, DeviceMesh)`` from wherever this torch keeps them, or None."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return None
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return fully_shard, DTensor, DeviceMesh


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (a parameter FSDP2 sharded); False where torch has none."""
    found = fsdp2()
    return found is not None and isinstance(t, found[1])


@functools.lru_cache(maxsize=1)
def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def is_fsdp_module(module: object) -> bool:
    """Whether ``fully_shard`` wrapped ``module``; False where torch has no FSDP2."""
    cls = _fsdp_module_class()
    return cls is not None and isinstance(module, cls)


def fsdp_comms(module: Any) -> list[tuple[Any, Any]] | None:
    """``(all_gather, reduce_scatter)``: the collectives each of FSDP2 module ``module``'s
    parameter groups calls (an empty list for a module that holds no parameter of its own);
    None where this torch cannot replace them (no ``set_custom_all_gather``) or hides them."""
    setters = ("set_custom_all_gather", "set_custom_reduce_scatter")
    if not all(callable(getattr(module, name, None)) for name in setters):
        return None
    try:
        return [(g._all_gather_comm, g._reduce_scatter_comm) for g in _fsdp_param_groups(module)]
    except (AttributeError, TypeError):
        return None


def _fsdp_param_groups(module: Any) -> list[Any]:
    """FSDP2 module ``module``'s parameter groups: a list since FSDP2 allowed a mesh per
    parameter, one group (or None) before. AttributeError where this torch names them
    otherwise."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = state._fsdp_param_group
        groups = [] if one is None else [one]
    return list(groups)


def fsdp_forget_forwards(modules: list[Any]) -> None:
    """Empty FSDP2's record of the forwards since the last backward, on FSDP2 modules
    ``modules`` (the root's and each unit's parameter groups): the next backward then prefetches
    only what the next forward ran, the same on every rank whatever forwards one rank ran alone."""
    for module in modules:
        try:
            for group in _fsdp_param_groups(module):
                group.comm_ctx.post_forward_order.clear()
                group._post_forward_indices.clear()
        except AttributeError:
            return


def foreach_copy(
    dst: list[torch.Tensor], src: list[torch.Tensor], *, non_blocking: bool = False
) -> None:
    """``dst[i].copy_(src[i], non_blocking=...)`` for every i, in one call where torch has the
    fused ``_foreach_copy_`` (a checkpoint snapshot copies a hundred-odd tensors every step)."""
    fused = getattr(torch, "_foreach_copy_", None)
    if fused is not None:
        if dst or src:  # the fused call refuses empty lists (a state without tensors)
            fused(dst, src, non_blocking=non_blocking)
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=non_blocking)


def pin_host_memory(t: torch.Tensor) -> bool:
    """Page-lock the host memory of CPU tensor ``t`` in place (``cudaHostRegister``, as torch's
    own checkpoint staging does for shared buffers), so that device-to-host copies into it run
    as DMA without a staging copy and can be asynchronous. Unpinned again when ``t`` is
    collected. False where there is no CUDA or it refuses: copies into ``t`` then still work,
    staged by the driver."""
    if t.device.type != "cpu" or not t.numel() or not torch.cuda.is_available():
        return False
    if t.is_pinned():
        return True
    cudart = torch.cuda.cudart()
    address = t.data_ptr()
    if int(cudart.cudaHostRegister(address, t.numel() * t.element_size(), 0)) != 0:
        return False
    # The callback holds the address, not ``t``: it runs as ``t`` goes, before its memory does.
    weakref.finalize(t, cudart.cudaHostUnregister, address)
    return True


def write_count(t: torch.Tensor) -> int:
    """How many in-place writes ``t``'s storage has had through torch's ops (its version
    counter, shared by its views; a collective's own writes do not count): a changed count
    between two reads means the tensor was written in between."""
    return int(t._version)


def untracked_alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory under another tensor (same storage, shape and strides) whose in-place
    writes, and its views', do not count in ``write_count(t)`` (nor ``t``'s in its own): it has
    a version counter of its own (``t.data``). gradsync's exchange writes into a bucket through
    one, so the bucket's own count moves only with the script's writes (issue 42, trap 2)."""
    return t.data


def foreach_div(tensors: list[torch.Tensor], divisor: float) -> None:
    """``t.div_(divisor)`` for every tensor ``t`` of ``tensors``, in one call where torch has
    the fused ``_foreach_div_`` (``zero:3`` averages all of a rank's gradient shards)."""
    fused = getattr(torch, "_foreach_div_", None)
    if fused is not None:
        if tensors:  # the fused call refuses an empty list (a rank without gradients)
            fused(tensors, divisor)
        return
    for t in tensors:
        t.div_(divisor)


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` skips its update on the device when its ``found_inf``
    attribute holds 1.0 (GradScaler's contract with fused optimizers)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_with_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()`` with ``found_inf`` (a 0-d float32 tensor: 1.0 skips the update,
    state and step count included) set as GradScaler sets it, then taken away again."""
    stepped: Any = optimizer
    stepped.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del stepped.found_inf


#: the logger through which torch's elastic agent reports a failed worker process
ELASTIC_WORKER_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_ELASTIC_FAILED_PREFIX = "failed (exitcode: %s) local_rank: %s (pid: %s)"


def elastic_worker_failure(record: logging.LogRecord) -> tuple[int, int, int] | None:
    """(exit code, local rank, pid) from the record torch's elastic agent logs when one of its
    worker processes fails (a negative exit code: killed by that signal); None for any other
    record, or where torch words it otherwise."""
    if not isinstance(record.msg, str) or not record.msg.startswith(_ELASTIC_FAILED_PREFIX):
        return None
    args = record.args
    if not isinstance(args, tuple) or len(args) < 3:
        return None
    values: list[Any] = list(args[:3])
    try:
        exitcode, local_rank, pid = (int(v) for v in values)
    except (TypeError, ValueError):
        return None
    return exitcode, local_rank, pid


def elastic_signal(exc: BaseException) -> int | None:
    """The signal number when ``exc`` is the ``SignalException`` torch's elastic agent raises in
    the launching process on SIGINT, SIGTERM, SIGHUP or SIGQUIT (once it has stopped the
    workers); None for any other exception, or where torch has no such class."""
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
    except ImportError:
        return None
    if not isinstance(exc, SignalException):
        return None
    try:
        return int(exc.sigval)
    except (AttributeError, TypeError, ValueError):
        return None


def _engine_queue() -> Callable[[Callable[[], None]], None] | None:
    variable = getattr(torch.autograd, "Variable", None)
    engine = getattr(variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    return queue if callable(queue) else None


def end_of_backward_callbacks() -> bool:
    """Whether this torch lets ``queue_end_of_backward`` run a function at a backward pass's
    end."""
    return _engine_queue() is not None


def in_backward_pass() -> bool:
    """Whether this thread is running a backward pass (an autograd hook or end-of-backward
    callback: ``torch._C._current_graph_task_id``). The engine restores the thread's torch
    function modes when the pass returns, so a mode entered here would be gone by then. False
    where torch hides it."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return callable(current) and int(current()) != -1


def queue_end_of_backward(callback: Callable[[], None]) -> bool:
    """From inside a backward pass (an autograd hook): run ``callback`` once that pass has
    finished, every gradient accumulated; an exception it raises comes out of
    ``loss.backward()``. False where torch hides the engine's queue, or no backward pass is
    running (the engine refuses then)."""
    queue = _engine_queue()
    if queue is None:
        return False
    try:
        queue(callback)
    except RuntimeError:
        return False
    return True


def annotate(name: str) -> contextlib.AbstractContextManager[Any]:
    """``record_function(name)`` while a profiler records, else a context that does nothing;
    always the former where this torch cannot say whether one records."""
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    if callable(enabled) and not enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)


def compiler_errors() -> tuple[type[BaseException], ...]:
    """What ``torch.compile`` raises when it cannot compile a function (module docstring)."""
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:
        return (Exception,)
    return (TorchDynamoException,)
