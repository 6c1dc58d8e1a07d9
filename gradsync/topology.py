"""Hierarchical all-reduce: sum within each host, across hosts among one leader per host, then
back within each host (``allreduce="hierarchical"``, ``--allreduce hierarchical``).

With several ranks per host, a flat all-reduce sends each rank's share of every step across
the slow inter-host links: a ring over N ranks on H hosts crosses hosts H times, each crossing
carrying 2 (N - 1)/N of the gradient. Here the inter-host links carry only the leaders'
all-reduce, 2 (H - 1)/H of it: with 2 hosts of 2 ranks, 1.0 gradient per host instead of 1.5.
The intra-host steps (a reduce to the leader, a broadcast back) stay on the host's fast path.

Why our own rather than torch's: torch.distributed has no hierarchical all-reduce for gloo
(NCCL picks its own topology inside one call, and gloo has no notion of hosts), so this builds
it from three collectives on two kinds of subgroups, created once. Which host a rank is on comes
from ``GRADSYNC_HOST`` when set (tests and unusual launchers), else torchrun's node rank
(``GROUP_RANK``, one per elastic agent: one per emulated host), else the host name.

Order: every rank's buckets are summed in the order they are submitted (one worker thread, a
FIFO queue), so the three collectives of bucket i come before those of bucket i + 1 on every
rank of every subgroup, as the collectives of one group must; the backward pass goes on while
the thread waits on the network. The result is the flat all-reduce's sum up to the order of
the additions (float tolerance); every rank of a host ends with its leader's bytes and the
leaders with the same all-reduced bytes, so replicas stay bitwise identical.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradsync.errors import UsageError

__all__ = ["ALLREDUCE_CHOICES", "Hierarchy", "check_allreduce", "check_hierarchical", "host_key"]

ALLREDUCE_CHOICES = ("ring", "hierarchical")


def check_allreduce(value: str) -> str:
    """``value`` if it names an all-reduce, else a ``UsageError`` naming the choices."""
    if value not in ALLREDUCE_CHOICES:
        raise UsageError(f"allreduce must be one of {', '.join(ALLREDUCE_CHOICES)}, got {value!r}")
    return value


def host_key() -> str:
    """What identifies this rank's host (see the module docstring)."""
    for name in ("GRADSYNC_HOST", "GROUP_RANK"):
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return f"hostname={socket.gethostname()}"


def check_hierarchical(allreduce: str, strategy: Any, compression: str) -> None:
    """``UsageError`` when ``strategy`` (a ``Strategy``) cannot run under ``allreduce``, saying
    what can (``compression``, a spec, composes with either)."""
    del compression
    if allreduce != "hierarchical":
        return
    if not strategy.takes_hierarchy:
        raise UsageError(
            f"allreduce='hierarchical' carries the exchanges of bsp, zero:1, local:H and "
            f"diloco:H; strategy {strategy.name} does not exchange through it. Use "
            f"allreduce='ring' with {strategy.name}"
        )


@dataclass(frozen=True, slots=True)
class _Layout:
    hosts: list[list[int]]  # each host's global ranks, in rank order; the first is its leader


def _layout(keys: Sequence[str], ranks: Sequence[int]) -> _Layout:
    by_key: dict[str, list[int]] = {}
    for key, rank in zip(keys, ranks, strict=True):
        by_key.setdefault(key, []).append(rank)
    return _Layout(sorted(by_key.values()))


class Hierarchy:
    """The subgroups of a hierarchical all-reduce over ``group`` and the thread that runs it.
    Collective to build: every rank of ``group`` constructs one, in the same order."""

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float = 300.0) -> None:
        world = dist.get_world_size(group)
        ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
        keys: list[str | None] = [None] * world
        dist.all_gather_object(keys, host_key(), group=group)
        self.layout = _layout([str(k) for k in keys], ranks)
        self.world = world
        me = dist.get_rank()
        wait = datetime.timedelta(seconds=timeout_s)  # as the Synchronizer bounds its group's
        mine: dist.ProcessGroup | None = None
        # new_group is collective over the whole world: every rank creates every subgroup.
        for members in self.layout.hosts:
            sub = dist.new_group(members, timeout=wait) if len(members) > 1 else None
            if me in members:
                mine, self.host_ranks = sub, members
        self._host_group = mine
        self.leaders = [members[0] for members in self.layout.hosts]
        self._leader_group = (
            dist.new_group(self.leaders, timeout=wait) if len(self.leaders) > 1 else None
        )
        self.leader = self.host_ranks[0]
        self.is_leader = me == self.leader
        #: sums run so far (one per bucket exchanged)
        self.sums = 0
        self._jobs: queue.Queue[tuple[torch.Tensor, torch.futures.Future[torch.Tensor], Any] | None]
        self._jobs = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, name="gradsync-hierarchical-allreduce", daemon=True
        )
        self._thread.start()

    @property
    def hosts(self) -> int:
        return len(self.layout.hosts)

    def inter_host_bytes(self, nbytes: int) -> int:
        """Bytes this rank sends across hosts to sum ``nbytes`` (ring all-reduce of leaders)."""
        h = self.hosts
        return 2 * (h - 1) * nbytes // h if self.is_leader and h > 1 else 0

    @property
    def leader_group(self) -> dist.ProcessGroup | None:
        """The leaders' group (None on other ranks, or with one host)."""
        return self._leader_group if self.is_leader else None

    def sum_async(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """The sum of ``tensor`` over every rank, in place, when the future completes."""
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._jobs.put((tensor, fut, None))
        return fut

    def mean_async(
        self, tensor: torch.Tensor, across: Callable[[], torch.futures.Future[torch.Tensor]]
    ) -> torch.futures.Future[torch.Tensor]:
        """The mean of ``tensor`` over every rank, in place, with the inter-host step done by
        ``across`` on the leaders: it must give the mean over ``leader_group`` of ``tensor``
        (a compressor's hook on the leaders' group), which here holds the host's sum. Only
        the leaders' traffic is compressed; the host sums stay exact."""
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._jobs.put((tensor, fut, across))
        return fut

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.sum_async(tensor).wait()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            tensor, fut, across = job
            try:
                self._sum(tensor) if across is None else self._mean(tensor, across)
                self.sums += 1
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                fut.set_exception(exc)  # type: ignore[arg-type]  # torch stubs say Tensor
            else:
                fut.set_result(tensor)

    def _sum(self, tensor: torch.Tensor) -> None:
        if self._host_group is not None:
            dist.reduce(tensor, dst=self.leader, group=self._host_group)
        if self.is_leader and self._leader_group is not None:
            dist.all_reduce(tensor, group=self._leader_group)
        if self._host_group is not None:
            dist.broadcast(tensor, src=self.leader, group=self._host_group)

    def _mean(
        self, tensor: torch.Tensor, across: Callable[[], torch.futures.Future[torch.Tensor]]
    ) -> None:
        if self._host_group is not None:
            dist.reduce(tensor, dst=self.leader, group=self._host_group)
        if self.is_leader:
            if self._leader_group is not None:
                mean_of_hosts = across().wait()  # the hosts' sums / H
                if mean_of_hosts is not tensor:
                    tensor.copy_(mean_of_hosts)
                tensor.mul_(self.hosts / self.world)
            else:
                tensor.div_(self.world)
        if self._host_group is not None:
            dist.broadcast(tensor, src=self.leader, group=self._host_group)

    def close(self) -> None:
        """Stop the thread (after what is queued) and release the subgroups this rank is in
        (for the others ``new_group`` gave a placeholder, not a group)."""
        self._jobs.put(None)
        self._thread.join(timeout=5.0)
        mine = [self._host_group, self._leader_group if self.is_leader else None]
        for sub in mine:
            if sub is not None:
                dist.destroy_process_group(sub)
