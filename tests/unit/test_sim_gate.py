"""The simulator's price of the step gate (gradsync.sim.gate): one store serving every rank's
two requests a step, waited ahead of the first collective under bsp and zero:1/2, before the
forward under zero:3."""

from __future__ import annotations

import numpy as np
import pytest

from gradsync.errors import UsageError
from gradsync.sim.config import CommModel
from gradsync.sim.gate import StoreGate
from gradsync.sim.simulate import Overlap, simulate
from tests.support.sim_cli import run_cli, run_json

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _wall(strategy: str, workers: int, gate: StoreGate | None, **kw: object) -> float:
    compute = np.full((5, workers), 100.0)
    return simulate(strategy, compute, CommModel(comm_ms=10.0, gate=gate), **kw).wall_ms / 5


def test_the_gate_opens_after_every_ranks_two_requests_and_two_round_trips() -> None:
    gate = StoreGate(store_rate=20_000.0, rtt_ms=0.5)
    assert gate.open_ms(1000) == pytest.approx(2 * 1000 / 20_000 * 1000 + 1.0)
    assert gate.cost_ms(1000, hidden_ms=60.0) == pytest.approx(41.0)
    assert gate.cost_ms(10, hidden_ms=60.0) == 0.0


def test_bsp_hides_the_gate_behind_compute_until_it_opens_later() -> None:
    fast = StoreGate(store_rate=1e6)
    assert _wall("bsp", 64, fast) == pytest.approx(_wall("bsp", 64, None))  # opens in 0.3 ms
    slow = StoreGate(store_rate=20_000.0, rtt_ms=0.0)  # 4096 ranks: opens 409.6 ms in
    assert _wall("bsp", 4096, slow) == pytest.approx(409.6 + 10.0)


def test_zero3_pays_the_whole_gate_before_its_forward() -> None:
    gate = StoreGate(store_rate=20_000.0, rtt_ms=0.0)  # 100 ranks: opens 10 ms in
    assert _wall("zero:3", 100, gate) == pytest.approx(_wall("zero:3", 100, None) + 10.0)
    assert _wall("zero:1", 100, gate) == pytest.approx(_wall("zero:1", 100, None))


def test_overlapped_buckets_start_no_earlier_than_the_gate() -> None:
    gate = StoreGate(store_rate=20_000.0, rtt_ms=0.0)  # 1000 ranks: opens 100 ms in
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
    text = run_cli(["simulate", *flags], capsys)
    assert "step gate" in text and "opens 1170.49 ms" in text, text
    doc = run_json(["simulate", *flags], capsys)
    assert doc["gate"]["cost_ms_per_step"] == pytest.approx(1170.49 - 100, abs=0.01)
    without = run_json(["simulate", *flags[:-2]], capsys)
    assert "gate" not in without
