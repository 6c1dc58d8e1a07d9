"""``membership="torchft"`` with real parts: torchft's lighthouse (in this process, on
127.0.0.1 with a port the system picks) and replica groups as processes of their own
(``tests/support/live_replica.py``), each a torchft participant training with ``bsp``.

One run, because each replica process takes about 3 s of a core to import torch and torchft:
two replicas train in agreement (bitwise, after the first quorum synced their different
initial weights), and a NaN on one makes both skip that step; one is SIGKILLed mid-run and the
survivor steps on in the same process; a replacement process heals from it (model, momentum,
the Synchronizer's step and a registered state) and both agree bitwise again; each replica's
run directory (a script's own, ``GRADSYNC_RUN_DIR``) records the loss the survivor saw. Every
listening socket of the tree, sampled throughout, is on loopback, and nothing is left running
or listening afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.proctree import Watched, is_loopback

pytestmark = pytest.mark.ranks

torchft = pytest.importorskip(
    "torchft", reason="membership='torchft' needs torchft: pip install 'gradsync[ft]'"
)

REPO = Path(__file__).resolve().parents[2]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _start(replica: int, out: Path, lighthouse: str, *extra: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}  # a world of one each
    env.update(GLOO_SOCKET_IFNAME="lo", TORCHFT_LIGHTHOUSE=lighthouse, OMP_NUM_THREADS="1")
    # a run directory per replica group, as a script's own (a replacement takes its group's)
    env["GRADSYNC_RUN_DIR"] = str(out / f"group-{replica}")
    cmd = [sys.executable, "-m", "tests.support.live_replica", "--replica", str(replica)]
    with (out / f"stderr-{replica}-{time.monotonic_ns()}.txt").open("wb") as err:
        return subprocess.Popen(
            [*cmd, "--out", str(out), *extra], cwd=REPO, env=env, stderr=err, start_new_session=True
        )


def _log(out: Path, proc: subprocess.Popen[bytes]) -> list[dict[str, Any]]:
    path = next(out.glob(f"replica*-{proc.pid}.jsonl"), None)
    if path is None:
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait(
    what: str, ready: Callable[[], bool], watched: Watched, out: Path, limit_s: float
) -> None:
    deadline = time.monotonic() + limit_s
    while not ready():
        watched.sample(os.getpid())
        if time.monotonic() > deadline:
            errors = "".join(p.read_text()[-1500:] for p in sorted(out.glob("stderr-*")))
            raise AssertionError(f"timed out waiting for {what}; replicas' stderr:\n{errors}")
        time.sleep(0.05)


def _by_step(log: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {entry["step"]: entry for entry in log}


@pytest.mark.timeout(90)
def test_a_lost_replica_group_heals_from_the_survivor_which_never_restarts(tmp_path: Path) -> None:
    from torchft.coordination import LighthouseServer

    # A short heartbeat timeout, so that a lost participant is dropped from the quorum within
    # a second; a longer join timeout, so that a replacement's first quorum waits for the
    # survivor's next one even on a loaded machine (with 1 s, a survivor whose step took
    # longer left the replacement a quorum of its own, training from step 0).
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=5000,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=1000,
    )
    watched, procs = Watched(), []
    earlier = Watched()
    earlier.sample(os.getpid())
    before = {addr for addr, _, _ in earlier.listeners}  # not this test's
    try:
        a = _start(0, tmp_path, lighthouse.address())
        b = _start(1, tmp_path, lighthouse.address(), "--poison")
        procs += [a, b]

        def together() -> int:
            return len(set(_by_step(_log(tmp_path, a))) & set(_by_step(_log(tmp_path, b))))

        # Either may start first and train alone until the other joins (and heals from it).
        _wait("both replicas training", lambda: together() >= 3, watched, tmp_path, 40)
        (tmp_path / "poison").touch()  # b's next step is NaN, inside the quorum
        _wait("a NaN step", lambda: any(e["nan"] for e in _log(tmp_path, b)), watched, tmp_path, 20)
        _wait("more steps together", lambda: together() >= 8, watched, tmp_path, 20)
        b.send_signal(signal.SIGKILL)  # a lost machine: no goodbye, mid-step or between
        b.wait(timeout=10)
        lost_at = _log(tmp_path, a)[-1]["step"]
        _wait(
            "the survivor on alone",
            lambda: _log(tmp_path, a)[-1]["step"] >= lost_at + 5,
            watched,
            tmp_path,
            20,
        )
        c = _start(1, tmp_path, lighthouse.address())  # the lost group's replacement
        procs.append(c)
        _wait(
            "the replacement training", lambda: len(_log(tmp_path, c)) >= 5, watched, tmp_path, 40
        )
        (tmp_path / "stop").touch()
        for proc in (a, c):
            assert proc.wait(timeout=30) == 0, f"replica pid {proc.pid} failed"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        # The tree is this process's: what ran in it before the test (a multiprocessing
        # forkserver other tests share) is not the test's to kill.
        for pid in set(watched.survivors()) - earlier.pids:
            os.kill(pid, signal.SIGKILL)
        lighthouse.shutdown()

    log_a, log_b, log_c = (_log(tmp_path, p) for p in (a, b, c))
    steps_a = [e["step"] for e in log_a]
    # The survivor never restarted: one process, every step in order, through the loss (its
    # first may be past 0: whichever replica asked second healed from the first at once).
    assert steps_a == list(range(steps_a[0], steps_a[-1] + 1))
    assert steps_a[-1] > lost_at + 5
    # (a) together: bitwise the same parameters and momentum after every step both ran
    by_a, by_b, by_c = _by_step(log_a), _by_step(log_b), _by_step(log_c)
    together = sorted(set(by_a) & set(by_b))
    assert len(together) >= 6
    assert [by_a[s]["fp"] for s in together] == [by_b[s]["fp"] for s in together]
    # the non-finite guard: b's NaN made both skip that step (nothing changed on either)
    (nan_step,) = [e["step"] for e in log_b if e["nan"]]
    assert by_a[nan_step]["skipped"] and by_b[nan_step]["skipped"]
    assert by_a[nan_step]["fp"] == by_a[nan_step - 1]["fp"]
    # (b) the replacement healed from the survivor: it starts at the survivor's step (not 0),
    # with its counter (registered state), and both agree bitwise from then on
    healed = sorted(set(by_a) & set(by_c))
    assert log_c[0]["step"] > lost_at and len(healed) >= 3
    assert [by_a[s]["fp"] for s in healed] == [by_c[s]["fp"] for s in healed]
    assert [by_a[s]["counter"] for s in healed] == [by_c[s]["counter"] for s in healed]
    _assert_membership_recorded(tmp_path, b)
    # Everything that listened did so on loopback (the stores, torchft's Manager servers, gloo,
    # the lighthouse); afterwards nothing is left running, nor listening in this process.
    assert watched.listeners, f"no listener seen in {watched.samples} samples"
    outside = sorted(entry for entry in watched.listeners if not is_loopback(entry[0]))
    assert not outside, f"listening beyond loopback: {outside}"
    left = sorted(set(watched.survivors()) - earlier.pids)
    assert not left, f"a replica process is still running: {left}"
    after = Watched()
    after.sample(os.getpid())
    still = {addr for addr, _, _ in after.listeners} & {addr for addr, _, _ in watched.listeners}
    assert not still - before, f"still listening after the run: {sorted(still)}"


def _assert_membership_recorded(out: Path, lost: subprocess.Popen[bytes]) -> None:
    """The replica groups' run directories (``GRADSYNC_RUN_DIR``): the survivor saw the lost
    replica leave its quorum and went on with one participant, stalled by the lighthouse's
    heartbeat timeout first; the replacement (restart 0 too, started by hand: told apart by its
    pid) healed once."""
    from gradsync.telemetry.membership import read_group, summarize

    groups = [read_group(out / f"group-{k}", str(k)) for k in (0, 1)]
    # its own id, on its first line: a bare UUID (no REPLICA_GROUP_ID), named by its directory
    lost_id = next(e for e in groups[1].entries if e["pid"] == lost.pid)["replica_id"]
    section = summarize(groups, expected=2)
    (failure,) = [f for f in section["failures"] if f["replica_id"] == lost_id]
    assert (failure["group"], failure["seen_by"], failure["participants"]) == ("1", ["0"], 1)
    assert section["steps_with_fewer_participants"] >= 5  # the survivor's steps alone
    (at,) = [e for e in groups[0].entries if lost_id in e.get("left", ())]
    assert at["stall_s"] > 0.3, at  # heartbeat_timeout_ms=1000
    assert section["healings"]["count"] == 1, section["healings"]
