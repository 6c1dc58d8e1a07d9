"""gradsync.processes.stores in one process: stores listen where they are told (and torch's
rendezvous
handler is made to bind the store it shares), gs.init()'s choice of store. The reaper on real
children: tests/ranks/test_stores_ranks.py."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from gradsync import compat
from gradsync.errors import UsageError
from gradsync.processes import stores
from tests.support.proctree import Watched

pytestmark = pytest.mark.unit

TIMEOUT = datetime.timedelta(seconds=30)


def _my_listeners() -> set[str]:
    watched = Watched()
    watched.sample(os.getpid())
    return {addr for addr, pid, _ in watched.listeners if pid == os.getpid()}


@pytest.mark.timeout(60)
def test_a_server_store_listens_on_its_host_only_and_serves() -> None:
    store = stores.server_store("127.0.0.1", 0, timeout=TIMEOUT)
    assert f"127.0.0.1:{store.port}" in _my_listeners()
    assert not any(
        a.endswith(f":{store.port}") and a != f"127.0.0.1:{store.port}" for a in _my_listeners()
    )
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=TIMEOUT)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_split_endpoint() -> None:
    assert stores.split_endpoint("10.213.0.1:29400") == ("10.213.0.1", 29400)
    assert stores.split_endpoint("[::1]:0") == ("::1", 0)
    for bad in ("10.0.0.1", ":5", "host:port"):
        with pytest.raises(UsageError, match="is not HOST:PORT"):
            stores.split_endpoint(bad)


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """A one-rank torchrun environment whose rank 0 serves the store (no agent store)."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    yield monkeypatch


@pytest.mark.timeout(60)
def test_rank_0_serves_the_process_group_store_on_master_addr(
    torchrun_env: pytest.MonkeyPatch,
) -> None:
    store = stores.process_group_store(TIMEOUT)
    assert isinstance(store, dist.PrefixStore)
    assert any(a.startswith("127.0.0.1:") for a in _my_listeners())
    assert not any(a.startswith(("0.0.0.0:", ":::")) for a in _my_listeners())


@pytest.mark.parametrize(
    "env",
    [
        {"TORCHELASTIC_USE_AGENT_STORE": "True"},  # the agent serves it: workers only connect
        {"MASTER_ADDR": "localhost"},  # a name: what it resolves to here may not be what others use
        {"MASTER_ADDR": "203.0.113.7"},  # not an address of this machine (TEST-NET-3)
    ],
    ids=["agent-store", "host-name", "not-local"],
)
def test_env_init_is_left_to_torch_where_binding_is_not_ours_to_do(
    torchrun_env: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    for key, value in env.items():
        torchrun_env.setenv(key, value)
    assert stores.process_group_store(TIMEOUT) is None


@pytest.mark.timeout(60)
def test_a_restarting_agent_s_store_gets_the_attempt_in_its_keys(
    torchrun_env: pytest.MonkeyPatch,
) -> None:
    """One agent that may restart its workers: the keys of the attempt's process group are
    apart from the last attempt's (the restart itself: tests/e2e/test_torchrun_restart.py)."""
    agent = stores.server_store("127.0.0.1", 0, timeout=TIMEOUT)
    for key, value in {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_PORT": str(agent.port),
    }.items():
        torchrun_env.setenv(key, value)
    store = stores.process_group_store(TIMEOUT)
    assert isinstance(store, dist.PrefixStore)
    store.set("rank_0", "here")
    assert agent.get("default_pg/attempt_2/rank_0") == b"here"


def test_several_restarting_agents_keep_torch_s_store_and_are_warned(
    torchrun_env: pytest.MonkeyPatch,
) -> None:
    """Several agents' restart counts differ (one whose workers were restarted because another
    machine failed does not count it): no prefix can be agreed, so the advice instead."""
    for key, value in {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_MAX_RESTARTS": "1",
        "GROUP_WORLD_SIZE": "2",
    }.items():
        torchrun_env.setenv(key, value)
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        assert stores.process_group_store(TIMEOUT) is None


def test_the_shared_store_hook_and_its_fallback() -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    # This torch has the hook, so the fallback (no shared store) is not what runs here.
    assert callable(getattr(DynamicRendezvousHandler, "_create_tcp_store_server", None))

    class Old:
        pass

    assert compat.override_shared_store_server(Old(), lambda a, p: None) is False

    class New:
        def _create_tcp_store_server(self, addr: str, port: int) -> object:
            raise AssertionError("replaced")

    new = New()
    assert compat.override_shared_store_server(new, lambda a, p: (a, p)) is True
    assert new._create_tcp_store_server("h", 1) == ("h", 1)


@pytest.mark.timeout(120)
def test_the_rendezvous_backend_binds_both_agent_stores_to_its_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    stores.register_rendezvous()
    stores.register_rendezvous()  # idempotent
    params = RendezvousParameters(
        backend=stores.RENDEZVOUS_BACKEND,
        endpoint="127.0.0.1:0",
        run_id="t",
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        last_call_timeout=1,
    )
    handler = rendezvous_handler_registry.create_handler(params)
    try:
        info = handler.next_rendezvous()
        shared = info.bootstrap_store_info
        assert shared is not None and shared.master_addr == "127.0.0.1"
        listening = _my_listeners()
        assert f"127.0.0.1:{shared.master_port}" in listening  # the store shared with workers
        assert len(listening) >= 2  # and the rendezvous store
        assert all(a.startswith("127.0.0.1:") for a in listening), listening
    finally:
        handler.shutdown()
