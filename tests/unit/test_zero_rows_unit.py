"""``zero:1``'s rows layout without ranks: which rows each rank holds, the optimizer state
joined and split, and which optimizers the layout takes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsync.errors import UsageError
from gradsync.row_shards import join, join_saved, rows_of, split
from gradsync.strategies.zero_rows import RowLayout, choose_layout
from gradsync.strategies.zero_shards import plan_rounds

pytestmark = pytest.mark.unit


def test_rows_are_torch_chunks_split_and_cover_every_row_once() -> None:
    for rows in (1, 2, 5, 7, 12):
        for world in (1, 2, 3, 4):
            parts = [rows_of([rows, 3], world, r) for r in range(world)]
            chunks = torch.arange(rows).chunk(world)
            for r, (start, stop) in enumerate(parts):
                expected = chunks[r].tolist() if r < len(chunks) else []
                assert list(range(start, stop)) == expected, (rows, world, r)


def _adamw_state(model: nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 5)).sum().backward()
    opt.step()
    return opt.state_dict()


def test_a_whole_state_split_into_rows_and_joined_is_itself() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2))
    whole = _adamw_state(model)
    shapes = [list(p.shape) for p in model.parameters()]
    for world in (2, 3, 4):
        parts = [split(whole, shapes, world, r) for r in range(world)]
        assert parts[0]["state"][0]["exp_avg"].shape == (-(-7 // world), 5)  # ceil(7 / N) rows
        assert parts[0]["state"][0]["step"] is whole["state"][0]["step"]  # per tensor: whole
        joined = join(parts, shapes)
        for index, entry in whole["state"].items():
            for key, value in entry.items():
                assert torch.equal(joined["state"][index][key], value), (world, index, key)
        assert joined["param_groups"] == whole["param_groups"]


def test_join_saved_reads_the_layout_the_files_record() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2))
    whole = _adamw_state(model)
    shapes = [list(p.shape) for p in model.parameters()]
    rows = [split(whole, shapes, 2, r) for r in range(2)]
    joined = join_saved(rows, [{"layout": "rows", "shapes": shapes}, None])
    assert torch.equal(joined["state"][2]["exp_avg_sq"], whole["state"][2]["exp_avg_sq"])
    # whole tensors (files written before the layout existed record none): each from its owner
    owned = [
        {**whole, "state": {i: e for i, e in whole["state"].items() if i % 2 == r}}
        for r in range(2)
    ]
    joined = join_saved(owned, [{"owners": [0, 1, 0, 1]}, {"owners": [0, 1, 0, 1]}])
    assert sorted(joined["state"]) == [0, 1, 2, 3]


def test_a_piece_missing_on_one_rank_is_refused_naming_the_parameter() -> None:
    model = nn.Linear(3, 4)
    whole = _adamw_state_of(model)
    shapes = [list(p.shape) for p in model.parameters()]
    parts = [split(whole, shapes, 2, r) for r in range(2)]
    del parts[1]["state"][1]
    with pytest.raises(ValueError, match="parameter 1 is held by 1 of 2 ranks"):
        join(parts, shapes)


def _adamw_state_of(model: nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return opt.state_dict()


class _Lamb(torch.optim.AdamW):
    """A subclass may add a rule over the whole tensor (a trust ratio): not element-wise."""


def test_only_element_wise_optimizers_by_exact_class_are_cut_into_rows() -> None:
    model = nn.Linear(3, 4)
    params = list(model.parameters())
    for opt in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW(model.parameters())):
        assert choose_layout("auto", opt, params, 2, "zero:1") == "rows"
        assert choose_layout("auto", opt, params, 1, "zero:1") == "whole"  # nothing to cut for
        assert choose_layout("whole", opt, params, 2, "zero:1") == "whole"
    lamb = _Lamb(model.parameters())
    assert choose_layout("auto", lamb, params, 2, "zero:1") == "whole"
    with pytest.raises(UsageError) as refused:
        choose_layout("rows", lamb, params, 2, "zero:1")
    message = str(refused.value)
    assert "zero:1 cannot shard by rows here: its optimizer, _Lamb, is not one" in message
    assert "AdamW" in message and "layout='whole'" in message


def test_the_layout_auto_picks_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """As bsp says its bucket plan: a tester could not tell which layout "auto" ran."""
    model = nn.Linear(3, 4)
    params = list(model.parameters())
    with caplog.at_level("INFO", logger="gradsync.strategies.zero"):
        choose_layout("auto", torch.optim.AdamW(model.parameters()), params, 2, "zero:2")
        choose_layout("auto", _Lamb(model.parameters()), params, 2, "zero:2")
        choose_layout("whole", torch.optim.AdamW(model.parameters()), params, 2, "zero:2")
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "zero:2: layout auto: rows (each rank steps its rows of every tensor)"
    assert said[1].startswith("zero:2: layout auto: whole tensors, dealt to the ranks by size")
    assert "_Lamb, is not one whose update is element by element" in said[1]
    assert len(said) == 2  # a layout the user named is not said again


def test_each_round_carries_whole_consecutive_tensors_the_same_in_every_chunk() -> None:
    """Rank r's chunk holds its rows of every tensor at the same place as every other rank's
    (a shorter piece leaves a gap, zeroed), so a round's tensors are the same for every
    owner: ready together, as soon as backward has made them."""
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2))
    params = list(model.parameters())
    layout = RowLayout(params, world=3, rank=0)
    (group,) = layout.groups
    # rank 0's pieces, the longest: ceil(2/3) = 1 row of 2, ceil(7/3) = 3 rows of 7
    assert group.chunk == 1 + 1 * 7 + 3 + 3 * 5
    for rnd in plan_rounds(group, per_owner=8):
        tensors = [
            {_tensor_of(layout, group.params[pc.index]) for pc in owner} for owner in rnd.pieces
        ]
        assert all(t <= tensors[0] for t in tensors), tensors
    # rank 2 holds 1 of the 7 rows and none of the 2: gaps where rank 0 holds more
    assert group.gaps[2] and not group.gaps[0]


def _tensor_of(layout: RowLayout, piece: torch.Tensor) -> int:
    """The index of the parameter ``piece`` is a piece of."""
    for j, pieces in enumerate(layout.pieces):
        if any(piece is pc for pc in pieces):
            return j
    raise AssertionError("a piece of no parameter")


def test_a_non_contiguous_parameter_keeps_whole_tensors() -> None:
    """A channels_last convolution's weight is not contiguous: no piece of rows is a view of
    it, so "auto" takes whole tensors and "rows" is refused naming the parameter."""
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    params = list(conv.parameters())
    opt = torch.optim.AdamW(params)
    assert choose_layout("auto", opt, params, 2, "zero:2") == "whole"
    with pytest.raises(UsageError, match=r"shape \(4, 3, 3, 3\) is not contiguous"):
        choose_layout("rows", opt, params, 2, "zero:2")
    names = {id(p): n for n, p in conv.named_parameters()}
    with pytest.raises(UsageError, match=r"parameter 'weight' \(shape \(4, 3, 3, 3\)\) is not"):
        choose_layout("rows", opt, params, 2, "zero:2", names)


@pytest.mark.parametrize("stage", ["ZeroStage1", "ZeroStage2"])
def test_the_synchronizer_names_the_non_contiguous_parameter_it_refuses(
    one_rank: None, stage: str
) -> None:
    import gradsync as gs

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    model[0].to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters())
    strategy = getattr(gs, stage)(layout="rows")
    with pytest.raises(UsageError, match=r"parameter '0\.weight' \(shape \(4, 3, 3, 3\)\)"):
        gs.Synchronizer(model, opt, strategy=strategy)
