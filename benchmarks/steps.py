"""The training step that the loopback benchmarks and the cluster worker time, in every mode they
compare, built in one place so that gradsync, DDP and compute-only do the same work around the
exchange in every benchmark."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import gradsync as gs

MODES = ("gradsync", "ddp", "ddp-powersgd", "compute-only")
# torch's PowerSGD: the rank asked for in issue 8; 10 plain all-reduce iterations first, as
# torch's documentation suggests, so the compressed phase starts from a sensible gradient.
POWERSGD_RANK = 4
POWERSGD_START = 10


class Trainer:
    """One configuration on this rank: a fresh model and optimizer (the workload's own unless
    ``optimizer`` builds one), and ``step(i)``, which trains on this rank's slice of global
    batch ``i`` and returns the loss. ``sync_options`` go to the Synchronizer in gradsync mode
    (other modes ignore them, so one call can describe every mode); ``report_loss`` hands the
    loss to its telemetry; ``time_phases`` times a compute-only step's forward and backward
    apart (the backward share is what overlap can hide behind); ``device`` holds the model and
    the batches (a CUDA device under NCCL, or under gloo, which reduces CUDA tensors too).
    """

    def __init__(
        self,
        mode: str,
        workload: Any,
        global_batch: int,
        *,
        optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
        bucket_mb: float = 25.0,
        report_loss: bool = True,
        time_phases: bool = False,
        device: str | torch.device = "cpu",
        **sync_options: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; valid: {MODES}")
        rank, world = dist.get_rank(), dist.get_world_size()
        self.workload, self.global_batch, self.report_loss = workload, global_batch, report_loss
        self.per_rank = global_batch // world
        self.lo, self.hi = rank * self.per_rank, (rank + 1) * self.per_rank
        self.device = torch.device(device)
        self.model = workload.build_model().to(self.device)
        if optimizer is None:
            self.opt = workload.make_optimizer(self.model, workload.default_lr)
        else:
            self.opt = optimizer(self.model)
        self.fwd_s: list[float] = []
        self.bwd_s: list[float] = []
        self.sync: gs.Synchronizer | None = None
        self.net = self.model
        self.step: Callable[[int], torch.Tensor] = self._plain_step
        if mode == "gradsync":
            self.sync = gs.Synchronizer(self.model, self.opt, bucket_mb=bucket_mb, **sync_options)
            self.step = self._gradsync_step
        elif mode != "compute-only":
            self.net = DistributedDataParallel(self.model, bucket_cap_mb=bucket_mb)
            if mode == "ddp-powersgd":
                state = powerSGD_hook.PowerSGDState(
                    process_group=None,
                    matrix_approximation_rank=POWERSGD_RANK,
                    start_powerSGD_iter=POWERSGD_START,
                )
                self.net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif time_phases:
            self.step = self._timed_step

    def _batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.workload.batch(i, self.global_batch, self.lo, self.hi)
        if self.device.type == "cpu":
            return x, y
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _gradsync_step(self, i: int) -> torch.Tensor:
        assert self.sync is not None
        with self.sync.step(samples=self.per_rank) as s:
            x, y = self._batch(i)
            loss = self.workload.loss(self.model, x, y)
            loss.backward()
            if self.report_loss:
                s.loss = loss
        return loss

    def _plain_step(self, i: int) -> torch.Tensor:
        """DDP (``net`` wraps the model) or compute-only: the same work, no communication."""
        self.opt.zero_grad(set_to_none=True)
        x, y = self._batch(i)
        loss = self.workload.loss(self.net, x, y)
        loss.backward()
        self.opt.step()
        return loss

    def _timed_step(self, i: int) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        x, y = self._batch(i)
        t0 = time.perf_counter()
        loss = self.workload.loss(self.model, x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.fwd_s.append(t1 - t0)
        self.bwd_s.append(t2 - t1)
        return loss


def bytes_per_step_and_close(sync: gs.Synchronizer, first_step: int) -> float:
    """Collective (every rank calls it, in the same order): the mean bytes rank 0 sent per step
    from ``first_step`` on, by ``sync``'s report; then ``sync`` is closed."""
    report = sync.report()
    sent = [r.bytes for r in report.records if r.rank == 0 and r.step >= first_step]
    sync.close()
    return statistics.fmean(sent)
