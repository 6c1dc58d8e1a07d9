"""The step gate in two levels: ranks counted in groups, each at a store of its own, so that no
one store serves every rank's requests at every step.

Why: the flat gate (``gradsync.checks.gate``) has every rank make two requests a step to the
one store on rank 0 (a ``set`` of its key, then a ``wait`` for every rank's). A store serves
them one at a time (TCPStore: about 64,000 a second on this machine, ``benchmarks.gate``), so
the gate opens about ``2 N / rate`` after the ranks arrive: nothing on a few ranks, half a
second on 16,384, longer than the step it guards (issue 44; ``gradsync.sim.gate`` prices both
forms). In groups of ``g`` ranks, each rank makes its two requests to its group's store, and
only the group's first rank goes on to the world's store (two requests more), so the busiest
store serves about ``2 g`` or ``2 N / g`` requests a step instead of ``2 N``: with ``g`` about
the square root of ``N``, 256 instead of 32,768 on 16,384 ranks.

The protocol, at gate ``name``:

1. every rank sets ``name/at/RANK`` in its group's store;
2. the group's first rank waits until all of its group's are set, then sets
   ``name/at/GROUP`` in the world's store and waits until every group's is set; then it sets
   ``name/go`` in its group's store;
3. the other ranks of the group wait for their group's ``name/go``.

A group of one (the last, where the group size does not divide the world) arrives at the
world's store directly. Each wait is the flat gate's wait (bounded, judging every peer by its
heartbeat, abandoned at any moment), only against another store. Ranks at different gates set
and wait for different names in both stores, as before. A group's store is a TCPStore served
by the group's first rank, made at the Synchronizer's first gate (which is passed flat),
listening only on the address through which that rank reaches the world's store, and reached
there by its group. Where the world's store is no TCPStore (a FileStore) there is no address to
give, and the gate stays flat.

Why not a tree of any depth, or the collective itself: two levels bring the busiest store from
``2 N`` to about ``2 sqrt(N)`` requests a step, enough for the issue's goal at 16,384 ranks; a
collective (a barrier on a group of its own) cannot be given up once posted under gloo, which
is why the gate waits in a store at all.

How many ranks a group holds is ``gradsync.gate_layout``'s rule (kept apart, free of
torch, for the simulator).
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from gradsync.checks import secret
from gradsync.errors import SyncTimeoutError
from gradsync.gate_layout import group_of, group_size, groups_of


@dataclass
class GateGroup:
    """This rank's group at the gate: its ranks, its store, and how many groups count at the
    world's store."""

    ranks: range
    index: int
    groups: int
    #: the group's store as the gate uses it (its keys named through the run's secret, as the
    #: world's are); None for a group of one, which goes straight to the world's store
    store: Any | None
    #: the TCPStore serving the group (its first rank only): kept open while the gate is
    server: Any | None = None

    def keyed_as(self, world: Any) -> Any | None:
        """The group's store with its keys named as ``world``'s are (``watch.store``, which the
        first gate may re-key through an agreed secret)."""
        if self.store is None:
            return None
        raw = self.store.store if isinstance(self.store, secret.KeyedStore) else self.store
        return world.over(raw) if isinstance(world, secret.KeyedStore) else raw

    def close(self) -> None:
        """Let go of the group's store (the first rank's server stops with its last reference)."""
        self.store = self.server = None


def _address_key(prefix: str, index: int) -> str:
    return f"{prefix}/gate-group/{index}"


def _address_toward(host: str, port: int) -> str:
    """This machine's address on the route to ``host:port`` (the world's store): the one its
    peers reach it at, as they reach the world's store and each other (gloo connects every pair
    of ranks already). A datagram socket's ``connect`` picks the route and sends nothing."""
    family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(where)
        return str(probe.getsockname()[0])


def plan(watch: Any, requested: int | None, can_serve: bool) -> tuple[range, int, int] | None:
    """``(ranks of this rank's group, its index, number of groups)``, or None for a flat gate
    (a world below the grouping size, a world's store that is no TCPStore, or no way to serve
    a group's store: ``can_serve``)."""
    size = group_size(watch.world_size, requested)
    if size >= watch.world_size or watch.tcp_store is None or not can_serve:
        return None
    ranks = group_of(watch.rank, size, watch.world_size)
    return ranks, watch.rank // size, groups_of(watch.world_size, size)


def serve(
    watch: Any, layout: tuple[range, int, int], make_server: Callable[[str], Any]
) -> Any | None:
    """On a group's first rank, before the first gate: start the group's store (``make_server``
    given the address to listen on: ``gradsync.processes.stores.server_store``, which listens
    there only, never on every interface) and leave its address in the world's store; the
    server (None elsewhere, and for a group of one)."""
    ranks, index, _ = layout
    if watch.rank != ranks[0] or len(ranks) == 1:
        return None
    world = watch.tcp_store
    address = _address_toward(str(world.host), int(world.port))
    server = make_server(address)
    watch.store.set(_address_key(watch.prefix, index), f"{address}|{int(server.port)}")
    return server


def reach(watch: Any, layout: tuple[range, int, int], server: Any | None) -> GateGroup:
    """Once every rank has passed the first gate (so every first rank has left its address):
    this rank's group, connected to its store. ``SyncTimeoutError`` naming the address when it
    cannot be reached."""
    ranks, index, groups = layout
    if len(ranks) == 1:
        return GateGroup(ranks, index, groups, None)
    if server is not None:
        return GateGroup(ranks, index, groups, server, server)
    address = watch.store.get(_address_key(watch.prefix, index)).decode()
    host, port = address.rsplit("|", 1)
    try:
        client = dist.TCPStore(host, int(port), is_master=False, timeout=_timeout(watch))
    except RuntimeError as exc:
        raise SyncTimeoutError(
            f"rank {watch.rank} could not reach its gate group's store at {host}:{port}, "
            f"served by rank {ranks[0]} ({exc}). Every rank must reach every other's ports, "
            "as gloo's connections need; or make the gate flat: "
            f"Limits(gate_group_size={watch.world_size})."
        ) from exc
    return GateGroup(ranks, index, groups, client)


def _timeout(watch: Any) -> datetime.timedelta:
    # A store call's own bound: the gate's waits pass shorter ones, the rest are single round
    # trips that only a dead server keeps waiting.
    return datetime.timedelta(seconds=max(1.0, watch.timeout_s))
