"""What ``gradsync.checks.answered`` costs a store call (issue 44): the timing every call on the
world's store now pays, and the hand-over to the courier thread that the training thread's own
calls take so that a stopped server cannot hold them for ever.

Two measurements, each arm timed in blocks of ``--calls`` calls, the arms in an order rotated
repeat by repeat; a figure is the median over repeats of the block's mean:

- **the timing alone**: ``check`` on a store that does nothing, made directly and through a
  ``TimedStore`` from a thread marked free to block (the gate's thread, the heartbeat): the
  difference is the timing's Python;
- **a real call**: ``check`` on a TCPStore served in this process on loopback, made directly
  from the main thread, directly from a thread of its own (nothing else running: what a
  background thread's call costs here), and through a ``TimedStore`` from the main thread,
  which hands it to the courier (the training thread's calls).
"""

from __future__ import annotations

import datetime
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.harness import Harness, interleave, machine, table
from gradsync.checks.answered import Clock, TimedStore, clock_of, free_to_block
from gradsync.processes.stores import server_store


class _NoOp:
    def check(self, keys: list[str]) -> bool:
        return True


def _per_call_us(call: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def _on_thread(fn: Callable[[], float], free: bool) -> float:
    """``fn()`` on a thread of its own (marked free to block where ``free``), its result."""
    out: list[float] = []

    def run() -> None:
        if free:
            free_to_block()
        out.append(fn())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def measure(repeats: int, calls: int) -> dict[str, float]:
    """Median microseconds per call of each arm."""
    noop = _NoOp()
    timed_noop = TimedStore(noop, Clock())
    server = server_store("127.0.0.1", 0, timeout=datetime.timedelta(seconds=30))
    client = dist.TCPStore(
        "127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=30)
    )
    client.set("k", "1")
    timed_client = TimedStore(client, clock_of(client))
    keys = ["k"]
    arms: dict[str, Callable[[], float]] = {
        "no-op store, direct": lambda: _on_thread(
            lambda: _per_call_us(lambda: noop.check(keys), calls * 100), True
        ),
        "no-op store, timed": lambda: _on_thread(
            lambda: _per_call_us(lambda: timed_noop.check(keys), calls * 100), True
        ),
        "TCPStore, direct from the main thread": lambda: _per_call_us(
            lambda: client.check(keys), calls
        ),
        "TCPStore, direct from another thread": lambda: _on_thread(
            lambda: _per_call_us(lambda: client.check(keys), calls), False
        ),
        "TCPStore, through the courier (from the main thread)": lambda: _per_call_us(
            lambda: timed_client.check(keys), calls
        ),
    }
    runs = interleave(list(arms), repeats, lambda name, _: arms[name]())
    return {name: statistics.median(run[name] for run in runs) for name in arms}


def render(result: dict[str, float], args: Any, command: str, load: tuple[float, float]) -> str:
    rows = [[name, f"{us:.2f}"] for name, us in result.items()]
    timing = result["no-op store, timed"] - result["no-op store, direct"]
    courier = (
        result["TCPStore, through the courier (from the main thread)"]
        - result["TCPStore, direct from the main thread"]
    )
    return "\n\n".join(
        [
            "## What a store call costs with `gradsync.checks.answered` (issue 44)",
            f"Command: `{command}`. {machine()}; one thread. 1-minute load average "
            f"{load[0]:.2f} at the start and {load[1]:.2f} at the end. {args.repeats} repeats "
            f"of blocks of {args.calls} calls ({args.calls * 100} for the no-op store), arms "
            "rotated; the median over repeats of each block's mean (the module's docstring "
            "says what each arm is).",
            table("arm | us per `check`", rows),
            f"The timing adds **{timing:.2f} us** to a call (the gate's thread makes two a "
            f"step under `bsp`); a call the training thread makes itself takes "
            f"**{courier:.0f} us** more through the courier than made directly.",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    h = Harness("benchmarks.store_calls", __doc__, repeats=7)
    h.parser.add_argument("--calls", type=int, default=2000, help="calls per block")
    args = h.parse(argv, repeats=2, calls=20)
    if args.calls < 1:
        h.error("--calls must be at least 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = os.getloadavg()[0]
        result = measure(args.repeats, args.calls)
        end = os.getloadavg()[0]
    finally:
        torch.set_num_threads(threads)
    h.finish(render(result, args, h.command(), (start, end)))


if __name__ == "__main__":
    main()
