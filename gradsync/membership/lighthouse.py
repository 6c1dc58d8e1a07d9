"""A torchft lighthouse for a local run, on loopback: what ``gradsync run --replica-groups``
starts in its own process when no ``--lighthouse`` is given. Here because this package is the
one place that imports torchft.

``python -m gradsync.membership.lighthouse --bind ADDR ...`` serves one on ADDR (a port the
system picks), prints its address and serves until its stdin closes: on the emulated cluster
(``gradsync run --replica-groups G --hosts G``) the run starts it inside host 0's namespace,
bound to host 0's address, where every host reaches it and nothing else does."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence

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
#: the address a replica group's torchft parts (its store, its Manager's server) listen on,
#: where ``gradsync run --hosts`` set it: the group's emulated host's (loopback when unset)
HOST_ENV = "GRADSYNC_MEMBERSHIP_HOST"


@contextlib.contextmanager
def local_lighthouse(
    min_replicas: int, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, host: str = LOOPBACK
) -> Iterator[str]:
    """A lighthouse bound to ``host`` (127.0.0.1) for as long as the block runs; yields its
    address, ``http://HOST:PORT``. ``min_replicas``: the groups a quorum needs;
    ``heartbeat_timeout_s``: how long a silent group stays in the quorum."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"{host}:0",
        min_replicas=min_replicas,
        heartbeat_timeout_ms=round(heartbeat_timeout_s * 1000),
        **OPTIONS,
    )
    try:
        # Its address() names this machine's host name, which need not resolve to the address
        # the server listens on (loopback, an emulated host's): the groups dial that itself.
        port = server.address().rpartition(":")[2]
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Serve a lighthouse on ``--bind``; print its address; stop when stdin closes (the run
    that started it closed it, or died)."""
    parser = argparse.ArgumentParser(prog="python -m gradsync.membership.lighthouse")
    parser.add_argument("--bind", required=True, help="the address to listen on")
    parser.add_argument("--min-replicas", type=int, required=True)
    parser.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S)
    args = parser.parse_args(argv)
    with local_lighthouse(args.min_replicas, args.heartbeat_timeout, host=args.bind) as address:
        print(address, flush=True)
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
