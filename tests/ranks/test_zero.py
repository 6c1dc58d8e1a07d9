"""ZeRO stages 1 and 2 (``zero:1``, ``zero:2``): one process's trajectory on the global batch,
identical replicas, the optimizer state (and, for stage 2, the gradient) held per shard, the
gradient-ready point, skips, the GradScaler, checkpoints, refusals and the CLI.

The multi-rank checks share two spawns per world size (``zero_ranks.exactness`` and
``zero_ranks.scenarios`` run every case in one group), so each test below reads its part."""

from __future__ import annotations

import functools
from itertools import product
from typing import Any

import pytest
import torch

from gradsync.strategies.zero_shards import (
    COLLECTIVE,
    POINT_TO_POINT,
    OwnerLayout,
)
from gradsync.testing import run_ranks
from tests.support import zero_ranks as zr

pytestmark = pytest.mark.ranks

STAGES = ("zero:1", "zero:2")


@functools.cache
def _reference(
    optimizer: str, world: int, clip: bool = False, edited: bool = False
) -> list[torch.Tensor]:
    return zr.reference(optimizer, world, clip, edited)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= 1e-10 * scale, f"{what}: max abs error {err:.3e} exceeds 1e-10 x {scale:.3e}"


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def exact(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world = int(request.param)
    return world, run_ranks(zr.exactness, world, timeout_s=150)


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("zero-checkpoints")
    return run_ranks(zr.scenarios, 2, str(root), timeout_s=150)


# -- exactness (2 and 3 ranks, uneven shards) --------------------------------------------------


@pytest.mark.timeout(180)
def test_both_stages_follow_one_process_on_the_global_batch(
    exact: tuple[int, list[dict[str, Any]]],
) -> None:
    """float64, SGD with momentum and AdamW, two param groups, an lr schedule, 2 micro-batches
    a step: every step's parameters match one process on the whole global batch."""
    world, results = exact
    for stage in STAGES:
        for optimizer in ("sgd", "adamw"):
            name = f"{stage} {optimizer}"
            expected = _reference(optimizer, world)
            for step, params in enumerate(results[0][name]["params"]):
                _assert_close(params, expected[step], f"{name}, step {step}")
    # The schedule mattered (so following it was checked): the lr changed every step.
    lrs = [0.05 / (zr.STEPS + 1), 0.02 / (zr.STEPS + 1)]
    assert results[0]["zero:2 sgd"]["lrs"] == pytest.approx(lrs, rel=1e-12)
    # Not vacuous: training moved the parameters.
    start = zr.flat(zr._workload().build_model())
    assert not torch.allclose(results[0]["zero:2 adamw"]["params"][-1], start)


@pytest.mark.timeout(180)
def test_every_rank_holds_the_same_parameters_after_every_step(
    exact: tuple[int, list[dict[str, Any]]],
) -> None:
    world, results = exact
    for name in zr.exactness_cases(world):
        for step in range(zr.STEPS):
            first = results[0][name]["params"][step]
            for rank, out in enumerate(results[1:], start=1):
                assert torch.equal(out[name]["params"][step], first), (name, step, rank)


@pytest.mark.timeout(180)
def test_each_rank_holds_only_its_shards_optimizer_state_and_zero2_only_its_gradient(
    exact: tuple[int, list[dict[str, Any]]],
) -> None:
    world, results = exact
    tensors = set(range(6))  # the mlp's 3 weights and 3 biases
    shapes = [p.shape for p in zr._workload().build_model().parameters()]
    for stage, layout in product(STAGES, ("", " whole")):
        for optimizer in ("sgd", "adamw"):
            name = f"{stage} {optimizer}{layout}"
            states = [set(out[name]["state"]) for out in results]
            grads = [set(out[name]["grads"]) for out in results]
            rows = results[0][name]["layout"] == "rows"
            if stage == "zero:1":  # the mean gradient everywhere, as under bsp
                assert grads == [tensors] * world, (name, grads)
            elif rows:  # each rank's rows are the .grad of its pieces, not of the parameters
                assert grads == [set()] * world, (name, grads)
            else:  # only the owned tensors' gradient survives the exchange
                assert grads == states, (name, grads)
            if rows:
                # Every rank holds the state of its rows of every tensor: together each
                # tensor's elements once, each rank at most ceil(rows / N) rows of it.
                assert states == [tensors] * world, (name, states)
                for i, shape in enumerate(shapes):
                    held = [out[name]["state_numel"][i] for out in results]
                    rows = -(-shape[0] // world)
                    assert sum(held) == shape.numel(), (name, i, held)
                    assert max(held) == rows * shape.numel() // shape[0], (name, i, held)
                continue
            # Every tensor's state on exactly one rank; every rank steps some tensor.
            assert sum(len(s) for s in states) == len(tensors), (name, states)
            assert set().union(*states) == tensors, (name, states)
            assert all(states), (name, states)
    for stage in STAGES:  # SGD and AdamW: by rows, unless whole tensors are forced
        assert results[0][f"{stage} sgd"]["layout"] == "rows"
        assert results[0][f"{stage} sgd whole"]["layout"] == "whole"
    # Whole tensors are uneven: the greedy size split of the mlp's tensors cannot balance them.
    sizes = [p.numel() for p in zr._workload().build_model().parameters()]
    loads = [sum(sizes[i] for i in out["zero:2 sgd whole"]["state"]) for out in results]
    assert len(set(loads)) == world, loads


@pytest.mark.timeout(180)
def test_both_stages_by_rows_end_where_whole_tensors_do(
    exact: tuple[int, list[dict[str, Any]]],
) -> None:
    """The optimizers sharded by rows update element by element: a piece's step is the whole
    tensor's, bit for bit. zero:1 sums the gradient as bsp does: bitwise either way. zero:2's
    ring sums each element from its owner's neighbour on, and the owner of an element differs
    between the layouts: bitwise on 2 ranks (a sum of two is the same either way), to
    rounding on 3; a clip's norm, summed per rank, to rounding either way."""
    world, results = exact
    for stage, optimizer in product(STAGES, ("sgd", "adamw")):
        name = f"{stage} {optimizer}"
        for out in results:
            rows, whole = out[name], out[f"{name} whole"]
            for step, params in enumerate(rows["params"]):
                if stage == "zero:1" or world == 2:
                    assert torch.equal(params, whole["params"][step]), (name, step)
                else:
                    _assert_close(params, whole["params"][step], f"{name}, step {step}")
    for out in results:
        rows, whole = out["zero:2 clip handle"], out["zero:2 clip handle whole"]
        assert rows["norms"] == pytest.approx(whole["norms"], rel=1e-12)
        for step, params in enumerate(rows["params"]):
            _assert_close(params, whole["params"][step], f"zero:2 clip handle, step {step}")


@pytest.mark.timeout(180)
def test_gloo_picks_point_to_point_and_either_way_of_exchanging_follows_one_process(
    exact: tuple[int, list[dict[str, Any]]],
) -> None:
    """Broadcasts and a send/receive ring (gloo's way), or the flat all-gather and
    reduce-scatter (NCCL's, forced here on gloo): the same trajectory, to 1e-10."""
    world, results = exact
    expected = _reference("adamw", world)
    for stage in STAGES:
        assert results[0][f"{stage} adamw"]["buffers"][-1]["exchange"] == POINT_TO_POINT
        for exchange in (COLLECTIVE, POINT_TO_POINT):
            name = f"{stage} adamw {exchange}"
            for out in results:
                assert out[name]["buffers"][-1]["exchange"] == exchange, name
                for step, params in enumerate(out[name]["params"]):
                    _assert_close(params, expected[step], f"{name}, step {step}")


@pytest.mark.timeout(180)
def test_the_buffers_are_kept_between_steps_and_a_parameter_changed_between_steps_holds(
    exact: tuple[int, list[dict[str, Any]]],
) -> None:
    """Every step reuses the same round buffers, each at most one bucket (not one copy of the
    model, which is several buckets here); no parameter or gradient shares their storage (the
    next step overwrites them); a change the user makes to every parameter between steps is
    what the next step starts from, on every rank, as in one process."""
    world, results = exact
    for name in zr.exactness_cases(world):
        if not name.startswith("zero"):
            continue
        for out in results:
            buffers = out[name]["buffers"]
            assert all(b["ptrs"] == buffers[0]["ptrs"] for b in buffers), name
            last = buffers[-1]
            assert last["model_bytes"] > 4 * last["bucket_bytes"], name  # rounds, not one
            assert all(size <= last["bucket_bytes"] for size in last["sizes"]), (name, last)
            assert not any(b["params_alias"] or b["grads_alias"] for b in buffers), name
    expected, unedited = _reference("sgd", world, edited=True), _reference("sgd", world)
    assert not torch.allclose(expected[-1], unedited[-1])  # the edit mattered
    for stage in STAGES:
        name = f"{stage} sgd edited"
        for out in results:
            for step, params in enumerate(out[name]["params"]):
                _assert_close(params, expected[step], f"{name}, step {step}")


@pytest.mark.timeout(180)
def test_zero1_exchanges_as_bsp_so_it_ends_bitwise_equal_to_bsp_with_a_compressor_too(
    exact: tuple[int, list[dict[str, Any]]],
) -> None:
    _, results = exact
    for out in results:
        assert torch.equal(out["zero:1 sgd"]["params"][-1], out["bsp sgd"]["params"][-1])
        # top-k with error feedback: lossy, but the same exchange, so the same bits
        assert torch.equal(out["zero:1 topk"]["params"][-1], out["bsp topk"]["params"][-1])
        assert not torch.equal(out["zero:1 topk"]["params"][-1], out["zero:1 sgd"]["params"][-1])


@pytest.mark.timeout(180)
def test_clipping_at_the_gradient_ready_point_clips_the_global_gradient(
    exact: tuple[int, list[dict[str, Any]]],
) -> None:
    """zero:1 through ``s.clip_grad_norm_``; zero:2 through ``strategy.grad_norm`` (its shards'
    sums, one all-reduce), which ``clip_grad_norm`` in the protocol module uses."""
    world, results = exact
    expected = _reference("sgd", world, clip=True)
    for name in ("zero:1 clip handle", "zero:2 clip strategy"):
        norms = results[0][name]["norms"]
        assert min(norms) > zr.MAX_NORM, norms  # every step was cut
        for out in results:
            assert out[name]["norms"] == norms, name  # the global norm, on every rank
            _assert_close(out[name]["params"][-1], expected[-1], name)


@pytest.mark.timeout(180)
def test_zero2_clip_through_the_step_handle_clips_the_global_gradient(
    exact: tuple[int, list[dict[str, Any]]],
) -> None:
    world, results = exact
    expected = _reference("sgd", world, clip=True)
    for out in results:
        _assert_close(out["zero:2 clip handle"]["params"][-1], expected[-1], "zero:2 handle")


@pytest.mark.timeout(180)
def test_zero2_with_balanced_uneven_shards_keeps_the_global_batch_mean(
    exact: tuple[int, list[dict[str, Any]]],
) -> None:
    world, results = exact
    expected = _reference("adamw", world)
    _assert_close(results[0]["zero:2 balanced"]["params"][-1], expected[-1], "balanced")


# -- skips, the GradScaler, checkpoints, refusals (2 ranks) ------------------------------------


@pytest.mark.timeout(180)
def test_a_nan_gradient_or_a_raising_block_on_one_rank_skips_the_step_on_every_rank(
    scenes: list[dict[str, Any]],
) -> None:
    # The poisoned tensor is in rank 0's shard only: under zero:2 rank 1 sees a finite shard
    # and must learn from the others that the step is skipped.
    names = [n for n, _ in zr._workload().build_model().named_parameters()]
    sizes = [p.numel() for p in zr._workload().build_model().parameters()]
    owners = OwnerLayout([torch.zeros(n) for n in sizes], world=2, rank=0).owners
    assert owners[names.index(zr.POISONED)] == 0 and 1 in owners
    for stage in STAGES:
        for out in scenes:
            run = out[f"nan {stage}"]
            skips = [zr.NAN_STEP <= s <= zr.NAN_STEP + 1 for s in range(zr.STEPS)]
            assert run["skipped"] == skips, (stage, run["skipped"])
            params = run["params"]
            assert torch.equal(params[zr.NAN_STEP + 1], params[zr.NAN_STEP - 1]), stage
            assert torch.equal(params[-1], scenes[0][f"nan {stage}"]["params"][-1]), stage
            assert bool(torch.isfinite(params[-1]).all())
            assert not torch.equal(params[-1], params[-2]), stage  # training went on


@pytest.mark.timeout(180)
def test_a_grad_scaler_drives_both_stages_as_it_drives_bsp(
    scenes: list[dict[str, Any]],
) -> None:
    """An infinite gradient on rank 1 at one step; unscaled by the user at the gradient-ready
    point or left to the step: the same skips and scales as bsp, the same parameters."""
    for out in scenes:
        runs = out["scaler"]
        bsp = runs["bsp unscale=False"]
        expected = [step == zr.INF_STEP for step in range(zr.STEPS + 2)]
        assert bsp["skipped"] == expected
        assert bsp["scales"][-1] > bsp["scales"][zr.INF_STEP]  # it backed off, then grew
        for name, run in runs.items():
            assert run["skipped"] == expected, name
            assert run["scales"] == bsp["scales"], name
            torch.testing.assert_close(run["params"], bsp["params"], rtol=1e-6, atol=0)
            assert torch.equal(run["params"], scenes[0]["scaler"][name]["params"]), name


@pytest.mark.timeout(180)
def test_a_checkpoint_resumes_bitwise_each_rank_with_its_shard_of_the_optimizer_state(
    scenes: list[dict[str, Any]],
) -> None:
    for stage in (*STAGES, "zero:2 whole"):
        counts = []
        for out in scenes:
            straight, resumed = (
                out["checkpoints"][stage]["straight"],
                out["checkpoints"][stage]["resumed"],
            )
            assert resumed["start"] == zr.SAVE_AT
            # AdamW restarted from zero moments would land elsewhere.
            assert torch.equal(resumed["params"], straight["params"]), stage
            assert resumed["state"] == straight["state"]
            assert resumed["numel"] == straight["numel"]
            counts.append(resumed["state"])
        if stage != "zero:2 whole":  # by rows: each file holds its rows of all six tensors
            assert counts == [6] * len(scenes), counts
            numel = [sum(out["checkpoints"][stage]["resumed"]["numel"].values()) for out in scenes]
            assert sum(numel) == sum(p.numel() for p in zr._workload().build_model().parameters())
        else:
            assert sum(counts) == 6 and min(counts) > 0, counts  # each file: its own shard


@pytest.mark.timeout(180)
def test_a_stage_refuses_compression_and_a_model_too_small_to_shard_saying_why(
    scenes: list[dict[str, Any]],
) -> None:
    for out in scenes:
        refused = out["refusals"]
        assert refused["zero:2 fp16"].startswith(
            "zero:2 cannot compress its gradient exchange (compression fp16): it reduce-scatters"
        )
        assert "or zero:1, which exchanges the gradient as bsp does" in refused["zero:2 fp16"]
        for stage in STAGES:  # with whole tensors forced
            message = refused[f"{stage} one tensor"]
            assert message.startswith(f"{stage} gives each rank whole parameter tensors"), message
            assert f"run {stage} on at most 1 rank(s), or use bsp" in message
            # by rows (the default for SGD) every rank steps its rows of the one tensor
            assert refused[f"{stage} one tensor, rows"] == "accepted"
