"""The frontier's CPU bound (``benchmarks/frontier.py``, issue 46): the machine's busy CPU read
from /proc/stat, and the share of the compute-only limit a configuration's own CPU work allows
once it keeps every core busy."""

from __future__ import annotations

import sys
import time

import pytest

from benchmarks import frontier as fr
from benchmarks.cluster_worker import BusySince
from benchmarks.harness import busy_ticks, machine_busy_s

pytestmark = pytest.mark.unit


def test_busy_ticks_count_user_nice_system_irq_softirq_and_steal_only() -> None:
    #       user nice system idle iowait irq softirq steal guest guest_nice
    line = b"cpu  100 20 30 5000 400 6 7 8 90 1\n"
    assert busy_ticks(line) == 100 + 20 + 30 + 6 + 7 + 8  # idle, iowait and guest left out
    assert busy_ticks(b"cpu  1 2 3 4\n") == 1 + 2 + 3  # an old kernel's shorter line


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


def test_the_workers_series_is_since_its_start_and_never_goes_back() -> None:
    readings = iter([100.0, 100.5, None, 101.25])
    busy = BusySince(read=lambda: next(readings))
    assert busy.series() is None  # not started
    busy.start()
    for _ in range(3):
        busy.mark()
    assert busy.series() == [0.5, 0.5, 1.25]  # the failed reading repeats the one before
    nothing = BusySince(read=lambda: None)
    nothing.start()
    nothing.mark()
    assert nothing.series() is None


def _run(loss: list[float], step_s: float, cpu_step_s: float | None) -> dict[str, object]:
    n = len(loss)
    return {
        "loss": loss,
        "time_s": [step_s * (i + 1) for i in range(n)],
        "busy_cpu_s": None if cpu_step_s is None else [cpu_step_s * (i + 1) for i in range(n)],
        "cores": 2,
        "grad_bytes": 4000,
    }


CAND = fr._c("cand", "diloco:4:1:3", "fp16")
OTHER = fr._c("other", "diloco:6:2:2", "fp16")
SETTING = fr.Setting(
    "t", "mlp", 2, "1gbit", (fr.DDP, CAND, OTHER, fr.ONLY), steps=30, share_goal=0.8
)


def _runs(cand_cpu: float | None, other_cpu: float | None = 0.3) -> dict[str, object]:
    # DDP reaches its own final loss before its last step: its loss is flat from step 19 on
    ddp = [max(1.0 - 0.02 * i, 0.62) for i in range(30)]
    faster = [1.0 - 0.04 * i for i in range(60)]  # the same loss by step 10
    return {
        "ddp": _run(ddp, 0.100, 0.16),
        "compute-only": _run(ddp, 0.025, 0.05),  # 2 cores, both busy: 0.05 CPU-s a step
        "cand": _run(faster, 0.050, cand_cpu),
        "other": _run(faster, 0.060, other_cpu),
    }


def test_the_cpu_bound_is_ddps_time_over_the_work_on_every_core() -> None:
    runs = _runs(cand_cpu=0.08)
    rows = fr.one_repeat(SETTING, runs)
    ddp_hit = fr.time_to_target(runs["ddp"], rows["target"])
    assert ddp_hit is not None and ddp_hit[1] < 29  # DDP got there before its last step
    step = rows["cand"]["step"]
    assert step is not None and step < ddp_hit[1]
    limit = rows["compute-only"]["vs_ddp_sps"]
    assert limit == pytest.approx(4.0)
    work_s = 0.08 * (step + 1) / 2  # the candidate's CPU up to its hit, over 2 cores
    assert rows["cand"]["cpu_share"] == pytest.approx(ddp_hit[0] / work_s / limit)
    assert rows["cand"]["cpu_vs_only"] == pytest.approx(0.08 / 0.05)
    assert rows["compute-only"]["cores_busy"] == pytest.approx(1.0)
    # the wall-clock share is below the bound: the candidate left the cores idle part of the time
    assert rows["cand"]["sooner"] / limit < rows["cand"]["cpu_share"]


def test_no_cpu_readings_leave_the_columns_empty() -> None:
    rows = fr.one_repeat(SETTING, _runs(cand_cpu=None))
    assert rows["cand"]["cpu_share"] is None and rows["cand"]["cpu_vs_only"] is None
    assert rows["cand"]["sooner"] is not None


@pytest.mark.parametrize(
    ("cand_cpu", "verdict", "best"),
    [(0.08, "`diloco:4:1:3` + fp16 could reach", "cand"), (0.35, "no configuration", "other")],
)
def test_the_goal_line_names_the_highest_bound_and_whether_it_allows_the_goal(
    cand_cpu: float, verdict: str, best: str
) -> None:
    summ = fr.summarize(SETTING, [_runs(cand_cpu)])
    line = next(x for x in fr.goals({"t": (SETTING, summ)}) if "issue 46" in x)
    assert verdict in line
    top = max(summ["rows"][k]["cpu_share"] for k in ("cand", "other"))
    assert summ["rows"][best]["cpu_share"] == top
    assert fr._share(top, 0.8) in line
    table = fr.render_setting(SETTING, summ)
    assert "share at the CPU bound" in table and "of the cores busy" in table


def test_a_share_just_under_its_goal_is_not_rounded_up_to_it() -> None:
    assert fr._share(0.948, 0.95) == "94.8%"
    assert fr._share(0.7996, 0.80) == "79.96%"
    assert fr._share(0.951, 0.95) == "95%"
    assert fr._share(0.53, 0.80) == "53%"
