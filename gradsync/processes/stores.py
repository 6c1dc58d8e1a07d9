"""TCP stores that listen on the run's own address, never on every interface.

torch.distributed has no authentication: whoever reaches a TCPStore reads and writes its keys
(the rendezvous state, every rank's address, whatever the job keeps there). torch's TCPStore
server binds the wildcard address whatever host name it is given; only a socket handed to it
(``master_listen_fd``) makes it listen where we say. So every store a gradsync run serves is made
here, on a socket bound to the run's address (127.0.0.1 for a local run, the emulated host's
address with ``--hosts``):

- the elastic agent's rendezvous store: :data:`RENDEZVOUS_BACKEND` is torch's own c10d
  rendezvous (its ``C10dRendezvousBackend`` and ``DynamicRendezvousHandler``, unchanged) under a
  name of ours, whose store we make; the launchers ask for it (:func:`register_rendezvous`);
- the store the agent shares with its workers (torch makes it inside the rendezvous handler;
  ``compat.override_shared_store_server`` has it made here; where torch offers no such hook,
  sharing is turned off so that the next case applies);
- the store rank 0 serves itself when the agent shares none (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``,
  which ``--max-restarts`` sets): :func:`process_group_store`, used by ``gs.init()``.

gloo's own listening sockets follow ``GLOO_SOCKET_IFNAME``, which the launchers set.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import socket
import warnings
from typing import Any

import torch
import torch.distributed as dist

from gradsync import compat
from gradsync.errors import UsageError
from gradsync.processes import elastic_env

#: The rendezvous backend name gradsync's launchers pass to torch's elastic agent.
RENDEZVOUS_BACKEND = "gradsync-c10d"
#: The prefix ``init_process_group`` puts on a store it made itself (env://); the store made here
#: gets the same one, so that its keys are where a torch-made store would have them.
PROCESS_GROUP_PREFIX = "default_pg"
_DEFAULT_READ_TIMEOUT_S = 60  # torch's c10d rendezvous default


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host`` (an address or a name) only; ``port`` 0: a free one."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


def _use_libuv() -> bool:
    """Whether the store may use torch's libuv server, as torch decides (``USE_LIBUV``), except
    before torch 2.8, whose libuv server ignores a socket it is handed (pytorch#150215) and would
    bind every interface anyway: the classic server takes one in every torch gradsync supports."""
    if os.environ.get("USE_LIBUV", "1") != "1":
        return False
    return bool(torch.torch_version.TorchVersion(torch.__version__) >= "2.8")


def server_store(
    host: str,
    port: int,
    *,
    timeout: datetime.timedelta | None = None,
    world_size: int | None = None,
    wait_for_workers: bool = False,
) -> dist.TCPStore:
    """A TCPStore server listening on ``host`` only (``port`` 0: a free port; ``.port`` says which).

    Multi-tenant, as torch's own servers are, so that a second store object in this process on
    the same port shares the server."""
    sock = listening_socket(host, port)
    bound_port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the socket from here on, and closes it
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    try:
        return dist.TCPStore(
            host,
            bound_port,
            world_size,
            True,
            wait_for_workers=wait_for_workers,
            multi_tenant=True,
            master_listen_fd=fd,
            use_libuv=_use_libuv(),
            **kwargs,
        )
    except TypeError:  # refused before torch took the socket: it is still ours to close
        os.close(fd)
        raise


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for an IPv6 address) as a pair; the port is required."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"rendezvous endpoint {endpoint!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _create_rendezvous_handler(params: Any) -> Any:
    """torch's c10d rendezvous handler over a store listening on the endpoint's host only.

    ``is_host`` (rendezvous config) says whether this agent serves the store; without it, an
    agent serves a loopback or port-0 endpoint (only this machine can reach one) and joins any
    other as a client, where torch would guess from the machine's host name."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class _Backend(C10dRendezvousBackend):
        # torch checks that a handler's backend carries the name it was registered under.
        @property
        def name(self) -> str:
            return RENDEZVOUS_BACKEND

    host, port = split_endpoint(params.endpoint)
    timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", _DEFAULT_READ_TIMEOUT_S))
    is_host = params.get_as_bool("is_host")
    if is_host is None:
        is_host = port == 0 or _is_loopback(host)
    store: dist.Store
    if is_host:
        store = server_store(host, port, timeout=timeout)
    else:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    handler = create_handler(store, _Backend(store, params.run_id), params)
    _HANDLERS.append(handler)
    if not compat.override_shared_store_server(handler, lambda addr, p: server_store(addr, p)):
        # No way to bind the store the agent would share: share none, so rank 0 serves one
        # (bound by gs.init()). Read by the handler at each rendezvous and by the workers.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return handler


#: the rendezvous handlers this process made, for ``close_rendezvous``
_HANDLERS: list[Any] = []


def close_rendezvous(*, stopped_by_signal: bool) -> None:
    """After a launch: forget this process's rendezvous handlers, and where the agent stopped
    on a signal (a Ctrl-C), shut them down first.

    Why: on a signal torch's launcher leaves the handler open on purpose (other agents of a
    multi-machine job may still scale), and with it the handler's keep-alive thread, which
    makes a store call every few seconds. A thread that returns from a store call while the
    interpreter finalizes aborts the process ("terminate called without an active
    exception", as ``gradsync.exit_safety`` says of gloo's threads): ``gradsync run``
    exited with SIGABRT instead of 130 once after a Ctrl-C in CI (2026-12-01; not reproduced
    in 53 tries by hand, 38 of them with the keep-alive every second). A ``gradsync run`` has one
    machine and ends there, so nothing needs the rendezvous open. ``shutdown`` is torch's
    public call; it joins the thread."""
    handlers, _HANDLERS[:] = list(_HANDLERS), []
    if not stopped_by_signal:
        return  # the launcher shut them down itself
    for handler in handlers:
        try:
            handler.shutdown()
        except Exception as exc:  # noqa: BLE001 - the exit goes on; the thread may still run
            warnings.warn(
                f"shutting down the rendezvous after a signal failed: {exc}", stacklevel=2
            )


def register_rendezvous() -> None:
    """Make :data:`RENDEZVOUS_BACKEND` known to torch's launcher in this process (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, _create_rendezvous_handler)


def _address_literal(name: str) -> str | None:
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return None


def process_group_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The store for ``init_process_group`` from torchrun's environment when rank 0 serves it
    (the agent shares none): rank 0's server listens on ``MASTER_ADDR`` only. None where
    torch's env:// does the same job: when the workers use the agent's store (they only connect)
    and it never restarts them, or ``MASTER_ADDR`` is a host name (binding the address it
    resolves to here could miss the one the other ranks reach), or not an address of this
    machine.

    Where the agent shares its store and may restart its workers, the store is that one with a
    prefix of the attempt (:func:`agent_store_of_this_attempt`).

    The decision rests on the environment alone, the same on every rank, so the ranks agree."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return agent_store_of_this_attempt(timeout)
    addr = _address_literal(os.environ["MASTER_ADDR"])
    if addr is None:
        return None
    port, rank = int(os.environ["MASTER_PORT"]), int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    store: dist.Store
    if rank == 0:
        try:
            store = server_store(
                addr, port, timeout=timeout, world_size=world, wait_for_workers=True
            )
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
            return None  # not ours (a NAT address?): torch's wildcard server, as before
    else:
        store = dist.TCPStore(addr, port, world, False, timeout)
    return dist.PrefixStore(PROCESS_GROUP_PREFIX, store)


def agent_store_of_this_attempt(timeout: datetime.timedelta) -> dist.Store | None:
    """The store torchrun's agent shares with its workers, under a prefix naming the attempt,
    where the agent may restart them; None (torch's env://, unprefixed) where it may not.

    Why: torch (2.5 and later) shares the rendezvous store with the workers and puts no attempt
    in the keys ``init_process_group`` writes there, so a restarted attempt read the previous
    attempt's gloo addresses (or NCCL id) and failed in ``gs.init()`` with "Gloo connectFullMesh
    failed ... Connection refused" (pytorch/pytorch#135712): plain torchrun with
    ``--max-restarts`` could not restart any script. torch up to 2.4 put the attempt in the
    prefix, as here.

    Only where one agent runs every worker (``GROUP_WORLD_SIZE`` 1: a single machine): its
    restart count is the same on every rank. With several agents it is not (an agent whose
    workers were restarted because another machine joined or failed does not count that
    restart), so a prefix would leave the ranks waiting for each other: there torch's own
    behaviour stays, with a warning naming the setting that avoids it."""
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    if max_restarts == 0:
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        if os.environ.get("RANK") == "0":
            warnings.warn(
                "torchrun shares its rendezvous store with the workers and allows restarts "
                f"(--max-restarts {max_restarts}): on torch >= 2.5 a restarted attempt can "
                "read the last attempt's addresses and fail to connect (pytorch/pytorch#135712);"
                " set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment on every "
                "machine (gradsync run does)",
                stacklevel=5,  # the script's gs.init()
            )
        return None
    attempt = elastic_env.restart_count()
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    client = dist.TCPStore(host, port, int(os.environ["WORLD_SIZE"]), False, timeout)
    return dist.PrefixStore(f"{PROCESS_GROUP_PREFIX}/attempt_{attempt}", client)
