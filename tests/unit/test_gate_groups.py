"""How the step gate groups its ranks (gradsync.checks.gate_groups, issue 44): flat on a few
ranks, about the square root of the world from 64, a size of the user's own checked."""

from __future__ import annotations

import datetime
import gc
import socket
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from gradsync.checks import secret
from gradsync.checks.diagnose import ArrivalWatch
from gradsync.checks.gate import StepGate
from gradsync.errors import SyncTimeoutError, UsageError
from gradsync.gate_layout import AUTO_FROM_RANKS, group_of, group_size, groups_of
from gradsync.options import Limits
from gradsync.processes.stores import server_store

pytestmark = pytest.mark.unit


def test_a_world_below_the_grouping_size_is_one_group() -> None:
    for world in (1, 2, 8, AUTO_FROM_RANKS - 1):
        assert group_size(world) == world


@pytest.mark.parametrize(
    ("world", "size", "groups"), [(64, 8, 8), (65, 9, 8), (1024, 32, 32), (16384, 128, 128)]
)
def test_a_large_world_groups_by_its_square_root(world: int, size: int, groups: int) -> None:
    assert group_size(world) == size
    assert groups_of(world, size) == groups
    assert size * (groups - 1) < world <= size * groups  # every rank in one group


def test_a_requested_size_is_kept_and_capped_at_the_world() -> None:
    assert group_size(4, 3) == 3
    assert group_size(4, 10) == 4  # one group: flat
    assert group_size(16384, 2) == 2


def test_the_last_group_holds_the_rest() -> None:
    assert [list(group_of(r, 3, 4)) for r in range(4)] == [[0, 1, 2]] * 3 + [[3]]
    assert groups_of(4, 3) == 2
    assert list(group_of(130, 128, 200)) == list(range(128, 200))


@pytest.mark.parametrize("bad", [0, 1, -4, 2.5, "8"])
def test_an_invalid_group_size_is_refused_by_name(bad: object) -> None:
    with pytest.raises(UsageError, match=r"gate_group_size must be an integer >= 2.*got"):
        Limits(gate_group_size=bad)  # type: ignore[arg-type]
    if isinstance(bad, int):
        with pytest.raises(ValueError, match="gate_group_size"):
            group_size(16, bad)


# -- the grouped gate itself, ranks as threads of this process (a real TCPStore each) ---------

TIMEOUT_S = 2.0


def _server(host: str, timeout: datetime.timedelta) -> dist.TCPStore:
    return server_store(host, 0, timeout=timeout)


def _ranks(world: int, sizes: list[int | None]) -> tuple[Any, list[ArrivalWatch], list[StepGate]]:
    """A world's store and each rank's watch and gate, as the Synchronizer makes them."""
    store = _server("127.0.0.1", datetime.timedelta(seconds=TIMEOUT_S))
    watches, gates = [], []
    for rank in range(world):
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        watch = ArrivalWatch(rank, world, TIMEOUT_S, store=client, arrive_after_s=0.2)
        watches.append(watch)
        gates.append(StepGate(watch, TIMEOUT_S, 60.0, group_size=sizes[rank], make_server=_server))
    return store, watches, gates


def _pass(gates: list[StepGate], steps: int) -> dict[int, BaseException]:
    """Every rank passes ``steps`` gates on a thread of its own; what each raised."""
    raised: dict[int, BaseException] = {}

    def rank(r: int) -> None:
        try:
            for step in range(steps):
                gates[r].wait(step, "the step")
                gates[r].left()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(len(gates))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return raised


def _close(watches: list[ArrivalWatch], gates: list[StepGate]) -> None:
    for gate, watch in zip(gates, watches, strict=True):
        gate.cancel()
        gate.close()
        watch.stop()


@pytest.mark.timeout(60)
def test_grouped_keys_are_named_through_the_secret_deleted_and_the_store_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(secret.SECRET_ENV, secret.draw())
    store, watches, gates = _ranks(4, [2, 2, 2, 2])
    try:
        assert _pass(gates, 12) == {}
        server = gates[0]._server
        assert server is not None and gates[1]._server is None
        time.sleep(1.5)  # the watchdog deletes what was set two gates back, once a beat
        keys = server.list_keys()
        # named through the run's secret, as the world's are; only the last gates' are left
        assert keys and all(k.startswith("gradsync/") and "gate" not in k for k in keys), keys
        assert len(keys) <= 2 * 3, keys  # two gates of 2 arrivals and a go
        port = server.port
    finally:
        _close(watches, gates)
    del server
    gc.collect()
    with pytest.raises(ConnectionRefusedError):  # the group's store no longer listens
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    del store


@pytest.mark.timeout(60)
def test_a_rank_grouping_otherwise_than_rank_0_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    _, watches, gates = _ranks(4, [2, 2, 2, None])  # rank 3: flat, as below 64 ranks
    try:
        threading.Timer(5.0, lambda: [g.cancel() for g in gates]).start()
        raised = _pass(gates, 3)
    finally:
        _close(watches, gates)
    assert isinstance(raised.get(3), UsageError), raised
    assert "rank 3 counts the step gate in groups of 4 ranks, rank 0 in groups of 2" in str(
        raised[3]
    )
    # the others never passed a gate without it: they waited until cancelled
    assert all(isinstance(raised.get(r), SyncTimeoutError) for r in (0, 1, 2)), raised
