"""Start a job on an emulated cluster: one torchrun agent per host, inside the host's namespace.

Each agent is torch's own launcher (``torch.distributed.run``, started through
``gradsync.cluster.agent``), so a worker that runs here runs unchanged on real machines. The
agents meet through c10d rendezvous on host 0's address, under gradsync's backend name so that
its stores listen on that address only (torch's would listen on every interface of the
namespace); ``--local-addr`` makes each agent advertise its host's address (by default it would
advertise the machine's hostname, which resolves outside the namespaces), and
``GLOO_SOCKET_IFNAME`` binds gloo to the host's rate-limited interface.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence

from gradsync import procfs
from gradsync.cluster.netns import Cluster, Host, install_exit_handlers, restore_handlers
from gradsync.cluster.system import kill_pids, list_namespaces, tool
from gradsync.errors import UsageError
from gradsync.processes.stores import RENDEZVOUS_BACKEND

TIMEOUT_EXIT = 124  # as timeout(1): the job ran past its deadline and was killed


def _free_port(host: Host) -> int:
    """A port free on host 0's address. The namespace is ours and nearly empty, so the usual
    race between choosing and binding a port is harmless here."""
    code = (
        f"import socket; s = socket.socket(); s.bind(({host.addr!r}, 0)); print(s.getsockname()[1])"
    )
    out = subprocess.run(
        [_ip(), "netns", "exec", host.netns, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return int(out.stdout.strip())


def _ip() -> str:
    return tool("ip") or "ip"


def agent_command(
    cluster: Cluster,
    host: Host,
    module_args: Sequence[str],
    nproc_per_host: int,
    endpoint: str,
    run_id: str,
    join_timeout_s: int,
    max_restarts: int = 0,
) -> list[str]:
    """The command line of host ``host``'s agent (useful to print, or to run by hand)."""
    # Without is_host, torch guesses who serves the store by matching the endpoint against the
    # machine's hostname, which fails for namespace addresses: then nobody serves it.
    is_host = "1" if host.index == 0 else "0"
    return [
        _ip(), "netns", "exec", host.netns,
        sys.executable, "-m", "gradsync.cluster.agent",
        "--nnodes", str(cluster.hosts),
        "--nproc-per-node", str(nproc_per_host),
        "--rdzv-backend", RENDEZVOUS_BACKEND,
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", run_id,
        "--rdzv-conf", f"is_host={is_host},join_timeout={join_timeout_s}",
        "--local-addr", host.addr,
        "--max-restarts", str(max_restarts),
        "--monitor-interval", "0.1",
        "--module", *module_args,
    ]  # fmt: skip


def _descendants(roots: list[int]) -> list[int]:
    """All live descendants of ``roots``. torch starts workers in their own sessions, so killing
    an agent's process group misses them; find them by parent links before anything dies."""
    children: dict[int, list[int]] = {}
    for pid, ppid in procfs.parents().items():
        children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _terminate(procs: list[subprocess.Popen[bytes]]) -> None:
    live = [p.pid for p in procs if p.poll() is None]
    kill_pids(_descendants(live) + live)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


def launch_on_cluster(
    cluster: Cluster,
    module_args: Sequence[str],
    nproc_per_host: int = 1,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
    max_restarts: int = 0,
) -> int:
    """Run ``python -m <module_args...>`` as ``nproc_per_host`` workers on every host; wait.

    ``module_args`` is the module name followed by its arguments. Workers see ``os.environ``
    updated with ``env``, plus ``GLOO_SOCKET_IFNAME``/``TP_SOCKET_IFNAME`` (the host's interface),
    ``GRADSYNC_CLUSTER_HOST`` (host index) and ``GRADSYNC_CLUSTER_LINK`` (the link rate), which
    always win. Returns 0 when every agent succeeded, else the first failing agent's exit code
    (the others are then killed at once, as they would hang in a collective), or 124 after
    ``timeout_s``. On Ctrl-C or SIGTERM everything started is killed and the exception re-raised.
    """
    if nproc_per_host < 1:
        raise UsageError(f"--nproc-per-host must be at least 1, got {nproc_per_host}")
    if not module_args:
        raise UsageError("no worker module given")
    if timeout_s <= 0:
        raise UsageError(f"timeout must be positive, got {timeout_s}")
    absent = sorted(set(cluster.namespaces()) - set(list_namespaces()))
    if absent:
        raise UsageError(f"cluster {cluster.base} is not up (missing {', '.join(absent)})")
    hosts = cluster.host_list
    endpoint = f"{hosts[0].addr}:{_free_port(hosts[0])}"
    run_id = uuid.uuid4().hex[:12]
    join_timeout = max(30, int(min(timeout_s, 600)))
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + timeout_s
    # Also when the caller holds a cluster brought up without ``with``: SIGTERM must not leave
    # agents running.
    old_handlers = install_exit_handlers()
    try:
        for h in hosts:
            child_env = {**os.environ, **(env or {})}
            # c10d warns on every connection that 10.213.0.x has no reverse DNS entry.
            child_env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            if max_restarts:
                child_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
            child_env.update(
                GLOO_SOCKET_IFNAME=h.ifname,
                TP_SOCKET_IFNAME=h.ifname,
                GRADSYNC_CLUSTER_HOST=str(h.index),
                GRADSYNC_CLUSTER_LINK=cluster.link,
            )
            cmd = agent_command(
                cluster,
                h,
                module_args,
                nproc_per_host,
                endpoint,
                run_id,
                join_timeout,
                max_restarts,
            )
            # A session of its own: a terminal's Ctrl-C reaches only us, and we decide the order
            # in which things die.
            procs.append(subprocess.Popen(cmd, env=child_env, start_new_session=True))
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _terminate(procs)
                return int(failed[0])  # type: ignore[arg-type]
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                print(f"gradsync cluster: job ran past {timeout_s:g}s; killing it", file=sys.stderr)
                _terminate(procs)
                return TIMEOUT_EXIT
            time.sleep(0.1)
    except BaseException:
        _terminate(procs)
        raise
    finally:
        restore_handlers(old_handlers)
