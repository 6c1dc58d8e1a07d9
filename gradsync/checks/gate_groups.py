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
there by its group; at that gate every rank also checks its group size against rank 0's, and
grouped gates carry the size in their names. A member waits at its group's store from a thread
of its own (``Waiter``): the store lives in a training rank's process, and a stopped process's
store answers nobody. Where the world's store is no TCPStore (a FileStore) there is no address to
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
import ipaddress
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from gradsync.checks import liveness, secret
from gradsync.errors import SyncTimeoutError, UsageError
from gradsync.gate_layout import group_of, group_size, groups_of


@dataclass(frozen=True)
class Layout:
    """How one rank's gate is grouped: its group's ranks, the group's index, how many groups
    the world makes, and the group size they were made with (the last group may be smaller)."""

    ranks: range
    index: int
    groups: int
    size: int


def keyed(store: Any | None, world: Any) -> Any | None:
    """A group's ``store`` with its keys named as the world's store ``world`` names them
    (``watch.store``, which the first gate may re-key through an agreed secret)."""
    if store is None or not isinstance(world, secret.KeyedStore):
        return store
    return world.over(store)


def _address_key(prefix: str, index: int) -> str:
    return f"{prefix}/gate-group/{index}"


def _plan_key(prefix: str) -> str:
    return f"{prefix}/gate-group/size"


def _address_toward(host: str, port: int) -> str:
    """This machine's address on the route to ``host:port`` (the world's store): the one its
    peers reach it at, as they reach the world's store and each other (gloo connects every pair
    of ranks already). A datagram socket's ``connect`` picks the route and sends nothing; each
    address ``host`` has is tried in turn (an IPv6 one may have no route)."""
    failures = []
    for family, _, _, _, where in socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(where)
                return str(probe.getsockname()[0])
        except OSError as exc:
            failures.append(f"{where[0]}: {exc}")
    raise OSError("; ".join(failures) or f"{host} has no address")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def plan(watch: Any, requested: int | None, can_serve: bool) -> Layout | None:
    """How this rank's gate is grouped, or None for a flat gate
    (a world below the grouping size, a world's store that is no TCPStore, or no way to serve
    a group's store: ``can_serve``)."""
    size = group_size(watch.world_size, requested)
    if size >= watch.world_size or watch.tcp_store is None or not can_serve:
        return None
    ranks = group_of(watch.rank, size, watch.world_size)
    return Layout(ranks, watch.rank // size, groups_of(watch.world_size, size), size)


def announce(watch: Any, layout: Layout | None) -> None:
    """On rank 0, before the first gate: leave the group size it computed, which every rank
    checks its own against once past that gate (``same_plan``)."""
    if watch.rank == 0:
        size = layout.size if layout is not None else watch.world_size
        watch.store.set(_plan_key(watch.prefix), str(size))


def same_plan(watch: Any, layout: Layout | None) -> None:
    """``UsageError`` unless this rank groups the gate as rank 0 does: ranks that disagree
    would wait for different keys (a ``gate_group_size`` given on some ranks only, or ranks of
    different gradsync versions)."""
    size = layout.size if layout is not None else watch.world_size
    theirs = int(watch.store.get(_plan_key(watch.prefix)).decode())
    if theirs != size:
        raise UsageError(
            f"rank {watch.rank} counts the step gate in groups of {size} ranks, rank 0 in groups "
            f"of {theirs} (a group as large as the world: flat): give every rank the same "
            "gate_group_size (or none) and the same gradsync version"
        )


def serve(
    watch: Any, layout: Layout, make_server: Callable[[str, datetime.timedelta], Any]
) -> Any | None:
    """On a group's first rank, before the first gate: start the group's store and leave its
    address in the world's store; the server (None elsewhere, and for a group of one).
    ``make_server`` is given the address to listen on and its calls' bound (the Synchronizer's
    listens there only, never on every interface: ``processes.stores.server_store``)."""
    ranks, index = layout.ranks, layout.index
    if watch.rank != ranks[0] or len(ranks) == 1:
        return None
    world = watch.tcp_store
    try:
        address = _address_toward(str(world.host), int(world.port))
    except OSError as exc:
        raise SyncTimeoutError(
            f"rank {watch.rank} found no address of its own toward the world's store at "
            f"{world.host}:{world.port} to serve its gate group's store at ({exc}); make the "
            f"gate flat: Limits(gate_group_size={watch.world_size})"
        ) from exc
    server = make_server(address, _timeout(watch))
    where = f"{address}|{int(server.port)}|{liveness.machine()}"
    watch.store.set(_address_key(watch.prefix, index), where)
    return server


def address_of(watch: Any, layout: Layout, server: Any | None) -> str | None:
    """Once past the first gate, before its keys are named through an agreed secret: where this
    rank's group's store is (None on its first rank and in a group of one)."""
    ranks, index = layout.ranks, layout.index
    if len(ranks) == 1 or server is not None:
        return None
    return bytes(watch.store.get(_address_key(watch.prefix, index))).decode()


def reach(watch: Any, layout: Layout, server: Any | None, address: str | None) -> Any | None:
    """This rank's group's store: its ``server`` on the group's first rank, elsewhere a client
    connected at ``address`` (``address_of``); None for a group of one. ``SyncTimeoutError``
    naming the address when it cannot be reached."""
    ranks = layout.ranks
    if len(ranks) == 1 or server is not None or address is None:
        return server
    host, port, machine = address.split("|")
    flat = f"make the gate flat: Limits(gate_group_size={watch.world_size})"
    if _is_loopback(host) and machine != liveness.machine():
        raise SyncTimeoutError(
            f"rank {ranks[0]} serves its gate group's store on its loopback address {host}, "
            f"out of reach of rank {watch.rank} on another machine: the name by which rank "
            f"{ranks[0]} reaches the world's store resolves to a loopback address there (a "
            "hosts file mapping the machine's name to 127.0.1.1?). Give the world's store an "
            f"address every machine reaches (MASTER_ADDR), or {flat}."
        )
    try:
        client = dist.TCPStore(host, int(port), is_master=False, timeout=_timeout(watch))
    except RuntimeError as exc:
        raise SyncTimeoutError(
            f"rank {watch.rank} could not reach its gate group's store at {host}:{port}, "
            f"served by rank {ranks[0]} ({exc}). Every rank must reach every other's ports, "
            f"as gloo's connections need; or {flat}."
        ) from exc
    return client


def _timeout(watch: Any) -> datetime.timedelta:
    # A store call's own bound: the gate's waits pass shorter ones, the rest are single round
    # trips that only a dead server keeps waiting.
    return datetime.timedelta(seconds=max(1.0, watch.timeout_s))


class Waiter:
    """A group member's waits at its group's store, each made on a thread of the waiter's own.

    Why: a store call whose server's process is stopped (SIGSTOP, a frozen container, a machine
    gone without closing its sockets) does not return, whatever timeout torch's client was
    given (torch 2.13: a ``wait`` of 2 s still blocked after 10 s). The group's store is served
    by a training rank, so the gate's thread must not make that call: it judges the peers
    meanwhile, the serving rank among them, as every other wait of the gate does. A call given
    up on is left to its thread (a daemon), and the waiter is not used again."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        #: a call was given up on while in flight: the thread may never come back
        self.abandoned = False

    def start(self, call: Callable[[], Any]) -> None:
        """Begin ``call`` on the waiter's thread."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="gradsync-gate-group", daemon=True
            )
            self._thread.start()
        self._jobs.put(call)

    def result(self, timeout_s: float) -> tuple[bool, BaseException | None]:
        """``(ended, what it raised)`` of the call begun, waiting up to ``timeout_s``."""
        try:
            return True, self._done.get(timeout=timeout_s)
        except queue.Empty:
            return False, None

    def _run(self) -> None:
        while True:
            call = self._jobs.get()
            if call is None:
                return
            try:
                call()
            except BaseException as exc:  # noqa: BLE001 - handed to the gate's thread
                self._done.put(exc)
            else:
                self._done.put(None)

    def stop(self) -> None:
        """End the thread once its call (if any) has returned."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None
