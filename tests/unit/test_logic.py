"""Pure logic: telemetry arithmetic, bucket planning, spec parsing, workload sharding."""

from __future__ import annotations

import math

import pytest
import torch

from gradsync.buckets import MB, plan_buckets
from gradsync.inject import Slowdown, parse_slow
from gradsync.spec import bucket_sizes_mb, default_bucket_mb
from gradsync.strategies.base import parse_strategy_spec
from gradsync.telemetry.records import StepRecord, fill_idle
from gradsync.telemetry.report import RunReport
from gradsync.workloads import make_workload
from gradsync.workloads.mlp import hidden_for

pytestmark = pytest.mark.unit


def rec(rank: int, step: int, compute: float, sync: float) -> StepRecord:
    return StepRecord(rank, step, 0.0, compute, sync, 0.0, 0.0, 4, 100, loss=1.0)


def test_idle_and_comm_follow_the_definitions() -> None:
    records = fill_idle([rec(0, 0, 1.0, 2.5), rec(1, 0, 3.0, 0.5), rec(2, 0, 2.0, 0.5)])
    by_rank = {r.rank: r for r in records}
    assert by_rank[0].idle == 2.0 and by_rank[0].comm == 0.5  # waited 2 s for rank 1
    assert by_rank[1].idle == 0.0 and by_rank[1].comm == 0.5  # the slowest never idles
    assert by_rank[2].idle == 1.0 and by_rank[2].comm == 0.0  # floored at zero


def test_report_totals_barrier_tax_and_pace_setter() -> None:
    records = fill_idle(
        [rec(0, 0, 1.0, 2.5), rec(1, 0, 3.0, 0.5), rec(0, 1, 1.0, 2.0), rec(1, 1, 2.5, 0.5)]
    )
    report = RunReport.from_records(records)
    assert report.steps == 2
    assert report.pace_setter == 1 and report.pace_setter_counts == {1: 2}
    idle = 2.0 + 1.5
    wall = (1.0 + 2.5) + (3.0 + 0.5) + (1.0 + 2.0) + (2.5 + 0.5)
    assert report.barrier_tax == pytest.approx(idle / wall)
    r0 = report.ranks[0]
    assert r0.share("compute") + r0.share("comm") + r0.share("idle") == pytest.approx(1.0)
    assert report.to_dict()["ranks"][1]["samples"] == 8
    assert "pace-setter: rank 1 was the slowest in 2 of 2 steps" in report.format()


def test_buckets_reverse_order_respect_size_and_dtype() -> None:
    params = [torch.zeros(1000), torch.zeros(1000), torch.zeros(10, dtype=torch.float64)]
    buckets = plan_buckets(params, bucket_mb=6000 / MB)
    assert [len(b) for b in buckets] == [1, 1, 1]  # dtype change, then 8000 B > 6000 B
    assert buckets[0][0] is params[2]  # reverse registration order
    big = plan_buckets([torch.zeros(10) for _ in range(5)], bucket_mb=1.0)
    assert len(big) == 1 and len(big[0]) == 5


def test_the_first_bucket_is_small_so_it_leaves_while_backward_goes_on() -> None:
    # 12 tensors of 0.5 MiB: the first bucket takes 1 MiB (DDP's), the others 25 MiB at most
    params = [torch.zeros(MB // 8) for _ in range(12)]
    buckets = plan_buckets(params, bucket_mb=25.0)
    assert [len(b) for b in buckets] == [2, 10]
    assert buckets[0] == [params[11], params[10]]  # the last layers' gradients, first
    assert [len(b) for b in plan_buckets(params, bucket_mb=0.5)] == [1] * 12  # smaller: it rules
    assert bucket_sizes_mb(6.0, 25.0) == [1.0, 5.0]
    assert bucket_sizes_mb(0.5, 25.0) == [0.5]
    assert bucket_sizes_mb(3.0, 1.0) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("spec", "kind", "period", "staleness"),
    [
        ("bsp", "bsp", None, None),
        ("local:8", "local", 8, None),
        ("DiLoCo:32", "diloco", 32, None),
        ("ssp:0", "ssp", None, 0.0),
        ("ssp:inf", "ssp", None, math.inf),
        ("async", "async", None, None),
    ],
)
def test_strategy_specs(spec: str, kind: str, period: int | None, staleness: float | None) -> None:
    parsed = parse_strategy_spec(spec)
    assert (parsed.kind, parsed.period, parsed.staleness) == (kind, period, staleness)
    assert parse_strategy_spec(str(parsed)) == parsed


@pytest.mark.parametrize("bad", ["", "bsp:1", "local", "local:x", "ssp:1.5", "async:2", "sgd"])
def test_bad_strategy_specs(bad: str) -> None:
    with pytest.raises(ValueError, match="valid: bsp"):
        parse_strategy_spec(bad)


def test_slow_specs() -> None:
    assert parse_slow("3:2") == [Slowdown(rank=3, factor=2.0)]
    assert parse_slow("1:1.5@100,0:3") == [
        Slowdown(rank=1, factor=1.5, start=100),
        Slowdown(rank=0, factor=3.0),
    ]
    assert Slowdown(rank=1, factor=3, start=5).delay(1, 5, 0.2) == pytest.approx(0.4)
    assert Slowdown(rank=1, factor=3, start=5).delay(1, 4, 0.2) == 0.0
    for bad in ("3", "a:2", "1:0.5", "1:2@-1"):
        with pytest.raises(ValueError):
            parse_slow(bad)


@pytest.mark.parametrize("name", ["mlp", "charlm"])
def test_rank_shards_are_disjoint_slices_of_one_global_batch(name: str) -> None:
    w = make_workload(name, seed=1, params=5000)
    x_all, y_all = w.batch(step=3, global_batch=12, start=0, stop=12)
    parts = [w.batch(3, 12, lo, lo + 4) for lo in (0, 4, 8)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x_all)
    assert torch.equal(torch.cat([p[1] for p in parts]), y_all)
    x_next, _ = w.batch(step=4, global_batch=12, start=0, stop=12)
    assert not torch.equal(x_next, x_all)


def test_mlp_size_follows_params() -> None:
    for target in (10_000, 100_000, 6_000_000):
        model = make_workload("mlp", params=target).build_model()
        count = sum(p.numel() for p in model.parameters())
        assert abs(count - target) / target < 0.02, (target, count, hidden_for(target))


def test_charlm_learns_from_stdlib_text() -> None:
    w = make_workload("charlm", seed=0)
    assert w.tokens.numel() > 100_000  # a real sample, not a stub
    model = w.build_model()
    opt = w.make_optimizer(model, w.default_lr)
    losses = []
    for step in range(30):
        opt.zero_grad()
        x, y = w.batch(step, 16, 0, 16)
        loss = w.loss(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_finiteness_check_is_exact_and_does_not_overflow_half_precision() -> None:
    from gradsync.checks.guards import is_finite

    x = torch.randn(1000)
    assert is_finite(x)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[123] = bad
        assert not is_finite(y)
    opposite = x.clone()
    opposite[1], opposite[2] = float("inf"), -float("inf")  # sums to NaN: still caught
    assert not is_finite(opposite)
    # 100k x 60000 overflows an fp16 sum, but every element is finite
    assert is_finite(torch.full((100_000,), 60000.0, dtype=torch.float16))


def test_the_check_of_many_tensors_at_once_is_as_exact_as_one_by_one() -> None:
    from gradsync.checks.guards import all_finite

    grads = [torch.randn(50), torch.randn(3, 4), torch.randn(7)]
    assert all_finite(grads) and all_finite([]) and all_finite(grads[:1])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in range(len(grads)):
            poisoned = [g.clone() for g in grads]
            poisoned[i].view(-1)[1] = bad
            assert not all_finite(poisoned), (bad, i)
    # finite values whose sums overflow float32: confirmed finite one by one
    assert all_finite([torch.full((1000,), 3e38), torch.ones(3)])
    # several dtypes; half precision summed in float32 (100k x 0.7 overflows an fp16 sum)
    half = torch.full((100_000,), 0.7, dtype=torch.float16)
    assert all_finite([torch.ones(3, dtype=torch.float64), half])
    half[2] = float("nan")
    assert not all_finite([torch.ones(3, dtype=torch.float64), half])
    # a NaN in an imaginary part (a sum into a real dtype would drop it)
    assert not all_finite([torch.ones(3), torch.tensor([1 + 1j, complex(0, float("nan"))])])


def test_hang_diagnosis_counts_a_rank_one_step_ahead_as_arrived() -> None:
    import torch.distributed as dist

    from gradsync.checks.diagnose import ArrivalWatch

    store = dist.HashStore()
    watch = ArrivalWatch(0, 4, 20.0, store=store, arrive_after_s=0.1)
    # a 4-host partition: rank 1's ring all-reduce finished step 5 and it waits at step 6,
    # rank 2 waits at step 5, rank 3 (behind the cut link) last waited at step 4
    store.set("gradsync/arrive/1", "6")
    store.set("gradsync/arrive/2", "5")
    store.set("gradsync/arrive/3", "4")
    assert watch.arrivals(5) == ([0, 1, 2], [3])


def test_the_default_plan_cuts_a_small_gradient_into_a_few_buckets_and_a_large_one_in_25_mb() -> (
    None
):
    from gradsync.buckets import BucketReducer

    assert default_bucket_mb(40.0) == pytest.approx(40.0 / 8)
    assert default_bucket_mb(4.7) == 1.0  # never below the first bucket's size
    assert default_bucket_mb(400.0) == 25.0  # DDP's cap for large gradients
    params = [torch.zeros(MB // 4, requires_grad=True) for _ in range(32)]  # 32 MiB
    reducer = BucketReducer(params, None, lambda bucket: None)  # type: ignore[arg-type,return-value]
    assert reducer.bucket_mb == 4.0
    assert [len(b.parameters()) for b in reducer.buckets] == [1, 4, 4, 4, 4, 4, 4, 4, 3]
