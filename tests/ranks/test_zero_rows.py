"""``zero:1``'s rows layout (``gradsync.strategies.zero_rows``): its whole state is bsp's,
bitwise, and survives a resume on another number of ranks and a change of layout, whichever
way it is loaded. The trajectory itself (a float64 reference, bitwise against whole tensors)
is in test_zero.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import zero_rows_ranks as zrr

pytestmark = pytest.mark.ranks


def _same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a.keys(), b.keys())
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    root = tmp_path_factory.mktemp("zero-rows")
    saved = run_ranks(zrr.save, 2, str(root), timeout_s=120)
    torch.save(saved[0]["bsp"], root / "whole-state.pt")
    loaded = run_ranks(zrr.load, 3, str(root), timeout_s=120)
    return saved, loaded


@pytest.mark.timeout(240)
def test_the_whole_state_of_rows_is_bsps_bitwise(runs: tuple[list[Any], list[Any]]) -> None:
    """Joined on rank 0, every rank's rows of AdamW's state are bsp's state, and so are whole
    tensors'; the other ranks get None."""
    saved, _ = runs
    assert saved[0]["rows layout"] == "rows" and saved[0]["whole layout"] == "whole"
    for name in ("rows", "whole"):
        _same(saved[0][name], saved[0]["bsp"], name)
        assert saved[1][name] is None


@pytest.mark.timeout(240)
def test_a_resume_on_three_ranks_reshards_either_layout_into_either(
    runs: tuple[list[Any], list[Any]],
) -> None:
    """Written by 2 ranks, loaded by 3: by rows into rows, whole tensors into rows, and both
    into whole tensors, the whole state gathered again is the one saved."""
    saved, loaded = runs
    for key in ("rows -> auto", "rows -> whole", "whole -> auto", "whole -> whole"):
        got = loaded[0][key]
        assert got["layout"] == ("whole" if key.endswith("whole") else "rows"), key
        _same(got["state"], saved[0]["bsp"], key)


@pytest.mark.timeout(240)
def test_a_whole_state_loads_into_rows_through_either_door(
    runs: tuple[list[Any], list[Any]],
) -> None:
    """``sync.load_full_state_dict`` and the script's own ``optimizer.load_state_dict`` (a
    DDP script resuming its rank-0 checkpoint) both cut the whole state into each rank's
    rows."""
    saved, loaded = runs
    _same(loaded[0]["load_full_state_dict"], saved[0]["bsp"], "load_full_state_dict")
    _same(loaded[0]["user load"], saved[0]["bsp"], "optimizer.load_state_dict")


@pytest.mark.timeout(120)
def test_zero2_by_rows_refuses_torchs_clip_over_the_parameters_and_clips_through_the_handle() -> (
    None
):
    """Under zero:2 by rows ``p.grad`` holds nothing at the gradient-ready point (each rank's
    rows are its optimizer tensors' ``.grad``): torch's clip over ``model.parameters()``, which
    would clip nothing, and any read of it are refused, naming ``s.clip_grad_norm_``, which
    takes the whole gradient's norm (the same on both ranks); after the block ``p.grad`` is
    None; both ranks end equal."""
    results = run_ranks(zrr.gradient_ready, 2, timeout_s=90)
    for out in results:
        assert out["layout"] == "rows"
        for key in ("torch clip", "read"):
            assert out[key].startswith("p.grad of a model parameter holds no values here"), out
            assert "s.clip_grad_norm_(max_norm)" in out[key]
        assert out["shape"] == (7, 5)
        assert all(out["grads after 0"]) and all(out["grads after 1"])
    assert results[0]["norm 0"] == results[1]["norm 0"] > 0
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def traps(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(zrr.traps, 2, str(tmp_path_factory.mktemp("rows-traps")), timeout_s=150)


@pytest.mark.timeout(200)
def test_a_checkpoint_of_the_other_layout_resumes_on_as_many_ranks(
    traps: list[dict[str, Any]],
) -> None:
    """Whole tensors' checkpoint (every checkpoint written before the rows layout) resumed by
    rows on as many ranks, and rows resumed as whole tensors: dealt out anew, the whole state
    the one saved."""
    for key, layout in (("whole -> auto", "rows"), ("auto -> whole", "whole")):
        before, after, got = traps[0]["relaid"][key]
        assert got == layout
        _same(after, before, key)


@pytest.mark.timeout(200)
def test_zero2_by_rows_refuses_a_late_backward_and_a_model_converted_after_the_build(
    traps: list[dict[str, Any]],
) -> None:
    for out in traps:
        assert out["late backward"].startswith("step 0: a backward pass ran after"), out
        assert "was given new storage after the Synchronizer was built" in out["converted"]


@pytest.mark.timeout(200)
def test_by_rows_skips_clip_nothing_and_the_optimizer_is_left_as_documented(
    traps: list[dict[str, Any]],
) -> None:
    """A skipped step's clip is 0 (its pieces' NaN gradients released); after close() the
    optimizer holds the parameters, its state this rank's rows of them; a Synchronizer whose
    setup failed leaves the optimizer for the next one;
    the strategy's grad_norm over the parameters is the whole gradient's, by rows as whole."""
    for out in traps:
        assert out["skipped"][0] == 0.0 and out["skipped"][1] > 0, out["skipped"]
        assert out["state after close"] and out["retry"]
        rows, whole = out["grad_norm"]
        assert rows == pytest.approx(whole, rel=1e-12) and rows > 0


@pytest.mark.timeout(200)
def test_a_caught_keyboard_interrupt_mid_step_leaves_the_optimizer_as_between_steps(
    traps: list[dict[str, Any]],
) -> None:
    """zero:2 by rows, a KeyboardInterrupt after the gradient-ready point, caught: the
    optimizer holds the parameters, torch's clip over them runs, the next step trains."""
    for out in traps:
        assert out["interrupted"] == [True, True, True], out["interrupted"]


@pytest.mark.timeout(120)
def test_the_front_doors_loop_dropping_a_gradient_leaves_that_parameter() -> None:
    """...and a loop logging each parameter's gradient norm the documented way under zero:2
    (``p.grad.norm().full_tensor()`` on every rank) gets bsp's, by rows and whole tensors."""
    for out in run_ranks(zrr.front_door, 2, timeout_s=90):
        norms = out.pop("norms")
        assert out == {"zero:2 rows": True, "zero:2 whole": True, "zero:1 rows": True}, out
        assert len(norms["bsp"]) == 5 and min(norms["bsp"]) > 0
        for layout in ("zero:2 rows", "zero:2 whole"):
            assert norms[layout] == pytest.approx(norms["bsp"], rel=1e-12), (layout, norms)
