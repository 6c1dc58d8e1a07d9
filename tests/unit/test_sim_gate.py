"""The simulator's price of the step gate (gradsync.sim.gate): flat, one store serving every
rank's two requests a step, or in groups of about sqrt(N) ranks each at a store of its own (as
gradsync.checks.gate_groups); the world's store also serving every rank's heartbeat. Waited
ahead of the first collective under bsp and zero:1/2, before the forward under zero:3."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gradsync.errors import UsageError
from gradsync.sim.config import CommModel
from gradsync.sim.gate import StoreGate
from gradsync.sim.simulate import Overlap, simulate
from tests.support.sim_cli import run_cli, run_json

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

#: TCPStore's rate on loopback with 4 clients (BENCHMARKS.md, benchmarks.gate)
TCPSTORE_RATE = 63_598.0


def _wall(strategy: str, workers: int, gate: StoreGate | None, **kw: object) -> float:
    compute = np.full((5, workers), 100.0)
    return simulate(strategy, compute, CommModel(comm_ms=10.0, gate=gate), **kw).wall_ms / 5


def _share_of_bsp_step(gate: StoreGate, ranks: int) -> float:
    """The gate's cost as a share of a 100 ms bsp step, as benchmarks.gate prices it: a third
    forward, the gradient in 4 buckets over the backward, 10 ms of exchange."""
    compute = np.full((3, ranks), 100.0)
    ov = Overlap(backward_frac=2 / 3, buckets=4)
    on = simulate("bsp", compute, CommModel(comm_ms=10.0, gate=gate), overlap=ov)
    off = simulate("bsp", compute, CommModel(comm_ms=10.0), overlap=ov)
    return (on.wall_ms - off.wall_ms) / on.steps / (off.wall_ms / off.steps)


def test_the_gate_opens_after_every_ranks_two_requests_and_a_round_trip() -> None:
    gate = StoreGate(store_rate=21_000.0, rtt_ms=0.5, group_size=1000)  # flat on 1000 ranks
    # 1000 heartbeats a second leave the store 20,000 requests a second for the gate; the
    # last set's way there and the waits' answers back: a round trip
    assert gate.open_ms(1000) == pytest.approx(2 * 1000 / 20_000 * 1000 + 0.5)
    assert gate.cost_ms(1000, hidden_ms=60.0) == pytest.approx(40.5)
    assert gate.cost_ms(10, hidden_ms=60.0) == 0.0


@pytest.mark.parametrize("ranks", [2, 8, 63])
def test_below_64_ranks_the_automatic_gate_is_the_flat_one(ranks: int) -> None:
    gate = StoreGate(store_rate=TCPSTORE_RATE, rtt_ms=0.3)
    assert gate.size(ranks) == ranks and gate.form(ranks) == "flat"
    # the flat formula, the store's rate less one heartbeat a rank a second
    assert gate.open_ms(ranks) == pytest.approx(1000 * 2 * ranks / (TCPSTORE_RATE - ranks) + 0.3)


def test_from_64_ranks_the_gate_counts_in_groups_of_about_the_square_root() -> None:
    gate = StoreGate(store_rate=TCPSTORE_RATE)
    assert (gate.size(16_384), gate.groups(16_384)) == (128, 128)
    assert gate.form(1000) == "32 groups of 32"  # ceil(sqrt(1000)), the last group of 8
    world = TCPSTORE_RATE - 16_384  # the heartbeats' share of the world's store
    grouped = 1000 * (2 * 128 / TCPSTORE_RATE + 2 * 128 / world + 128 / TCPSTORE_RATE) + 0.3
    assert gate.open_ms(16_384) == pytest.approx(grouped)
    # a size as large as the world is the flat gate, as the runtime's min(G, N)
    assert StoreGate(store_rate=TCPSTORE_RATE, group_size=20_000).form(16_384) == "flat"


def test_at_16384_ranks_grouped_is_under_1pct_of_a_100ms_step_flat_over_100pct() -> None:
    grouped = StoreGate(store_rate=TCPSTORE_RATE)
    flat = StoreGate(store_rate=TCPSTORE_RATE, group_size=16_384)
    assert _share_of_bsp_step(grouped, 16_384) < 0.01  # issue 44's goal
    assert _share_of_bsp_step(flat, 16_384) > 1.0


@pytest.mark.parametrize("size", [1, 0, -4, 2.5, True])
def test_a_bad_group_size_is_refused_naming_the_flag(size: object) -> None:
    with pytest.raises(UsageError, match=r"--gate-group-size must be .* >= 2 .*automatic"):
        StoreGate(store_rate=1000.0, group_size=size)  # type: ignore[arg-type]


def test_heartbeats_that_take_the_whole_store_never_open_the_gate() -> None:
    gate = StoreGate(store_rate=1000.0, beat_s=0.5)  # 500 ranks beat 1000 times a second
    assert math.isfinite(gate.open_ms(499))
    assert gate.open_ms(500) == math.inf and gate.cost_ms(2000, hidden_ms=50.0) == math.inf


def test_simulate_says_a_saturated_store_never_opens(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["simulate", "--workers", "16", "--compute", "100", "--steps", "3", "--comm-ms", "10"]
    flags += ["--gate-store-rate", "10"]  # 16 heartbeats a second on a store serving 10
    for strategy in (["--strategy", "bsp"], ["--strategy", "zero:1", "--overlap"]):
        text = run_cli([*flags, *strategy], capsys)
        assert "step gate              never opens: 16 ranks' heartbeats" in text, text
        out = run_cli([*flags, *strategy, "--json"], capsys)
        assert "NaN" not in out and "Infinity" not in out, out  # not JSON, json.loads takes it
        doc = json.loads(out)
        assert doc["gate"]["opens_ms"] == "inf" and doc["gate"]["cost_ms_per_step"] == "inf"
    sweep = run_json([*flags, "--sweep-workers", "4,20", "--strategies", "bsp"], capsys)
    assert sweep["workers_sweep"]["efficiency"]["bsp"][1] == 0.0  # never computes


def test_bsp_hides_the_gate_behind_compute_until_it_opens_later() -> None:
    fast = StoreGate(store_rate=1e6)
    assert _wall("bsp", 64, fast) == pytest.approx(_wall("bsp", 64, None))  # opens in 0.4 ms
    slow = StoreGate(store_rate=24_096.0, rtt_ms=0.0, group_size=4096)  # opens 409.6 ms in
    assert _wall("bsp", 4096, slow) == pytest.approx(409.6 + 10.0)


def test_zero3_pays_the_whole_gate_before_its_forward() -> None:
    gate = StoreGate(store_rate=20_100.0, rtt_ms=0.0, group_size=100)  # 100 ranks: 10 ms in
    assert _wall("zero:3", 100, gate) == pytest.approx(_wall("zero:3", 100, None) + 10.0)
    assert _wall("zero:1", 100, gate) == pytest.approx(_wall("zero:1", 100, None))


def test_overlapped_buckets_start_no_earlier_than_the_gate() -> None:
    gate = StoreGate(store_rate=21_000.0, rtt_ms=0.0, group_size=1000)  # opens 100 ms in
    ov = Overlap(backward_frac=2 / 3, buckets=4)
    # the last bucket is ready at 100 ms as the gate opens: all four all-reduces follow it
    assert _wall("bsp", 1000, gate, overlap=ov) == pytest.approx(100.0 + 10.0)


@pytest.mark.parametrize("rate", [0.0, -5.0, float("inf"), float("nan")])
def test_a_bad_store_rate_is_refused(rate: float) -> None:
    with pytest.raises(UsageError, match="--gate-store-rate"):
        StoreGate(store_rate=rate)


def test_simulate_prints_the_gates_share_of_the_step(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--strategy", "bsp", "--workers", "16384", "--compute", "100", "--steps", "3"]
    flags += ["--comm-ms", "10", "--gate-store-rate", "28000"]
    # flat: 2 x 16384 requests at 28000 - 16384 heartbeats a second, + 1 round trip
    flat = [*flags, "--gate-group-size", "16384"]
    text = run_cli(["simulate", *flat], capsys)
    assert "step gate" in text and "opens 2821.04 ms" in text and "(flat: " in text, text
    doc = run_json(["simulate", *flat], capsys)
    assert doc["gate"]["cost_ms_per_step"] == pytest.approx(2821.04 - 100, abs=0.01)
    assert doc["gate"]["group_size"] == 16384
    # automatic: 128 groups of 128, open well within the 100 ms of compute
    text = run_cli(["simulate", *flags], capsys)
    assert "opens 36.05 ms after the ranks arrive (128 groups of 128: " in text, text
    assert run_json(["simulate", *flags], capsys)["gate"]["group_size"] == 128
    without = run_json(["simulate", *flags[:-2]], capsys)
    assert "gate" not in without


def test_the_group_size_needs_the_store_rate(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match="--gate-group-size 8 .* --gate-store-rate"):
        run_cli(["simulate", "--gate-group-size", "8"], capsys)
    with pytest.raises(UsageError, match="--gate-group-size must be .* got 1"):
        run_cli(["simulate", "--gate-store-rate", "9", "--gate-group-size", "1"], capsys)
