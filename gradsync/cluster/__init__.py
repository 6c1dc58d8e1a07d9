"""An emulated multi-host cluster on one Linux machine (network namespaces, veth, tbf).

See docs/cluster.md. Needs root and iproute2; ``requirements_missing()`` says what is absent.
"""

from gradsync.cluster.launch import launch_on_cluster
from gradsync.cluster.netns import (
    Cluster,
    ClusterUnavailableError,
    Host,
    cleanup_stale,
    list_clusters,
    parse_rate,
)
from gradsync.cluster.system import requirements_missing

__all__ = [
    "Cluster",
    "ClusterUnavailableError",
    "Host",
    "cleanup_stale",
    "launch_on_cluster",
    "list_clusters",
    "parse_rate",
    "requirements_missing",
]
