"""The step gate's wait is bounded whatever the store holds, gradsync's keys are named through the
run's secret, and a peer's process is asked of the kernel before its silence is read as death
(issue 43, items 1 and 5; across processes: tests/ranks/test_gate_hardening.py).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch.distributed as dist

from gradsync.checks import liveness, secret
from gradsync.checks.diagnose import BLOCK, GATE, START, ArrivalWatch
from gradsync.checks.gate import StepGate
from gradsync.checks.voucher import Vouch
from gradsync.errors import SyncTimeoutError

pytestmark = pytest.mark.unit

TIMEOUT_S = 1.0
WHAT = "construction of the Synchronizer"
LABEL = f"{WHAT} (before step 0)"


def _gate(store: dist.Store) -> tuple[ArrivalWatch, StepGate]:
    """Rank 0 of 2, its peer (rank 1) already at the first gate by its heartbeat."""
    watch = ArrivalWatch(0, 2, TIMEOUT_S, store=store, arrive_after_s=0.1)
    watch.store.set(f"{watch.prefix}/beat/1", f"7|{GATE}|{START}|{LABEL}")
    return watch, StepGate(watch, TIMEOUT_S, between_steps_s=60.0)


def _wait_in_thread(gate: StepGate, limit_s: float) -> tuple[BaseException | None, float, bool]:
    """The gate's wait, given ``limit_s`` to end: (what it raised, how long, whether it ended)."""
    raised: list[BaseException | None] = [None]

    def wait() -> None:
        try:
            gate.wait(START, WHAT)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised[0] = exc

    started = time.monotonic()
    thread = threading.Thread(target=wait, daemon=True)  # left behind if it never ends
    thread.start()
    thread.join(limit_s)
    return raised[0], time.monotonic() - started, not thread.is_alive()


@pytest.mark.timeout(30)
def test_a_gate_that_never_opens_with_every_rank_there_fails_after_its_timeout(
    monkeypatch,
) -> None:
    """Every rank's heartbeat says it is at the gate, yet the peer's key never comes (deleted
    behind the ranks' backs): the wait ends after the timeout, not never."""
    monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    watch, gate = _gate(dist.HashStore())
    raised, waited, ended = _wait_in_thread(gate, 10 * TIMEOUT_S)
    watch.close()
    assert ended, "the gate waited on, past ten times its timeout"
    assert isinstance(raised, SyncTimeoutError), raised
    assert "Every rank is at this gate, but it never opened" in str(raised), raised
    assert TIMEOUT_S <= waited < TIMEOUT_S + 3, waited


@pytest.mark.timeout(30)
def test_with_a_secret_no_key_of_gradsync_has_a_name_another_process_can_derive(
    monkeypatch,
) -> None:
    monkeypatch.setenv(secret.SECRET_ENV, secret.draw())
    plain = dist.HashStore()
    watch = ArrivalWatch(0, 2, TIMEOUT_S, store=plain, arrive_after_s=0.1)
    assert watch.secured
    # The peer, holding the same secret, is at the gate and says so through the secret's names.
    watch.store.set(f"{watch.prefix}/beat/1", f"7|{GATE}|{START}|{LABEL}")
    # Another process sets the peer's arrival under the names it can derive: they are not these.
    for n in range(20):
        plain.set(f"{watch.prefix}/gate/{n}/{START}/{WHAT}/at/1", "1")
    gate = StepGate(watch, TIMEOUT_S, between_steps_s=60.0)
    name = f"{watch.prefix}/gate/0/{START}/{WHAT}/at/1"

    def peer_arrives() -> None:
        watch.store.set(name, "1")

    threading.Timer(0.3, peer_arrives).start()
    raised, _, ended = _wait_in_thread(gate, 10 * TIMEOUT_S)
    assert ended and raised is None, raised  # rank 1's arrival, under the secret's name, opened it
    watch.close()
    hashed = {watch.store.name(f"{watch.prefix}/beat/1"), watch.store.name(name)}
    assert all(n.startswith("gradsync/") and "arrive" not in n for n in hashed), hashed
    assert plain.check(list(hashed))
    other = secret.KeyedStore(dist.HashStore(), secret.draw())
    assert other.name("gradsync/arrive/beat/0") != watch.store.name("gradsync/arrive/beat/0")


@pytest.mark.timeout(10)
def test_this_process_runs_and_a_reused_pid_or_another_machine_does_not_count() -> None:
    me = liveness.identity()
    assert liveness.running(me) is True
    machine, pid, start = me.split("|")
    assert liveness.running(f"{machine}|{pid}|{int(start) + 1}") is False  # another process
    assert liveness.running(f"another-machine|{pid}|{start}") is None
    assert liveness.running("") is None
    assert os.getpid() == int(pid)


def test_a_peer_reads_a_voucher_as_running_while_it_advances_and_says_so() -> None:
    vouch = Vouch()
    assert vouch.running(b"1|S", now=10.0, stale_s=1.5)
    assert vouch.running(b"1|S", now=11.0, stale_s=1.5)  # not stale yet
    assert not vouch.running(b"1|S", now=11.6, stale_s=1.5)  # silent: its machine is gone
    assert vouch.running(b"2|R", now=11.7, stale_s=1.5)
    assert not vouch.running(b"3|T", now=11.8, stale_s=1.5)  # stopped: SIGSTOP, a debugger
    assert not vouch.running(b"4|t", now=11.9, stale_s=1.5)
    with pytest.raises(ValueError):
        vouch.running(b"not a vouch", now=12.0, stale_s=1.5)


def test_the_launcher_hands_the_secret_under_the_name_the_watch_reads() -> None:
    """Two packages that may not import each other each name the variable."""
    from gradsync.checks.secret import SECRET_ENV
    from gradsync.processes.launch import RUN_SECRET_ENV

    assert RUN_SECRET_ENV == SECRET_ENV


class _EagainStore:
    """A store whose waits and first checks give up with EAGAIN, as a socket read can on an
    oversubscribed machine (issue 43, item 6)."""

    def __init__(self, inner: dist.Store, failures: int) -> None:
        self._inner = inner
        self.failures = failures

    def wait(self, keys: list[str], timeout: object = None) -> None:
        raise RuntimeError("recv: Resource temporarily unavailable")

    def check(self, keys: list[str]) -> bool:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("recv: Resource temporarily unavailable")
        return bool(self._inner.check(keys))

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


@pytest.mark.timeout(30)
def test_a_store_call_giving_up_with_eagain_is_tried_again_not_a_failure(monkeypatch) -> None:
    monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    inner = dist.HashStore()
    store = _EagainStore(inner, failures=3)
    watch, gate = _gate(store)  # type: ignore[arg-type]
    name = f"{watch.prefix}/gate/0/{START}/{WHAT}"
    # The peer arrives 0.3 s later, which opens the gate.
    threading.Timer(0.3, lambda: inner.set(name + "/at/1", "1")).start()
    raised, waited, ended = _wait_in_thread(gate, 10 * TIMEOUT_S)
    watch.close()
    assert ended and raised is None, raised
    assert store.failures == 0  # the failed checks were tried again


def test_only_timeouts_and_eagain_count_as_transient() -> None:
    from gradsync.checks.gate import transient_store_error

    assert transient_store_error(RuntimeError("wait timeout after 200ms, keys: /x"))
    assert transient_store_error(RuntimeError("recv: Resource temporarily unavailable"))
    assert not transient_store_error(RuntimeError("Connection reset by peer"))
    assert not transient_store_error(RuntimeError("Broken pipe"))


@pytest.mark.timeout(30)
def test_a_rank_past_the_gate_says_it_is_back_in_its_block(monkeypatch) -> None:
    """Once every rank is at the step's gate, this rank's heartbeat says where it was before
    it (inside its step's block): a peer that times out later in the step read "waiting to
    begin the step" of a rank busy in its forward pass."""
    monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    store = dist.HashStore()
    watch = ArrivalWatch(0, 2, TIMEOUT_S, store=store, arrive_after_s=0.1)
    gate = StepGate(watch, TIMEOUT_S, between_steps_s=60.0)
    watch.enter(BLOCK, 3)
    store.set(f"{watch.prefix}/gate/0/3/the step/at/1", "1")  # rank 1 is there already
    try:
        gate.wait(3, "the step")
        assert watch.phase == (BLOCK, 3, "")
    finally:
        watch.close()


class _CountingStore:
    """A HashStore that counts the reads of each key (``get`` and ``check``)."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.reads: dict[str, int] = {}

    def _read(self, key: str) -> None:
        self.reads[key] = self.reads.get(key, 0) + 1

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        self._read(key)
        return bytes(self.store.get(key))

    def check(self, keys: list[str]) -> bool:
        for key in keys:
            self._read(key)
        return bool(self.store.check(keys))

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(key, amount))

    def wait(self, keys: list[str], timeout: object = None) -> None:
        if not self.store.check(keys):
            raise RuntimeError("Wait timeout")

    def delete_key(self, key: str) -> bool:
        return bool(self.store.delete_key(key))


@pytest.mark.timeout(30)
def test_a_long_wait_for_one_late_rank_reads_only_that_ranks_heartbeat(monkeypatch) -> None:
    """Ranks 2 and 3 are at the gate, rank 1 is in its own code (an evaluation) and beating:
    rank 0 reads ranks 2's and 3's heartbeats once, then only rank 1's at each judging round.
    Every waiting rank reading every rank's heartbeat twice a second made a long wait cost the
    world's store N squared reads a round at scale (README)."""
    monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    counting = _CountingStore()
    watch = ArrivalWatch(0, 4, TIMEOUT_S, store=counting, arrive_after_s=0.05)
    gate = StepGate(watch, TIMEOUT_S, between_steps_s=60.0)
    prefix = watch.prefix
    for rank in (2, 3):
        counting.set(f"{prefix}/beat/{rank}", f"7|{GATE}|{START}|{LABEL}")
    stop = threading.Event()

    def evaluating() -> None:  # rank 1's heartbeat advances: alive in its own code
        seq = 0
        while not stop.wait(0.05):
            seq += 1
            counting.set(f"{prefix}/beat/1", f"{seq}|between|{START}|")

    beating = threading.Thread(target=evaluating, daemon=True)
    beating.start()
    try:
        time.sleep(0.1)
        waiting = threading.Thread(target=lambda: gate.wait(START, WHAT), daemon=True)
        waiting.start()
        time.sleep(2.5)  # several judging rounds (one every half second)
        assert waiting.is_alive()  # rank 1 is waited for, as under DDP
        reads = dict(counting.reads)
        for rank in (1, 2, 3):  # the gate opens: every other rank's key
            counting.set(f"{prefix}/gate/0/{START}/{WHAT}/at/{rank}", "1")
        waiting.join(5)
        assert not waiting.is_alive()
    finally:
        stop.set()
        watch.close()
    beat = {rank: reads.get(f"{prefix}/beat/{rank}", 0) for rank in (1, 2, 3)}
    assert beat[2] <= 2 and beat[3] <= 2, beat  # seen at the gate once: a check and a get
    assert beat[1] >= 4, beat  # judged at every round
