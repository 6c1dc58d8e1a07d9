"""Goodput under failures (gradsync.sim.failures, ``gradsync simulate --failures``): the
formulas on cases computed by hand, against a seeded event-by-event count, the command's table
and its refusals."""

from __future__ import annotations

import ast
import inspect
import math
import random

import pytest

from gradsync.errors import UsageError
from gradsync.sim import failures
from gradsync.sim.__main__ import main as sim_main
from gradsync.sim.failures import (
    LLAMA3,
    FailureCosts,
    failures_per_day,
    goodput,
    live_goodput,
    restart_goodput,
)
from tests.support.sim_cli import run_cli, run_json

pytestmark = pytest.mark.unit

SIZES = (1024, 16_384, 100_000)
#: a restart of minutes at scale, as docs/simulator.md's second table
AT_SCALE = FailureCosts(restart_s=300.0, heal_s=300.0, step_s=10.0, checkpoint_every=100)


def test_the_llama3_default_is_419_interruptions_in_54_days_on_16384_gpus() -> None:
    assert FailureCosts().failure_rate == LLAMA3.rate
    assert failures_per_day(16_384, LLAMA3.rate) == pytest.approx(419 / 54)
    assert round(failures_per_day(16_384, LLAMA3.rate), 2) == 7.76
    assert LLAMA3.rate == pytest.approx(419 / (54 * 24 * 16_384))


@pytest.mark.parametrize("costs", [FailureCosts(failure_rate=0.0), AT_SCALE])
def test_without_failures_both_paths_keep_all_their_time(costs: FailureCosts) -> None:
    costs = FailureCosts(**{**_fields(costs), "failure_rate": 0.0})
    for n in SIZES:
        row = goodput(n, costs)
        assert (row.failures_per_day, row.restart, row.live) == (0.0, 1.0, 1.0)
        assert row.hours_between == math.inf


def test_restart_by_hand() -> None:
    # 100 GPUs at 0.036 failures a GPU-hour: one failure every 1000 s. Down 100 s a failure,
    # a checkpoint every 10 s: about half of it (5 s) lost, x/expm1(x) exactly.
    costs = FailureCosts(failure_rate=0.036, restart_s=100.0, step_s=1.0, checkpoint_every=10)
    assert restart_goodput(100, costs) == pytest.approx((0.01 / math.expm1(0.01)) / 1.1)
    assert restart_goodput(100, costs) == pytest.approx((1 - 5 / 1000) / 1.1, abs=1e-5)


def test_live_by_hand() -> None:
    # One failure every 1000 s; survivors stall 1 s; a group of 10 of 100 GPUs is away 51 s,
    # 50 of them while the others train: 10% of the throughput missing 5% of the time.
    costs = FailureCosts(failure_rate=0.036, stall_s=1.0, heal_s=51.0, step_s=1.0, group_gpus=10)
    kept_step = 0.001 / math.expm1(0.001)  # the step in flight, about half a step lost
    assert live_goodput(100, costs) == pytest.approx((kept_step - 0.001 * 5.0) / 1.001)
    back_in_the_stall = FailureCosts(**{**_fields(costs), "heal_s": 0.5})
    assert live_goodput(100, back_in_the_stall) == pytest.approx(kept_step / 1.001)


@pytest.mark.parametrize("costs", [FailureCosts(), AT_SCALE])
def test_restart_goodput_falls_with_the_cluster(costs: FailureCosts) -> None:
    values = [restart_goodput(n, costs) for n in SIZES]
    assert values == sorted(values, reverse=True) and values[0] > values[-1]
    assert all(0 < v < 1 for v in values)


@pytest.mark.parametrize(
    ("restart_s", "stall_s", "heal_s", "every"),
    [(5.0, 5.0, 5.0, 1), (300.0, 2.1, 300.0, 100), (60.0, 0.0, 60.0, 1), (2.1, 2.1, 0.4, 10)],
)
def test_live_is_no_worse_when_its_costs_are_no_larger(
    restart_s: float, stall_s: float, heal_s: float, every: int
) -> None:
    costs = FailureCosts(
        restart_s=restart_s, stall_s=stall_s, heal_s=heal_s, checkpoint_every=every, step_s=1.0
    )
    for n in SIZES:
        assert live_goodput(n, costs) >= restart_goodput(n, costs)


def test_with_the_measured_small_model_costs_restart_wins() -> None:
    """gradsync's forked restart (0.4 s) is shorter than the live path's 2 s stall: the
    comparison the docs make, and the reason the measured figures are a floor."""
    for n in SIZES:
        row = goodput(n, FailureCosts())
        assert row.restart > row.live > 0.998
    row = goodput(100_000, AT_SCALE)
    assert row.restart < 0.7 < 0.99 < row.live


def _fields(costs: FailureCosts) -> dict[str, float]:
    return {name: getattr(costs, name) for name in FailureCosts.__slots__}


def _counted_restart(lam: float, interval: float, restart_s: float, cycles: int) -> float:
    rng = random.Random(7)
    kept = wall = 0.0
    for _ in range(cycles):
        run = rng.expovariate(lam)
        kept += interval * math.floor(run / interval)
        wall += run + restart_s
    return kept / wall


def _counted_live(lam: float, step: float, stall: float, away: float, share: float) -> float:
    rng = random.Random(11)
    kept = wall = 0.0
    for _ in range(200_000):
        run = rng.expovariate(lam)
        kept += step * math.floor(run / step) - share * away  # absences add, overlap or not
        wall += run + stall
    return kept / wall


def test_the_closed_forms_match_failures_counted_one_by_one() -> None:
    # A failure every 2000 s, a checkpoint every 1000 s: half an interval would be 0.75 kept.
    costs = FailureCosts(failure_rate=1.8, restart_s=200.0, step_s=100.0, checkpoint_every=10)
    counted = _counted_restart(1 / 2000, 1000.0, 200.0, cycles=200_000)
    assert restart_goodput(1, costs) == pytest.approx(counted, rel=0.01)
    assert abs(counted - 0.75 / 1.1) > 0.01  # the exact expectation, not the first order
    live = FailureCosts(failure_rate=0.018, stall_s=30.0, heal_s=630.0, step_s=50.0, group_gpus=10)
    counted = _counted_live(1 / 2000, 50.0, 30.0, away=600.0, share=10 / 100)
    assert live_goodput(100, live) == pytest.approx(counted, rel=0.01)


def test_simulate_failures_prints_the_table_and_the_published_figure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = run_cli(["simulate", "--failures"], capsys)
    assert "restart-from-checkpoint" in text and "live membership" in text
    for n in ("1,024", "16,384", "100,000"):
        assert any(line.split()[0] == n for line in text.splitlines() if line.strip()), text
    assert "419 unexpected interruptions in 54 days on 16,384 GPUs, 7.76 a day" in text
    assert "gives 7.76 a day there" in text
    doc = run_json(["simulate", "--failures"], capsys)
    assert [r["gpus"] for r in doc["rows"]] == list(SIZES)
    assert doc["costs"] == {
        "failure_rate_per_gpu_hour": LLAMA3.rate,
        "step_s": 0.018,
        "checkpoint_every": 1,
        "restart_s": 0.4,
        "stall_s": 2.1,
        "heal_s": 2.1,
        "group_gpus": 8,
    }
    assert doc["rows"][1]["goodput_live"] == goodput(16_384, FailureCosts()).live


def test_the_docs_table_at_scale(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/simulator.md's second table, with a restart of five minutes."""
    flags = ["--restart-s", "300", "--heal-s", "300", "--step-s", "10", "--checkpoint-every", "100"]
    text = run_cli(["simulate", "--failures", *flags], capsys)
    assert "16,384          7.76           3.09                 93.0694%         99.9350%" in text
    assert "100,000         47.36           0.51                 64.4813%         99.6102%" in text
    doc = run_json(["simulate", "--failures", "--gpus", "4096", "--failure-rate", "1e-4"], capsys)
    assert doc["rows"][0]["failures_per_day"] == pytest.approx(4096 * 1e-4 * 24)
    assert "a GPU-hour gives 39.32 a day there" in run_cli(
        ["simulate", "--failures", "--failure-rate", "1e-4"], capsys
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--gpus", "0"],
            r"--gpus takes whole numbers of GPUs from 1 to 10,000,000, comma-sep.* \(e\.g\. 1024",
        ),
        (["--gpus", "1024,-5"], "--gpus takes whole numbers of GPUs from 1.* got '-5'"),
        (["--gpus", "1024,lots"], "--gpus takes whole numbers .* got 'lots'"),
        (["--gpus", "1.5"], "--gpus takes whole numbers .* got '1.5'"),
        (
            ["--failure-rate=-1e-5"],
            "--failure-rate must be a number >= 0 and at most 60, got -1e-05",
        ),
        (
            ["--restart-s", "-1"],
            r"--restart-s must be a number >= 0 and at most 86400 \(a day\), got -1",
        ),
        (["--stall-s", "-1"], "--stall-s must be a number >= 0"),
        (["--heal-s", "-0.1"], "--heal-s must be a number >= 0"),
        (["--step-s", "0"], "--step-s must be a number > 0 and at most 86400 .* got 0.0"),
        (["--heal-s", "inf"], "--heal-s must be a finite number, got inf"),
        (
            ["--checkpoint-every", "0"],
            "--checkpoint-every must be a whole number of steps from 1 to 1,000,000,0",
        ),
        (["--group-gpus", "0"], "--group-gpus must be a whole number from 1 to 10,000,000, got 0"),
        (["--gpus", "8", "--group-gpus", "8"], "--group-gpus 8 leaves fewer than 2 replica"),
        # past these the closed forms overflowed a float (OverflowError) or printed 300 digits
        (["--failure-rate", "1e9"], "--failure-rate must be .* at most 60, got 1000000000.0"),
        (["--step-s", "1e12"], "--step-s must be .* at most 86400 .* got 1000000000000.0"),
        (["--checkpoint-every", "1000000001"], "--checkpoint-every must be .* got 1000000001"),
        (["--gpus", "10000001"], "--gpus takes whole numbers of GPUs from 1 to 10,000,000"),
        (["--group-gpus", "10000001"], "--group-gpus must be a whole number from 1 to 10,000,000"),
        (["--workers", "3"], "--workers apply to the step simulation, not to --failures"),
    ],
)
def test_bad_values_are_refused_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(UsageError, match=message):
        run_cli(["simulate", "--failures", *argv], capsys)
    assert sim_main(["simulate", "--failures", *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("python -m gradsync.sim simulate: error: --")


def test_failure_flags_without_failures_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match=r"^--gpus, --restart-s price\(s\) failures: give"):
        run_cli(["simulate", "--gpus", "8", "--restart-s", "3"], capsys)


def test_a_non_number_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        sim_main(["simulate", "--failures", "--restart-s", "soon"])
    assert exited.value.code == 2
    assert "argument --restart-s: invalid float value: 'soon'" in capsys.readouterr().err


def test_the_model_imports_neither_torch_nor_numpy() -> None:
    """It runs where only the standard library is (python -m gradsync.sim)."""
    tree = ast.parse(inspect.getsource(failures))
    imported = {
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert imported == {"__future__", "math", "dataclasses", "gradsync.errors"}


def test_the_longest_checkpoint_interval_keeps_nothing_without_overflowing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A billion steps between checkpoints: e^(L T) is past a float's range (it raised
    OverflowError); the work kept is 0, the live path unaffected."""
    out = run_cli(["simulate", "--failures", "--checkpoint-every", "1000000000"], capsys)
    rows = [line.split() for line in out.splitlines() if line.lstrip()[:1].isdigit()]
    assert rows and all(r[3] == "0.0000%" and r[4] != "0.0000%" for r in rows)
