"""A parameter-server worker's ``idle`` is the time the staleness bound held its reply back
(README, "Telemetry for the dial"), not the reply's latency: 0 under ``async``; and a run
without barriers reports no barrier tax."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from gradsync.strategies.ps_server import ServerStats, _Server
from gradsync.telemetry.report import RunReport
from gradsync.telemetry.scores import synthetic_records

pytestmark = pytest.mark.unit


def _server(workers: int, staleness: float, snapshot_s: float) -> tuple[_Server, dict[int, float]]:
    """A server without a process group whose snapshot takes ``snapshot_s``; and the held
    seconds each worker's last reply carried."""
    server = object.__new__(_Server)
    server.params, server.optimizer = [torch.ones(3)], None
    server.workers, server.staleness = workers, staleness
    server.pushed, server.fresh_through = [0] * workers, [-1] * workers
    server.done, server.pending = [False] * workers, {}
    server.stats = ServerStats(server_rank=workers)
    replies: dict[int, float] = {}

    def snapshot() -> torch.Tensor:
        time.sleep(snapshot_s)  # the server's own work before a reply: not idle
        return torch.ones(3)

    server.snapshot = snapshot  # type: ignore[method-assign]
    server.reply = lambda w, held, flat: replies.__setitem__(w, held)  # type: ignore[method-assign]
    return server, replies


def _push(server: _Server, w: int) -> None:
    server.on_skipped(w)  # counts as a push, as the receive loop does, then answers
    server.answer_ready()


def test_async_replies_carry_no_idle_however_long_the_server_takes() -> None:
    server, replies = _server(2, math.inf, snapshot_s=0.02)
    _push(server, 0)
    time.sleep(0.02)
    _push(server, 1)
    assert replies == {0: 0.0, 1: 0.0}
    assert server.stats.held_seconds == 0.0


def test_ssp_idle_is_the_time_the_bound_held_the_reply_back() -> None:
    server, replies = _server(2, 0, snapshot_s=0.3)
    _push(server, 0)  # clock 1 needs worker 1's first push: held
    assert replies == {}
    time.sleep(0.1)
    _push(server, 1)  # lifts the bound: both answered
    assert 0.1 <= replies[0] < 0.3, replies  # held ~0.1 s, the 0.3 s snapshot not in it
    assert replies[1] == 0.0  # the bound allowed worker 1 at once
    assert server.stats.held_seconds == replies[0]


def _no_barrier(idle: float) -> RunReport:
    records = synthetic_records(12, 2, seed=1)
    return RunReport.from_records(
        dataclasses.replace(r, barrier=False, idle=idle, comm=r.sync - idle) for r in records
    )


def test_a_run_without_barriers_has_no_barrier_tax() -> None:
    with_barriers = RunReport.from_records(synthetic_records(12, 2, seed=1)).format()
    assert (
        "barrier tax: " in with_barriers and "of wall time spent idle at barriers" in with_barriers
    )
    text = _no_barrier(0.0).format()  # async, hogwild
    assert "barrier tax: none (no step waits at a barrier in this run)" in text
    assert "idle at barriers" not in text
    text = _no_barrier(0.001).format()  # ssp:S, held back by the staleness bound
    assert "no barrier in this run; idle: " in text
    assert "held back for the staleness bound" in text and "idle at barriers" not in text


def test_a_run_without_barriers_names_its_slowest_rank_not_a_pace_setter() -> None:
    """No rank waits for another where no step meets at a barrier: 'pace-setter' said one
    set the pace (a user tester's)."""
    with_barriers = RunReport.from_records(synthetic_records(12, 2, seed=1)).format()
    assert "pace-setter: rank " in with_barriers
    text = _no_barrier(0.0).format()
    assert "pace-setter" not in text
    assert "slowest rank: rank " in text and "(no step meets at a barrier in this run)" in text
