"""A torchft lighthouse for a local run, on loopback: what ``gradsync run --replica-groups``
starts in its own process when no ``--lighthouse`` is given. Here because this package is the
one place that imports torchft."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

#: where a local run's lighthouse listens (a port the system picks)
LOOPBACK = "127.0.0.1"
#: a group that stopped heartbeating is left out of the next quorum after 2 s (the survivors'
#: stall after a loss); one heartbeating but late to ask is waited for up to 10 s; waiting
#: groups are looked at every 20 ms (torchft's defaults: 5 s, 60 s, 100 ms)
OPTIONS = {"heartbeat_timeout_ms": 2_000, "join_timeout_ms": 10_000, "quorum_tick_ms": 20}


@contextlib.contextmanager
def local_lighthouse(min_replicas: int) -> Iterator[str]:
    """A lighthouse bound to 127.0.0.1 for as long as the block runs; yields its address,
    ``http://127.0.0.1:PORT``. ``min_replicas``: the groups a quorum needs."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"{LOOPBACK}:0", min_replicas=min_replicas, **OPTIONS)
    try:
        # Its address() names this machine's host name, which need not resolve to loopback,
        # where the server listens: the groups dial the loopback address itself.
        port = server.address().rpartition(":")[2]
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.shutdown()
