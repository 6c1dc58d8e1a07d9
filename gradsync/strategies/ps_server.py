"""The server side of ``gradsync.strategies.ps``: apply pushes, hold replies to the bound.

One receiver thread per worker blocks on that worker's next message (threads waiting in
torch.distributed release the GIL, so an idle server costs no CPU); the main thread applies
updates and answers in arrival order, so the parameters a reply carries are a consistent
snapshot. A worker that disappears, or stays silent past the timeout, ends the server with an
error naming it.
"""

from __future__ import annotations

import inspect
import math
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradsync.errors import SyncTimeoutError
from gradsync.strategies.base import SyncContext
from gradsync.strategies.ps import _DONE, AppliedUpdate, ParameterServer, ServerStats


@dataclass(slots=True)
class _Pull:
    clock: int  # the clock the worker will compute next
    since: float


def _server_optimizer(
    user: torch.optim.Optimizer, params: list[torch.Tensor]
) -> torch.optim.Optimizer:
    """The user's optimizer class and hyper-parameters, over this server's shard.

    A param group also holds keys the constructor does not take (schedulers' ``initial_lr``,
    AdamW's ``decoupled_weight_decay`` in recent torch), so only the constructor's own keyword
    arguments are passed on.
    """
    accepted = inspect.signature(type(user).__init__).parameters
    hyper = {k: v for k, v in user.param_groups[0].items() if k != "params" and k in accepted}
    return type(user)(params, **hyper)


def run_server(ps: ParameterServer, ctx: SyncContext) -> ServerStats:
    s = ps.rank - ps.num_workers
    shard = [ps._params[i] for i in ps._shards[s]]
    # The server owns its own copies: the model object on this rank is only a shape template.
    params = [p.detach().clone().requires_grad_(True) for p in shard]
    optimizer = _server_optimizer(ctx.optimizer, params)
    numel = sum(p.numel() for p in params)
    dtype = params[0].dtype if params else torch.float32
    workers = ps.num_workers
    stats = ServerStats(server_rank=ps.rank)
    inbox: queue.Queue[tuple[int, torch.Tensor | BaseException]] = queue.Queue()

    def receive(w: int) -> None:
        src = ps._global(w)
        while True:
            buf = torch.empty(1 + numel, dtype=dtype)
            try:
                work = dist.irecv(buf, src=src, group=ctx.group)
                assert work is not None
                if work.wait(timeout=ps.timeout) is False:
                    raise SyncTimeoutError(f"no message within {ps.timeout.total_seconds():.0f}s")
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                inbox.put((w, exc))
                return
            inbox.put((w, buf))
            if float(buf[0]) == _DONE:
                return

    threads = [threading.Thread(target=receive, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()

    pushed = [0] * workers
    done = [False] * workers
    pending: dict[int, _Pull] = {}
    fresh_through = [-1] * workers  # k of the parameters last sent to each worker
    sends: list[object] = []

    def snapshot() -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)

    def allowed(clock: int) -> bool:
        # Clock c may start once every worker's updates from clocks <= c - S - 1 are applied,
        # i.e. each worker has pushed at least c - S gradients. Finished workers never block.
        if math.isinf(ps.staleness):
            return True
        need = clock - int(ps.staleness)
        return all(done[w] or pushed[w] >= need for w in range(workers))

    def reply(w: int, held: float, flat: torch.Tensor) -> None:
        msg = torch.cat([flat.new_tensor([held]), flat])
        if len(sends) > 64:  # forget sends that completed; keep the rest (and their tensors)
            sends[:] = [x for x in sends if not x.is_completed()]  # type: ignore[attr-defined]
        try:
            sends.append(dist.isend(msg, dst=ps._global(w), group=ctx.group))
        except RuntimeError as exc:  # gloo raises here when the worker's connection is closed
            raise SyncTimeoutError(
                f"parameter server rank {ps.rank}: lost worker rank {w}: "
                f"{str(exc).splitlines()[0]}"
            ) from exc

    while not all(done):
        try:
            w, item = inbox.get(timeout=ps.timeout.total_seconds())
        except queue.Empty:
            silent = [w for w in range(workers) if not done[w]]
            raise SyncTimeoutError(
                f"parameter server rank {ps.rank}: workers {silent} sent nothing for "
                f"{ps.timeout.total_seconds():.0f}s"
            ) from None
        if isinstance(item, BaseException):
            raise SyncTimeoutError(
                f"parameter server rank {ps.rank}: lost worker rank {w}: "
                f"{str(item).splitlines()[0] if str(item) else type(item).__name__}"
            ) from item
        if float(item[0]) == _DONE:
            done[w] = True
        else:
            offset = 0
            grad = item[1:]
            for p in params:
                p.grad = grad[offset : offset + p.numel()].view_as(p) / workers
                offset += p.numel()
            optimizer.step()
            stats.updates.append(AppliedUpdate(w, pushed[w], fresh_through[w]))
            pushed[w] += 1
            pending[w] = _Pull(clock=pushed[w], since=time.perf_counter())
        ready = [v for v, pull in pending.items() if allowed(pull.clock)]
        if ready:
            flat = snapshot()
            k = min(pushed) - 1
            now = time.perf_counter()
            for v in sorted(ready):
                held = now - pending.pop(v).since
                stats.held_seconds += held
                fresh_through[v] = k
                reply(v, held, flat)
    final = snapshot()
    for w in range(workers):
        reply(w, 0.0, final)
    for work in sends:
        work.wait(timeout=ps.timeout)  # type: ignore[attr-defined]
    for t in threads:
        t.join(timeout=1.0)
    return stats
