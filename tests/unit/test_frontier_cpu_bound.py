"""The frontier's CPU bound (``benchmarks/frontier.py``, issue 46): the machine's busy CPU read
from /proc/stat, and the share of the compute-only limit a configuration's own CPU work allows
once it keeps every core busy."""

from __future__ import annotations

import sys
import time

import pytest

from benchmarks import frontier as fr
from benchmarks.harness import machine_busy_s

pytestmark = pytest.mark.unit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_the_machine_busy_counter_grows_with_work() -> None:
    before = machine_busy_s()
    assert before is not None and before > 0
    spin_until = time.perf_counter() + 0.3
    while time.perf_counter() < spin_until:
        pass
    after = machine_busy_s()
    assert after is not None
    # this process alone kept one core busy for 0.3 s; the kernel counts in 10 ms ticks
    assert after - before >= 0.2


def _run(loss: list[float], step_s: float, cpu_step_s: float | None) -> dict[str, object]:
    n = len(loss)
    return {
        "loss": loss,
        "time_s": [step_s * (i + 1) for i in range(n)],
        "busy_cpu_s": None if cpu_step_s is None else [cpu_step_s * (i + 1) for i in range(n)],
        "grad_bytes": 4000,
    }


CAND = fr._c("cand", "diloco:4:1:3", "fp16")
SETTING = fr.Setting("t", "mlp", 2, "1gbit", (fr.DDP, CAND, fr.ONLY), steps=20, share_goal=0.8)


def _runs(cand_cpu: float | None) -> dict[str, object]:
    ddp = [1.0 - 0.02 * i for i in range(20)]  # reaches its own final loss at step 19
    faster = [1.0 - 0.04 * i for i in range(40)]  # the same loss by step 10
    return {
        "ddp": _run(ddp, 0.100, 0.16),
        "compute-only": _run(ddp, 0.025, 0.05),  # 2 cores, both busy: 0.05 CPU-s a step
        "cand": _run(faster, 0.050, cand_cpu),
    }


def test_the_cpu_bound_is_ddps_time_over_the_work_on_every_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fr.os, "cpu_count", lambda: 2)
    rows = fr.one_repeat(SETTING, _runs(cand_cpu=0.08))
    step = rows["cand"]["step"]
    assert step is not None and step < 19
    limit = rows["compute-only"]["vs_ddp_sps"]
    assert limit == pytest.approx(4.0)
    ddp_s = 0.100 * 20  # the moving-average target is met at DDP's last step
    work_s = 0.08 * (step + 1) / 2  # the candidate's CPU up to its hit, over 2 cores
    assert rows["cand"]["cpu_share"] == pytest.approx(ddp_s / work_s / limit)
    assert rows["cand"]["cpu_vs_only"] == pytest.approx(0.08 / 0.05)
    assert rows["compute-only"]["cores_busy"] == pytest.approx(1.0)
    # the wall-clock share is below the bound: the candidate left the cores idle part of the time
    assert rows["cand"]["sooner"] / limit < rows["cand"]["cpu_share"]


def test_no_cpu_readings_leave_the_columns_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fr.os, "cpu_count", lambda: 2)
    rows = fr.one_repeat(SETTING, _runs(cand_cpu=None))
    assert rows["cand"]["cpu_share"] is None and rows["cand"]["cpu_vs_only"] is None
    assert rows["cand"]["sooner"] is not None


@pytest.mark.parametrize(("cand_cpu", "verdict"), [(0.08, "could reach"), (0.2, "rules it out")])
def test_the_goal_line_says_whether_the_cpu_work_allows_the_goal(
    monkeypatch: pytest.MonkeyPatch, cand_cpu: float, verdict: str
) -> None:
    monkeypatch.setattr(fr.os, "cpu_count", lambda: 2)
    summ = fr.summarize(SETTING, [_runs(cand_cpu)])
    line = next(x for x in fr.goals({"t": (SETTING, summ)}) if "issue 46" in x)
    assert verdict in line
    table = fr.render_setting(SETTING, summ)
    assert "share at the CPU bound" in table and "of the cores busy" in table


def test_a_share_just_under_its_goal_is_not_rounded_up_to_it() -> None:
    assert fr._share(0.948, 0.95) == "94.8%"
    assert fr._share(0.951, 0.95) == "95%"
    assert fr._share(0.53, 0.80) == "53%"
