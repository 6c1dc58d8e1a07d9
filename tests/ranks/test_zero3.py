"""ZeRO stage 3 (``zero:3``, FSDP2 underneath): one process's trajectory on the global batch,
each rank holding 1/N of the parameters and optimizer state, a model the user sharded
themselves, the non-finite skip agreed by every rank, checkpoints, refusals, the telemetry of
FSDP2's collectives and the CLI.

One spawn per world size (``zero3_ranks.everything``) runs every case; each test reads its part.
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync import compat
from gradsync.testing import run_ranks
from tests.support import rank_device
from tests.support import zero3_ranks as z3
from tests.support import zero_ranks as zr

pytestmark = [
    pytest.mark.ranks,
    pytest.mark.skipif(compat.fsdp2() is None, reason="this torch has no FSDP2"),
    rank_device.not_on_device(
        "zero:3 refuses a GPU model over gloo, whose collectives FSDP2 needs for CUDA tensors "
        "(tests/ranks/test_gpu_ranks.py checks the refusal)"
    ),
]


@functools.cache
def _reference(optimizer: str, world: int, clip: bool = False) -> list[torch.Tensor]:
    return zr.reference(optimizer, world, clip)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= 1e-10 * scale, f"{what}: max abs error {err:.3e} exceeds 1e-10 x {scale:.3e}"


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    world = int(request.param)
    root = tmp_path_factory.mktemp(f"zero3-{world}")
    return world, run_ranks(z3.everything, world, str(root), timeout_s=240)


@pytest.mark.timeout(300)
def test_zero3_follows_one_process_on_the_global_batch(
    runs: tuple[int, list[dict[str, Any]]],
) -> None:
    """float64, SGD with momentum and AdamW, two param groups, an lr schedule, 2 micro-batches
    a step, uneven shards on 3 ranks; clipping through the step handle clips the global
    gradient; a model the user sharded with fully_shard trains the same."""
    world, results = runs
    for name, case in z3.exactness_cases().items():
        expected = _reference(case["optimizer"], world, clip=case.get("clip") == "handle")
        for rank, out in enumerate(results):
            for step, params in enumerate(out[name]["params"]):
                _assert_close(params, expected[step], f"{name}, rank {rank}, step {step}")
    clipped = results[0]["sgd clip handle"]["norms"]
    assert all(n is not None and n > zr.MAX_NORM for n in clipped), clipped  # the clip cut
    assert len({tuple(out["sgd clip handle"]["norms"]) for out in results}) == 1
    lrs = [0.05 / (zr.STEPS + 1), 0.02 / (zr.STEPS + 1)]
    assert results[0]["sgd"]["lrs"] == pytest.approx(lrs, rel=1e-12)  # the schedule was followed
    start = zr.flat(zr._workload().build_model())
    assert not torch.allclose(results[0]["adamw"]["params"][-1], start)  # training moved them


@pytest.mark.timeout(300)
def test_each_rank_holds_its_shard_of_the_parameters_and_of_the_optimizer_state(
    runs: tuple[int, list[dict[str, Any]]],
) -> None:
    world, results = runs
    total = sum(p.numel() for p in zr._workload().build_model().parameters())
    for name in ("adamw", "adamw presharded"):
        held = [out[name]["held"] for out in results]
        assert sum(held) == total, (name, held)  # every element once, on one rank
        # Shards by rows: no rank holds more than its share plus one row of each tensor.
        assert max(held) <= total / world + 64 * 6, (name, held)
        # AdamW's two moments, of this rank's shard only
        assert [out[name]["state"] for out in results] == [2 * h for h in held]
        assert all(out[name]["sharded"] for out in results)  # the module holds DTensors


@pytest.mark.timeout(300)
def test_a_nan_in_one_ranks_shard_skips_the_step_on_every_rank(
    runs: tuple[int, list[dict[str, Any]]],
) -> None:
    _, results = runs
    nan = [out["nan"] for out in results]
    # Only rank 0's shard held the NaN: rank 1 skipped because the ranks agreed.
    assert nan[0]["finite_here"][z3.NAN_STEP] is False
    assert nan[1]["finite_here"][z3.NAN_STEP] is True
    for out in nan:
        assert out["skipped"] == [s == z3.NAN_STEP for s in range(zr.STEPS)]
        assert torch.equal(out["params"][z3.NAN_STEP], out["params"][z3.NAN_STEP - 1])
        assert torch.isfinite(out["params"][-1]).all()
        assert not torch.equal(out["params"][-1], out["params"][z3.NAN_STEP])


@pytest.mark.timeout(300)
def test_last_steps_gradient_shards_are_released_when_the_next_step_begins(
    runs: tuple[int, list[dict[str, Any]]],
) -> None:
    """As a DDP script's zero_grad(set_to_none=True): after a block the optimizer's
    parameters hold this rank's gradient shards; at the next block's entry they are released,
    not kept (1/N of the model) through the next forward and backward (issue 47)."""
    _, results = runs
    for rank, out in enumerate(results):
        r = out["released"]
        assert all(r["after"]) and r["last"] == len(r["after"]), (rank, r)
        assert all(r["entry"]), (rank, r)
        assert r["alive"] == 0, (rank, r)


@pytest.mark.timeout(300)
def test_a_grad_scaler_decides_on_the_whole_gradient_as_under_bsp(
    runs: tuple[int, list[dict[str, Any]]],
) -> None:
    _, results = runs
    for out in results:
        bsp, ours = out["scaler"]["bsp"], out["scaler"]["zero:3"]
        assert bsp["skipped"][z3.NAN_STEP] and bsp["scales"][z3.NAN_STEP] < 2.0**16
        assert ours["skipped"] == bsp["skipped"]
        assert ours["scales"] == bsp["scales"]
        assert torch.allclose(ours["params"], bsp["params"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_a_checkpoint_resumes_bitwise_each_rank_with_its_shards(
    runs: tuple[int, list[dict[str, Any]]],
) -> None:
    _, results = runs
    for out in results:
        assert out["resumed"]["start"] == z3.SAVE_AT
        # AdamW restarted from zero moments, or parameters left at their start, land elsewhere.
        assert torch.equal(out["resumed"]["params"], out["straight"]["params"])
        assert out["resumed"]["state"] == out["straight"]["state"] == 6


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("spec", "worlds"),
    # zero:1 reshards its optimizer state as zero:2 does (the same function; both by rows
    # for AdamW: the rows layout's 2-to-3 is here, its joins of either layout in
    # test_zero_rows.py)
    [("zero:3", (2, 3)), ("zero:3", (3, 2)), ("zero:2", (2, 3))],
    ids=["zero:3 2 to 3 ranks", "zero:3 3 to 2 ranks", "zero:2 2 to 3"],
)
def test_a_checkpoint_resumes_on_another_number_of_ranks(
    spec: str, worlds: tuple[int, int], tmp_path: Path
) -> None:
    """Saved on one number of ranks, resumed on another: zero:3's shards of every tensor and
    of AdamW's moments are split anew, zero:2's rows of AdamW's moments joined and cut for the
    new ranks, and the run follows one process whose global batch changed size at the
    checkpoint (float64, to 1e-10)."""
    before, after = worlds
    run_ranks(z3.resized, before, str(tmp_path), False, spec, timeout_s=120)
    resumed = run_ranks(z3.resized, after, str(tmp_path), True, spec, timeout_s=120)
    expected = z3.resized_reference(worlds)
    for rank, out in enumerate(resumed):
        assert out["start"] == z3.SAVE_AT
        _assert_close(out["params"], expected, f"rank {rank} after resuming on {after} ranks")
    # Every parameter's moments came back, on every rank (its shards, zero:3; its rows,
    # zero:2 by rows).
    states = [out["state"] for out in resumed]
    assert states == [6] * after


@pytest.mark.timeout(300)
def test_zero3_refuses_what_it_cannot_run_saying_why(
    runs: tuple[int, list[dict[str, Any]]],
) -> None:
    _, results = runs
    for out in results:
        refused = out["refusals"]
        assert refused["compression"].startswith(
            "zero:3 cannot compress its gradient exchange (compression fp16)"
        ), refused["compression"]
        assert "build the Synchronizer before the first optimizer step" in refused["stepped"]
        assert refused["balance"].startswith("balance needs bsp, zero:1 or zero:2 (got zero:3)")
        assert "FSDP2 DTensors" in refused["sharded under bsp"]
        assert "strategy='zero:3'" in refused["sharded under bsp"]


def _ring_bytes(params: list[torch.Tensor], world: int) -> int:
    """What each rank sends on a ring to all-gather (or reduce-scatter) ``params`` as FSDP2
    shards them: N - 1 shards, each tensor's rows padded to a multiple of N."""
    rows = [-(-p.shape[0] // world) * p[0].numel() * p.element_size() for p in params]
    return (world - 1) * sum(rows)


def _bytes_per_pass(case: str, world: int) -> int:
    """The bytes each rank sends per micro-batch in a telemetry case, from FSDP2's schedule:
    a unit is gathered before its forward and again before its backward, then its gradient
    reduce-scattered; the root's parameters stay gathered from forward to backward."""
    model = zr._workload().build_model()
    layers = [list(m.parameters()) for m in model if next(m.parameters(), None) is not None]
    if case == "presharded":  # the first layer a unit, the other two at the root
        return 3 * _ring_bytes(layers[0], world) + 2 * _ring_bytes(layers[1] + layers[2], world)
    return sum(3 * _ring_bytes(params, world) for params in layers)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["zero:3", "presharded"])
def test_fsdp2_collectives_are_communication_in_the_telemetry_with_their_bytes(
    runs: tuple[int, list[dict[str, Any]]], case: str
) -> None:
    """The time a rank spends blocked in FSDP2's gathers and reduce-scatters, inside the
    user's block, is sync (communication, or idle where it waited for a slower rank), not
    compute; the bytes are what FSDP2 moved; rank 1's extra compute is the others' idle."""
    world, results = runs
    per_pass = _bytes_per_pass(case, world)
    for rank, out in enumerate(results):
        tel = out["telemetry"][case]
        assert len(tel["records"]) == z3.TELEMETRY_STEPS
        for rec in tel["records"]:
            blocked = sum(d for step, _, d in tel["comm_spans"] if step == rec["step"])
            assert blocked > 0 and rec["comm"] > 0, (rank, rec)
            assert rec["sync"] >= blocked, (rank, rec, blocked)  # taken out of compute
            assert rec["bytes"] == zr.MICRO * per_pass, (rank, rec["bytes"], zr.MICRO * per_pass)
        if case == "zero:3":  # the explicit asynchronous gather was timed where FSDP2 waited
            waits = [(step, d) for step, name, d in tel["comm_spans"] if name == "allgather wait"]
            assert [step for step, _ in waits] == [z3.ASYNC_STEP], waits
        idle = statistics.median(rec["idle"] for rec in tel["records"])
        if rank == 1:
            assert idle < 0.5 * z3.SLEEP_S, idle
        else:  # it waited for rank 1 inside FSDP2's first gather of every step
            assert idle > 0.6 * z3.SLEEP_S, (rank, idle)
    total = sum(p.numel() * p.element_size() for p in zr._workload().build_model().parameters())
    schedule = 3 * total * (world - 1) // world  # gradsync's estimate when it cannot measure
    if case == "presharded":  # the root's parameters are gathered once a micro-batch, not twice
        assert per_pass < schedule
    else:  # the same schedule, plus the padding of rows that do not divide by N (41 here)
        assert per_pass >= schedule


@pytest.mark.timeout(300)
def test_without_custom_collectives_zero3_reports_the_schedules_bytes_and_no_comm_spans(
    runs: tuple[int, list[dict[str, Any]]],
) -> None:
    """A torch whose FSDP2 cannot take custom collectives: today's behaviour (the collectives'
    time is compute, ``bytes`` the schedule's estimate), and training goes on."""
    world, results = runs
    total = sum(p.numel() * p.element_size() for p in zr._workload().build_model().parameters())
    for out in results:
        tel = out["telemetry"]["fallback"]
        assert tel["comm_spans"] == []
        assert [r["bytes"] for r in tel["records"]] == [
            zr.MICRO * 3 * total * (world - 1) // world
        ] * z3.TELEMETRY_STEPS
