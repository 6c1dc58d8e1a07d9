"""A torchft lighthouse for a local run, on loopback: what ``gradsync run --replica-groups``
starts in its own process when no ``--lighthouse`` is given. Here because this package is the
one place that imports torchft."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

#: where a local run's lighthouse listens (a port the system picks)
LOOPBACK = "127.0.0.1"
#: a group that stopped heartbeating is left out of the next quorum after this long: the
#: survivors' stall after a loss. A torchft Manager heartbeats every 0.1 s, so 1.5 s is 15
#: missed beats, which a group busy on a loaded machine does not miss by accident (the tests
#: run at 1 s), and it keeps the stall under the 2 s issue 45 allows (torchft's default: 5 s)
HEARTBEAT_TIMEOUT_S = 1.5
#: what ``--heartbeat-timeout`` accepts: under 0.5 s a few late beats lose a live group
HEARTBEAT_TIMEOUT_RANGE_S = (0.5, 600.0)
#: one heartbeating but late to ask is waited for up to 10 s; waiting groups are looked at
#: every 20 ms (torchft's defaults: 60 s, 100 ms)
OPTIONS = {"join_timeout_ms": 10_000, "quorum_tick_ms": 20}


@contextlib.contextmanager
def local_lighthouse(
    min_replicas: int, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
) -> Iterator[str]:
    """A lighthouse bound to 127.0.0.1 for as long as the block runs; yields its address,
    ``http://127.0.0.1:PORT``. ``min_replicas``: the groups a quorum needs;
    ``heartbeat_timeout_s``: how long a silent group stays in the quorum."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"{LOOPBACK}:0",
        min_replicas=min_replicas,
        heartbeat_timeout_ms=round(heartbeat_timeout_s * 1000),
        **OPTIONS,
    )
    try:
        # Its address() names this machine's host name, which need not resolve to loopback,
        # where the server listens: the groups dial the loopback address itself.
        port = server.address().rpartition(":")[2]
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.shutdown()
