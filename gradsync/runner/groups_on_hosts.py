"""``gradsync run --replica-groups G --hosts G``: the replica groups on an emulated cluster
(``gradsync.cluster``), one group per host.

What changes against a local run of groups (``runner.replica_groups``): the cluster is brought
up for the run and removed after it; the lighthouse runs inside host 0's namespace, bound to
host 0's address (every host reaches it through the emulated switch, nothing outside the
cluster does); each group's process is started inside its host's namespace with
``GLOO_SOCKET_IFNAME`` its host's rate-limited interface and ``GRADSYNC_MEMBERSHIP_HOST`` its
host's address, where its torchft store and Manager server listen
(``membership.ft_manager``). Everything else, the group's own elastic agent and restarts
included, is a local group's: its agent's rendezvous and its ranks' own store stay on the
namespace's loopback.
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
from collections.abc import Iterator

from gradsync.cluster.netns import Cluster, Host
from gradsync.cluster.system import tool
from gradsync.errors import UsageError
from gradsync.membership.lighthouse import HOST_ENV
from gradsync.runner.config import RunConfig

#: how long the lighthouse in host 0 has to say its address (it imports torch and torchft)
LIGHTHOUSE_START_S = 60.0


@contextlib.contextmanager
def emulated_hosts(cfg: RunConfig) -> Iterator[tuple[str, list[Host]]]:
    """The run's cluster and a lighthouse in its host 0 for as long as the block runs:
    yields the lighthouse's address and the hosts, group K's being the K-th. The cluster is
    removed at the end whatever happened (its namespaces' processes killed with it)."""
    from gradsync.cluster import requirements_missing

    missing = requirements_missing()
    if missing:
        raise UsageError(f"--hosts needs the emulated cluster: {missing}")
    # up()/down() rather than ``with``: the cluster's own SIGTERM handler would take the place
    # of the run's, which stops the groups in order before the cluster goes.
    cluster = Cluster(hosts=cfg.hosts, link=cfg.link).up()
    try:
        print(
            f"gradsync run: emulated cluster {cluster.base} of {cfg.hosts} hosts, {cfg.link} "
            f"links, one replica group per host (group K on {cluster.base}-hK)",
            file=sys.stderr,
        )
        with _lighthouse_in(cluster.host(0), cfg) as address:
            yield address, cluster.host_list
    finally:
        cluster.down()


@contextlib.contextmanager
def _lighthouse_in(host: Host, cfg: RunConfig) -> Iterator[str]:
    """A lighthouse process inside ``host``'s namespace, bound to its address: yields the
    address it printed; closing its stdin stops it (so does this process's death)."""
    command = [
        _ip(), "netns", "exec", host.netns, sys.executable, "-m", "gradsync.membership.lighthouse",
        "--bind", host.addr, "--min-replicas", str(cfg.min_replicas),
        "--heartbeat-timeout", str(cfg.heartbeat_timeout),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], LIGHTHOUSE_START_S)
        address = proc.stdout.readline().strip() if ready else ""
        if not address.startswith("http://"):
            raise RuntimeError(
                f"the lighthouse in {host.netns} did not start within {LIGHTHOUSE_START_S:.0f} "
                f"s (exit code {proc.poll()}): see its messages above"
            )
        yield address
    finally:
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def group_on_host(command: list[str], env: dict[str, str], host: Host, link: str) -> list[str]:
    """``command``, a group's, run inside ``host``'s namespace (``ip netns exec`` execs it:
    the group keeps its pid, its session and its parent); ``env`` updated in place with where
    its sockets go."""
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns that 10.213.0.x has no DNS name
    env.update(
        GLOO_SOCKET_IFNAME=host.ifname,
        TP_SOCKET_IFNAME=host.ifname,
        GRADSYNC_CLUSTER_HOST=str(host.index),
        GRADSYNC_CLUSTER_LINK=link,
        **{HOST_ENV: host.addr},
    )
    return [_ip(), "netns", "exec", host.netns, *command]


def _ip() -> str:
    return tool("ip") or "ip"
