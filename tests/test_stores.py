"""gradsync.stores and gradsync.reaper in one process: stores listen where they are told (and
torch's rendezvous handler is made to bind the store it shares), gs.init()'s choice of store,
and the reaper's rule (kill a stopped child only once it has been asked to exit)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from gradsync import compat, stores
from gradsync.errors import UsageError
from gradsync.reaper import StoppedWorkerReaper, children, stopped_with_exit_pending, workers
from tests.proctree import Watched

TIMEOUT = datetime.timedelta(seconds=30)


def _my_listeners() -> set[str]:
    watched = Watched()
    watched.sample(os.getpid())
    return {addr for addr, pid, _ in watched.listeners if pid == os.getpid()}


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_rank_0_serves_the_process_group_store_on_master_addr(
    torchrun_env: pytest.MonkeyPatch,
) -> None:
    store = stores.process_group_store(TIMEOUT)
    assert isinstance(store, dist.PrefixStore)
    assert any(a.startswith("127.0.0.1:") for a in _my_listeners())
    assert not any(a.startswith(("0.0.0.0:", ":::")) for a in _my_listeners())


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


# A worker that handles SIGTERM, as torch's do: a stopped one keeps the signal pending (one with
# the default action would be killed by the kernel at once, stopped or not).
_HANDLES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, lambda *a: None); "
    "print('ready', flush=True); time.sleep(60)"
)


def _stopped_child() -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _HANDLES_SIGTERM], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    os.kill(child.pid, signal.SIGSTOP)
    return child


def _wait_until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never met"
        time.sleep(0.02)


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_the_reaper_kills_a_stopped_child_only_once_asked_to_exit() -> None:
    asked = paused = None
    try:
        asked, paused = _stopped_child(), _stopped_child()
        me = os.getpid()
        assert {asked.pid, paused.pid} <= set(children(me))
        os.kill(asked.pid, signal.SIGTERM)  # stays pending: the process is stopped
        _wait_until(lambda: stopped_with_exit_pending(asked.pid, me))
        assert not stopped_with_exit_pending(asked.pid, me + 1)  # not its parent
        _wait_until(lambda: _state(paused.pid) == "T")
        assert not stopped_with_exit_pending(paused.pid, me)
        with StoppedWorkerReaper(interval_s=0.05, rescan_s=0.05) as reaper:
            assert asked.wait(timeout=10) == -signal.SIGKILL
            time.sleep(0.3)
        assert reaper.killed == [asked.pid]
        assert paused.poll() is None  # a pause is the user's business
    finally:
        for p in (asked, paused):
            if p is not None:
                p.kill()
                p.communicate(timeout=10)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _pause() -> None:
    signal.signal(signal.SIGTERM, lambda *a: None)  # as torch's workers: SIGTERM stays pending
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_the_reaper_kills_a_stopped_worker_forked_from_the_forkserver() -> None:
    """Workers of a launch are the forkserver's children, not the agent's (gradsync.forkserver)."""
    ctx = multiprocessing.get_context("forkserver")
    worker = ctx.Process(target=_pause, daemon=True)
    worker.start()
    try:
        _wait_until(lambda: _state(worker.pid) == "T")
        server = next(parent for pid, parent in workers(os.getpid()) if pid == worker.pid)
        assert server != os.getpid()  # a grandchild: children() alone would miss it
        os.kill(worker.pid, signal.SIGTERM)  # stays pending: the process is stopped
        with StoppedWorkerReaper(interval_s=0.05, rescan_s=0.05) as reaper:
            worker.join(timeout=10)
        assert worker.exitcode == -signal.SIGKILL
        assert reaper.killed == [worker.pid]
    finally:
        worker.kill()
        worker.join(timeout=10)
