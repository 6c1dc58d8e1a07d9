"""gradsync.checks.answered on a fake store that can stop answering: calls on the threads that
must not hang are given up after their bound, later ones at once while the store stays silent,
and a call queued behind a long wait is not taken for silence."""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from typing import Any

import pytest

from gradsync.checks import answered
from gradsync.checks.answered import Clock, StoreSilent, TimedStore, clock_of, free_to_block

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

ANSWER_S = 0.3  # short: the bound is what is tested, not its length


class _Store:
    """Answers while ``answering`` is set; a stopped server otherwise (every call blocks).
    One call at a time, as torch's client holds a lock across each."""

    def __init__(self) -> None:
        self.answering = threading.Event()
        self.answering.set()
        self.keys: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _served(self) -> None:
        self.answering.wait()

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._served()
            self.keys[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        with self._lock:
            self._served()
            return self.keys[key]

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            self._served()
            return all(k in self.keys for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        with self._lock:
            deadline = time.monotonic() + timeout.total_seconds()
            while not all(k in self.keys for k in keys):
                if time.monotonic() > deadline:
                    raise RuntimeError("Wait timeout")
                time.sleep(0.01)
            self._served()


def _timed() -> tuple[_Store, TimedStore]:
    store = _Store()
    return store, TimedStore(store, Clock(), answer_s=ANSWER_S)


def _on_free_thread(fn: Any) -> threading.Thread:
    def run() -> None:
        free_to_block()
        with contextlib.suppress(Exception):  # its outcome is not what is tested here
            fn()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_calls_pass_through_while_the_store_answers() -> None:
    store, timed = _timed()
    timed.set("a", "1")
    assert timed.get("a") == b"1" and timed.check(["a"]) and not timed.check(["b"])
    with pytest.raises(KeyError):
        timed.get("b")  # the store's own error, raised on the caller's thread
    assert timed.clock.silent_s() == 0.0


def test_a_call_the_store_never_answers_is_given_up_and_so_are_the_next_at_once() -> None:
    store, timed = _timed()
    timed.set("a", "1")
    store.answering.clear()  # the server stops
    t0 = time.monotonic()
    with pytest.raises(StoreSilent, match="has not answered"):
        timed.get("a")
    took = time.monotonic() - t0
    assert ANSWER_S <= took < ANSWER_S + 1.0, took
    t0 = time.monotonic()
    with pytest.raises(StoreSilent):
        timed.set("b", "2")
    assert time.monotonic() - t0 < 0.1  # the store is known to be silent: no second wait
    assert timed.clock.silent_s() >= ANSWER_S
    store.answering.set()  # it answers again: the stranded call returns, calls go through
    deadline = time.monotonic() + 5
    while timed.clock.silent_s() > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    timed.set("c", "3")
    assert timed.get("c") == b"3"


def test_a_free_thread_blocks_and_the_clock_says_for_how_long() -> None:
    """The step gate's thread calls the store directly; its joiner reads the clock."""
    store, timed = _timed()
    store.answering.clear()
    thread = _on_free_thread(lambda: timed.set("a", "1"))
    time.sleep(0.5)
    assert thread.is_alive()  # not given up: nobody bounds this thread's calls
    assert timed.clock.silent_s() >= 0.2  # the thread's start may lag the sleep's
    store.answering.set()
    thread.join(5)
    assert timed.clock.silent_s() == 0.0


def test_a_call_queued_behind_a_long_wait_is_not_silence() -> None:
    """A wait may last its own timeout; a call behind it on the same client waits that long
    too, and must not be taken for a stopped server meanwhile."""
    store, timed = _timed()
    waiting = _on_free_thread(lambda: timed.wait(["never"], datetime.timedelta(seconds=1.0)))
    time.sleep(0.05)
    t0 = time.monotonic()
    timed.set("a", "1")  # served once the wait times out, about 1 s from now: not given up
    assert time.monotonic() - t0 >= 0.7  # it did wait behind the wait
    waiting.join(5)
    assert timed.get("a") == b"1"


def test_the_courier_thread_ends_when_idle_and_another_takes_the_next_call() -> None:
    _, timed = _timed()
    timed.set("a", "1")
    couriers = [t for t in threading.enumerate() if t.name == "gradsync-store-courier"]
    assert couriers
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in couriers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(t.is_alive() for t in couriers)
    assert timed.get("a") == b"1"


class _Server:
    """What clock_of reads of a TCPStore: its server's address."""

    def __init__(self, port: int) -> None:
        self.host, self.port = "127.0.0.1", port


def test_every_watch_of_one_server_shares_its_clock() -> None:
    """Calls on one client wait behind each other whichever Synchronizer's watch made them:
    a second watch on a store the first one found silent must know it at once."""
    assert clock_of(_Server(61001)) is clock_of(_Server(61001))
    assert clock_of(_Server(61001)) is not clock_of(_Server(61002))
    store = _Store()
    first = TimedStore(store, clock_of(_Server(61003)), answer_s=ANSWER_S)
    second = TimedStore(store, clock_of(_Server(61003)), answer_s=ANSWER_S)
    store.answering.clear()
    with pytest.raises(StoreSilent):
        first.set("a", "1")
    t0 = time.monotonic()
    with pytest.raises(StoreSilent):
        second.get("a")
    assert time.monotonic() - t0 < 0.1
    store.answering.set()


def test_a_forked_child_does_not_count_its_parents_calls_in_flight() -> None:
    """What runs in a forked child (os.register_at_fork): a call left in flight in the parent,
    whose thread is not in the child, would make the child take the store for silent, and a
    courier of the parent's would never run there. (Run here in this process, not a fork: a
    unit test starts no process.)"""
    store = _Store()
    clock = clock_of(_Server(61004))
    timed = TimedStore(store, clock, answer_s=ANSWER_S)
    store.answering.clear()
    with pytest.raises(StoreSilent):
        timed.get("a")  # the courier stays in the call
    stranded = clock._courier
    assert clock.silent_s() >= ANSWER_S
    answered._forget_threads_in_child()
    assert clock.silent_s() == 0.0 and clock._courier is None
    store.answering.set()
    timed.set("b", "2")  # through a new courier
    assert clock._courier is not stranded and timed.get("b") == b"2"
