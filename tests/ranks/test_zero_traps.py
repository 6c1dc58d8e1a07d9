"""The ZeRO traps of a ported DDP script (issue 42), on 2 gloo ranks: an evaluation on rank 0
under ``zero:3`` works inside ``sync.unsharded()`` and is reported (naming it) without it,
``model.state_dict()`` on rank 0 after an evaluation leaves the ranks in step, torch's
``clip_grad_norm_`` on sharded gradients is refused or global, and a rank-0 checkpoint of a
sharded optimizer is either whole (``sync.full_state_dict()``) or refused.

Three spawns (``zero_traps.everything``), started at once (tests/support/overlap.py), run every
case but one: the two that wait out a timeout (``zero_traps.WAITING``) each in a spawn of its
own, every other case in the third; each test reads its part."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from gradsync import compat
from gradsync.testing import run_ranks
from tests.support import rank_device
from tests.support import zero_traps as zt
from tests.support.overlap import overlapped, ranks

pytestmark = [
    pytest.mark.ranks,
    pytest.mark.skipif(compat.fsdp2() is None, reason="this torch has no FSDP2"),
    rank_device.not_on_device("zero:3 refuses a GPU model over gloo (FSDP2's collectives)"),
]

WORLD = 2


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    """Each rank's results of every case of ``zt.everything``. The two cases that wait out a
    timeout (seconds of it: the gate's, the front door's) run in spawns of their own, beside
    the one of the others, so that their waits overlap: each spawn has its own store, process
    group and ranks, and each case a group of its own as before."""
    rest = tuple(name for name in zt.CASES if name not in zt.WAITING)
    launches = {
        name: ranks(zt.everything, WORLD, names, timeout_s=150, collective_timeout_s=60)
        for name, names in [("rest", rest), *((name, (name,)) for name in zt.WAITING)]
    }
    with overlapped(launches) as done:
        parts = [done.result(name) for name in launches]
    by_rank = zip(*parts, strict=True)
    return [{k: v for part in rank_parts for k, v in part.items()} for rank_parts in by_rank]


@functools.cache
def _reference(steps: int, clip: bool = False) -> dict[str, Any]:
    return zt.reference(WORLD, steps, clip)


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.detach().reshape(-1) for v in state.values()])


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= 1e-10 * max(scale, 1.0), f"{what}: max abs error {err:.3e} (scale {scale:.3e})"


def _assert_same_state(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    """A model's and an optimizer's state dicts, as one process holds them."""
    assert list(actual["model"]) == list(expected["model"]), what
    for k, v in expected["model"].items():
        got = actual["model"][k]
        assert type(got) is torch.Tensor, f"{what}: {k} is a {type(got).__name__}"
        _assert_close(got, v, f"{what} model {k}")
    opt, ref = actual["optimizer"], expected["optimizer"]
    assert opt["param_groups"] == ref["param_groups"], what
    assert sorted(opt["state"]) == sorted(ref["state"]), what
    for i, entry in ref["state"].items():
        assert sorted(opt["state"][i]) == sorted(entry), (what, i)
        for key, value in entry.items():
            _assert_close(opt["state"][i][key].to(value.dtype), value, f"{what} state {i} {key}")


# -- trap 1 -------------------------------------------------------------------------------------


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["evaluation", "evaluation units only"])
def test_rank_0_evaluates_alone_inside_sync_unsharded(
    runs: list[dict[str, Any]], case: str
) -> None:
    """Also where the root holds no parameter (``units only``): rank 0's evaluation forwards
    were in FSDP2's forward record, and its next backward prefetched an all-gather that rank 1
    never posted (a hang, then the step's timeout)."""
    r0, r1 = (out[case] for out in runs)
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    expected = _reference(2 * zt.STEPS)
    assert r0["losses"] == [pytest.approx(expected["evaluated"], rel=1e-9)] * 3
    assert r1["losses"] == []
    assert str(r0["after_state_dict"]).startswith("UsageError"), r0["after_state_dict"]
    assert "after model.state_dict()" in r0["after_state_dict"], r0["after_state_dict"]
    for r, out in enumerate((r0, r1)):  # the evaluation changed nothing
        _assert_close(out["params"], _flat(expected["model"]), f"rank {r} after evaluation")


@pytest.mark.timeout(120)
def test_a_state_dict_on_rank_0_after_an_evaluation_leaves_the_ranks_in_step() -> None:
    r0, r1 = run_ranks(zt.state_dict_alone, WORLD, timeout_s=90, collective_timeout_s=30)
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    expected = _reference(2 * zt.STEPS)
    assert r0["evaluated"] == pytest.approx(expected["evaluated"], rel=1e-9)
    for r, out in enumerate((r0, r1)):
        _assert_close(out["params"], _flat(expected["model"]), f"rank {r}")


@pytest.mark.timeout(200)
def test_a_forward_on_rank_0_alone_fails_every_rank_naming_sync_unsharded(
    runs: list[dict[str, Any]],
) -> None:
    r0, r1 = (out["forward alone"] for out in runs)
    for r, out in enumerate((r0, r1)):
        assert out["error"] is not None, r
        assert out["error"].startswith("SyncTimeoutError"), out["error"]
        assert "sync.unsharded()" in out["error"], out["error"]
    assert "never arrived: ranks [1]" in r0["error"], r0["error"]
    assert "never arrived: ranks [0]" in r1["error"], r1["error"]


@pytest.mark.timeout(200)
def test_the_front_doors_no_sync_forward_never_pairs_with_an_evaluation_on_rank_0(
    runs: list[dict[str, Any]],
) -> None:
    """Rank 0 evaluates the raw module alone while rank 1's next step starts with a
    ``no_sync()`` micro-batch and a buffer broadcast: each fails within seconds, naming
    ``sync.unsharded()`` and where the other is, not after ``between_steps_timeout_s`` (60 s)."""
    r0, r1 = (out["front door forward alone"] for out in runs)
    for r, out in enumerate((r0, r1)):
        assert out["error"] is not None, r
        assert out["error"].startswith("SyncTimeoutError"), out["error"]
        assert "sync.unsharded()" in out["error"], out["error"]
        assert out["seconds"] < 30, out
    # where rank 1 is, worded for either of the front door's gated training forwards (the
    # step's first, with its buffer broadcast, or a no_sync() micro-batch's), and the hint in
    # the front door's own terms on both ranks
    where = "Rank 1 is waiting to begin a training forward of the zero:3 model through "
    assert where + "gs.DistributedDataParallel" in r0["error"], r0["error"]
    for out in (r0, r1):
        assert "`with model.sync.unsharded():` on every rank" in out["error"], out["error"]
    assert "never arrived: ranks [1]" in r0["error"], r0["error"]
    assert "never arrived: ranks [0]" in r1["error"], r1["error"]


def test_the_front_doors_accumulation_after_an_unsharded_evaluation_goes_on(
    runs: list[dict[str, Any]],
) -> None:
    """docs/porting.md's rank-0 evaluation inside ``model.sync.unsharded()``, between steps of
    two micro-batches (the first under ``no_sync()``): every step ends on both ranks (the next
    step's ``no_sync()`` backward hung), and rank 0's whole model is the one rank 1 holds."""
    r0, r1 = (out["front door unsharded between accumulations"] for out in runs)
    for out in (r0, r1):
        assert out["error"] is None and out["steps"] == 3, out
    assert r0["full"] is not None and r0["full"].keys()
    for key, value in r0["full"].items():
        assert torch.isfinite(value).all(), key


# -- trap 3 -------------------------------------------------------------------------------------


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "case", ["zero:2 model", "zero:2 optimizer", "zero:3 model", "zero:3 optimizer"]
)
def test_torch_clip_grad_norm_on_shards_is_refused_or_global(
    runs: list[dict[str, Any]], case: str
) -> None:
    """Refused (naming s.clip_grad_norm_) on every rank, or the whole gradient's clip."""
    outs = [out[f"clip {case}"] for out in runs]
    errors = [out["error"] for out in outs]
    if errors[0] is not None or errors[1] is not None:
        for error in errors:
            assert error is not None and error.startswith("UsageError"), errors
            assert "s.clip_grad_norm_" in error, error
    else:
        expected = _flat(_reference(zt.STEPS, clip=True)["model"])
        for r, out in enumerate(outs):
            _assert_close(out["params"], expected, f"{case}, rank {r}")
    assert [out["handle_after"] for out in outs] == [True, True]


# -- trap 4 -------------------------------------------------------------------------------------


@pytest.mark.timeout(200)
@pytest.mark.parametrize("spec", ["zero:1", "zero:2", "zero:3"])
def test_a_rank_0_checkpoint_is_whole_or_refused(runs: list[dict[str, Any]], spec: str) -> None:
    r0, r1 = (out[f"checkpoint {spec}"] for out in runs)
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    for out in (r0, r1):  # this rank's shard of the optimizer state is not passed off as whole
        assert out["partial"] is not None and out["partial"].startswith("UsageError"), out
        assert "sync.full_state_dict()" in out["partial"], out["partial"]
    assert r1["full_on_others"] is True
    _assert_same_state(r0["full"], _reference(zt.STEPS), f"{spec} full_state_dict")
    # DDP's resume: a plain model and optimizer load rank 0's checkpoint and go on
    expected = _reference(2 * zt.STEPS)
    ddp = zt.continue_ddp_style(r0["full"], WORLD, range(zt.STEPS, 2 * zt.STEPS))
    _assert_same_state(ddp, expected, f"{spec} loaded DDP-style")
    # gradsync's resume from the same checkpoint
    _assert_same_state(r0["resumed"], expected, f"{spec} resumed by load_full_state_dict")
