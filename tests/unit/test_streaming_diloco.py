"""Streaming DiLoCo (``diloco:H:F:TAU:ALPHA[:SPLIT]``): the spec and its checks, the fragments
(rows and layers splits) and their schedule, int4, a checkpoint under another split. On two
gloo ranks: tests/ranks/test_streaming_diloco_ranks.py."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch

import gradsync as gs
from gradsync.compression import FlatBucket, parse_compression
from gradsync.errors import UsageError
from gradsync.flat import copy_into, flatten
from gradsync.spec import STRATEGY_FORMS, StrategySpec, parse_strategy_spec
from gradsync.strategies import DiLoCo, parse_strategy
from gradsync.strategies.streaming import (
    fragment_tensors,
    layers,
    offsets,
    row_blocks,
    row_fragments,
    strided_fragments,
)
from tests.support import streaming_ranks
from tests.support.streaming_ranks import FRAGMENTS_OF_TWO, ROWS_OF_TWO

pytestmark = pytest.mark.unit

# -- the spec and the constructor --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "fields", "canonical"),
    [
        ("diloco:8", {}, "diloco:8"),
        # one fragment, no delay, ALPHA 0 is plain DiLoCo, whatever way it is written
        ("diloco:8:1", {}, "diloco:8"),
        ("diloco:8:1:0:0", {}, "diloco:8"),
        # F > 1 without TAU: one step of overlap by default...
        ("diloco:8:2", {"fragments": 2, "delay": 1, "alpha": 0.0}, "diloco:8:2:1"),
        # ...unless H/F leaves no room for it
        ("diloco:4:4", {"fragments": 4, "delay": 0, "alpha": 0.0}, "diloco:4:4:0"),
        ("DiLoCo: 32 : 4 : 3 : 0.5", {"fragments": 4, "delay": 3, "alpha": 0.5}, None),
        ("diloco:8:1:2", {"fragments": 1, "delay": 2, "alpha": 0.0}, "diloco:8:1:2"),
        # SPLIT, the last field after F when it is not a number; the default (rows) is not
        # written, and with one fragment the split is the whole model either way
        ("diloco:8:3:layers", {"fragments": 3, "delay": 1, "alpha": 0.0, "split": "layers"},
         "diloco:8:3:1:layers"),
        ("diloco:8:3:1:0.5:Layers ",
         {"fragments": 3, "delay": 1, "alpha": 0.5, "split": "layers"}, "diloco:8:3:1:0.5:layers"),
        ("diloco:8:3:1:0:rows", {"fragments": 3, "delay": 1, "alpha": 0.0}, "diloco:8:3:1"),
        ("diloco:8:3:rows", {"fragments": 3, "delay": 1, "alpha": 0.0}, "diloco:8:3:1"),
        ("diloco:8:1:0:0:layers", {}, "diloco:8"),
        ("diloco:8:1:2:layers", {"fragments": 1, "delay": 2, "alpha": 0.0}, "diloco:8:1:2"),
    ],
)  # fmt: skip
def test_streaming_specs_parse_with_defaults_and_round_trip(
    text: str, fields: dict[str, Any], canonical: str | None
) -> None:
    parsed = parse_strategy_spec(text)
    period = int(text.split(":")[1])
    assert parsed == StrategySpec(kind="diloco", period=period, **fields)
    assert parse_strategy_spec(str(parsed)) == parsed
    if canonical is not None:
        assert str(parsed) == canonical


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("diloco:8:0", "F=0 must be an integer from 1 to H=8"),
        ("diloco:8:9", "F=9 must be an integer from 1 to H=8"),
        ("diloco:8:x", "F=x must be an integer from 1 to H=8"),
        ("diloco:8:2:4", "TAU=4 must be an integer >= 0 below H/F=4"),
        ("diloco:8:3:-1", "TAU=-1 must be an integer >= 0 below H/F=2.66667"),
        ("diloco:8:2:1.5", "TAU=1.5 must be an integer >= 0 below H/F=4"),
        ("diloco:8:2:1:1.5", "ALPHA=1.5 must be a number from 0 to 1"),
        ("diloco:8:2:1:nan", "ALPHA=nan must be a number from 0 to 1"),
        ("diloco:8:2:1:0:7", "SPLIT=7 must be rows or layers"),  # the fifth field is SPLIT
        ("diloco:0:2", "H must be an integer >= 1"),
        ("diloco:8:2:1:0:row", "SPLIT=row must be rows or layers"),
        ("diloco:8:2:strided", "SPLIT=strided must be rows or layers"),
        ("diloco:8:2:1:0:layers:7", "SPLIT=7 must be rows or layers"),
        ("diloco:8:2:1:0:1:layers", "diloco takes at most H:F:TAU:ALPHA:SPLIT, got 6 values"),
        ("diloco:8:layers", "F=layers must be an integer from 1 to H=8"),  # F comes first
    ],
)
def test_a_bad_streaming_spec_names_the_value_and_the_forms(text: str, says: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_strategy_spec(text)
    message = str(err.value)
    assert says in message and repr(text) in message
    assert message.endswith(f"valid: {STRATEGY_FORMS}")
    assert "diloco:H[:F[:TAU[:ALPHA]|:eager][:SPLIT]]" in STRATEGY_FORMS
    assert "SPLIT rows or layers" in STRATEGY_FORMS


def test_the_api_form_is_checked_by_the_same_parser() -> None:
    made = DiLoCo(8, fragments=2, delay=3, alpha=0.25)
    assert (made.spec, made.fragments, made.delay, made.alpha) == ("diloco:8:2:3:0.25", 2, 3, 0.25)
    assert DiLoCo(8, fragments=2).delay == 1  # the spec's default
    assert not DiLoCo(8).streaming and DiLoCo(8).spec == "diloco:8"
    assert DiLoCo(8, fragments=2).split == "rows"  # the default split
    layered = DiLoCo(8, fragments=2, split="layers")
    assert (layered.spec, layered.split) == ("diloco:8:2:1:layers", "layers")
    assert DiLoCo(8, split="layers").spec == "diloco:8"  # one fragment: no split to speak of
    built = parse_strategy("diloco:8:2:1:0.5")
    assert isinstance(built, DiLoCo) and built.spec == "diloco:8:2:1:0.5"
    built = parse_strategy("diloco:8:2:1:0.5:layers")
    assert isinstance(built, DiLoCo) and (built.split, built.alpha) == ("layers", 0.5)
    for kwargs, says in [
        ({"fragments": 9}, "F=9 must be an integer from 1 to H=8"),
        ({"fragments": 2, "delay": 4}, "TAU=4 must be an integer >= 0 below H/F=4"),
        ({"alpha": -0.5}, "ALPHA=-0.5 must be a number from 0 to 1"),
        ({"fragments": 2, "split": "strided"}, "SPLIT=strided must be rows or layers"),
        ({"split": "strided"}, "SPLIT=strided must be rows or layers"),
        ({"fragments": 2, "split": 3}, "split must be one of rows, layers, got 3"),
        ({"fragments": 2, "split": ""}, "split must be one of rows, layers, got ''"),
    ]:
        with pytest.raises(UsageError, match=says):
            DiLoCo(8, **kwargs)


@pytest.mark.parametrize(
    ("text", "fields", "canonical"),
    [
        ("diloco:8:eager", {"fragments": 1}, "diloco:8:1:eager"),
        ("diloco:8:2:eager", {"fragments": 2}, "diloco:8:2:eager"),
        # before or after SPLIT, and the outer options after it
        ("diloco:8:2:layers:eager", {"fragments": 2, "split": "layers"}, "diloco:8:2:eager:layers"),
        ("diloco:8:2:eager:outer_lr=1", {"fragments": 2, "outer_lr": 1.0},
         "diloco:8:2:eager:outer_lr=1.0"),
    ],
)  # fmt: skip
def test_eager_specs_parse_and_round_trip(
    text: str, fields: dict[str, Any], canonical: str
) -> None:
    parsed = parse_strategy_spec(text)
    assert parsed == StrategySpec(kind="diloco", period=8, eager=True, **fields)
    assert str(parsed) == canonical and parse_strategy_spec(canonical) == parsed
    built = parse_strategy(text)
    assert isinstance(built, DiLoCo) and built.eager and built.spec == canonical


def test_eager_is_refused_with_tau_alpha_twice_and_under_live_membership() -> None:
    for text, says in [
        ("diloco:8:2:1:eager", "eager takes no TAU or ALPHA (got 1)"),
        ("diloco:8:2:eager:0.5", "eager takes no TAU or ALPHA (got 0.5)"),
        ("diloco:8:eager:eager", "eager is given twice"),
        ("diloco:8:9:eager", "F=9 must be an integer from 1 to H=8"),
    ]:
        with pytest.raises(UsageError, match=re.escape(says)):
            parse_strategy_spec(text)
    with pytest.raises(UsageError, match="eager=True takes no delay or alpha"):
        DiLoCo(8, fragments=2, delay=1, eager=True)
    with pytest.raises(UsageError, match="eager must be True or False, got 1"):
        DiLoCo(8, eager=1)  # type: ignore[arg-type]
    from gradsync.membership import check_exchange

    with pytest.raises(UsageError, match="an eager outer step stands in for the peers"):
        check_exchange("diloco:8:2:eager", "none", "ring", None, None)


@pytest.mark.parametrize(
    ("text", "fields", "canonical"),
    [
        ("diloco:8:2:1:keep", {"fragments": 2, "delay": 1}, "diloco:8:2:1:keep"),
        ("diloco:8:1:3:KEEP", {"fragments": 1, "delay": 3}, "diloco:8:1:3:keep"),
        # SPLIT and the outer options after it
        ("diloco:8:2:2:keep:layers:outer_momentum=0.5",
         {"fragments": 2, "delay": 2, "split": "layers", "outer_momentum": 0.5},
         "diloco:8:2:2:keep:layers:outer_momentum=0.5"),
    ],
)  # fmt: skip
def test_keep_specs_parse_and_round_trip(text: str, fields: dict[str, Any], canonical: str) -> None:
    parsed = parse_strategy_spec(text)
    assert parsed == StrategySpec(kind="diloco", period=8, alpha=0.0, keep=True, **fields)
    assert str(parsed) == canonical and parse_strategy_spec(canonical) == parsed
    built = parse_strategy(text)
    assert isinstance(built, DiLoCo) and built.keep_local and built.spec == canonical
    made = DiLoCo(8, fragments=2, delay=1, keep_local=True)
    assert (made.spec, made.keep_local, made.alpha) == ("diloco:8:2:1:keep", True, 0.0)
    assert not DiLoCo(8, fragments=2, delay=1).keep_local


def test_keep_is_refused_without_a_delay_out_of_place_and_with_alpha_or_eager() -> None:
    for text, says in [
        ("diloco:8:2:0:keep", "keep needs TAU >= 1"),
        ("diloco:8:keep", "keep takes ALPHA's place, after TAU, once"),
        ("diloco:8:2:keep", "keep takes ALPHA's place, after TAU, once"),
        ("diloco:8:2:1:keep:keep", "keep takes ALPHA's place, after TAU, once"),
        ("diloco:8:2:1:keep:eager", "eager and keep are two ways of applying an exchange"),
        # the spec as written, eager included
        ("diloco:8:2:eager:keep", "(got 8:2:eager:keep)"),
        ("diloco:keep", "H must be an integer >= 1"),
    ]:
        with pytest.raises(UsageError, match=re.escape(says)):
            parse_strategy_spec(text)
    assert "ALPHA in [0, 1] or keep (TAU >= 1)" in STRATEGY_FORMS
    for kwargs, says in [
        ({"fragments": 2, "delay": 1, "alpha": 0.5}, "keep_local=True takes no alpha (got 0.5)"),
        ({"fragments": 2, "eager": True}, "keep_local=True takes no eager=True"),
        ({"fragments": 2, "delay": 0}, "keep_local=True needs delay >= 1 (got delay=0)"),
        ({}, "(no delay given, and the default for 1 fragment(s) is 0)"),
    ]:
        with pytest.raises(UsageError, match=re.escape(says)):
            DiLoCo(8, keep_local=True, **kwargs)
    assert DiLoCo(8, fragments=2, keep_local=True).spec == "diloco:8:2:1:keep"  # TAU's default
    with pytest.raises(UsageError, match="keep_local must be True or False, got 1"):
        DiLoCo(8, keep_local=1)  # type: ignore[arg-type]


# -- fragments and schedule --------------------------------------------------------------------


def test_fragments_are_strided_across_layers_and_f_is_bounded_by_them() -> None:
    model = streaming_ranks._workload().build_model()  # Linear, Tanh, Linear, Tanh, Linear
    params = list(model.parameters())
    assert layers(model, params) == [[0, 1], [2, 3], [4, 5]]
    assert strided_fragments(model, params, 2, "diloco:4:2") == list(map(list, FRAGMENTS_OF_TWO))
    assert strided_fragments(model, params, 3, "diloco:6:3") == [[0, 1], [2, 3], [4, 5]]
    assert strided_fragments(model, params, 1, "diloco:4") == [[0, 1, 2, 3, 4, 5]]
    with pytest.raises(UsageError, match="F=4 fragments, but the model has only 3 layers"):
        strided_fragments(model, params, 4, "diloco:8:4")
    # the same grouping under its name, as the tensors themselves
    got = fragment_tensors(model, params, 2, "layers", "diloco:4:2:1:layers")
    want = [[id(params[i]) for i in f] for f in FRAGMENTS_OF_TWO]
    assert [[id(t) for t in f] for f in got] == want


def test_a_model_with_fewer_layers_than_fragments_is_refused_at_setup(one_rank: None) -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(UsageError, match="F=2 fragments, but the model has only 1 layers"):
        gs.Synchronizer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="diloco:4:2:layers"
        )
    # The rows split cuts its 2-row weight and bias in two, but not in three (1-row tensors and
    # tensors with fewer rows than F go whole): two tensors fill two fragments of three.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gs.Synchronizer(model, opt, strategy="diloco:4:2").close()
    says = "F=3 fragments, but the model's trainable tensors fill only 2"
    with pytest.raises(UsageError, match=says):
        gs.Synchronizer(model, opt, strategy="diloco:6:3")


# -- the rows split ----------------------------------------------------------------------------


def test_row_blocks_on_plain_sizes_worked_out_by_hand() -> None:
    """The rule on (rows, bytes) alone, F 3. 10 rows of 8 bytes: 4, 3, 3 (all empty, the extra
    row to fragment 0): 32, 24, 24 bytes. 2 rows (24 bytes), fewer than F: whole to the
    lightest, 1 before 2 (a tie): 32, 48, 24. 4 rows of 4 bytes: 1, 1, 2 (the extra row to the
    lightest, 2): 36, 52, 32. 0 rows: whole to the lightest, 2. The same rule, torch-free, is
    the simulator's (``gradsync.fragments``), under the runtime's public names."""
    from gradsync import fragments

    assert row_blocks([(10, 80), (2, 24), (4, 16), (0, 0)], 3) == [
        [(0, 0, 4), (2, 0, 1)],
        [(0, 4, 7), (1, 0, 2), (2, 1, 2)],
        [(0, 7, 10), (2, 2, 4), (3, 0, 0)],
    ]
    assert row_blocks is fragments.row_blocks and layers is fragments.layers


def test_the_rows_split_of_the_mlp_is_the_blocks_worked_out_by_hand() -> None:
    model = streaming_ranks._workload().build_model()
    params = list(model.parameters())
    sizes = [(p.shape[0], p.numel() * p.element_size()) for p in params]
    assert row_blocks(sizes, 2) == list(map(list, ROWS_OF_TWO))
    got = row_fragments(params, 2, "diloco:4:2")
    for tensors, blocks in zip(got, ROWS_OF_TWO, strict=True):
        for t, (i, a, b) in zip(tensors, blocks, strict=True):
            # a view of the parameter's own rows a..b, not a copy
            assert t.data_ptr() == params[i][a:b].data_ptr() and t.shape == params[i][a:b].shape
    # one fragment is the parameters themselves: plain DiLoCo's flat layout
    assert [id(t) for t in row_fragments(params, 1, "diloco:4")[0]] == [id(p) for p in params]


class _Odd(torch.nn.Module):
    """Tensors the rows split must take whole: a scalar, a one-row matrix, a non-contiguous
    matrix (a transposed tensor kept as the parameter), and one with fewer rows than F; and
    a frozen one that is no fragment's."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.big = torch.nn.Linear(40, 301)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.row = torch.nn.Parameter(torch.randn(1, 50, generator=g))
        self.strided = torch.nn.Parameter(torch.randn(30, 20, generator=g).t())
        self.few = torch.nn.Parameter(torch.randn(2, 7, generator=g))
        self.frozen = torch.nn.Parameter(torch.randn(9, 9, generator=g), requires_grad=False)


def _models() -> list[torch.nn.Module]:
    from gradsync.workloads.charlm import TinyGPT

    mlp = torch.nn.Sequential(  # the mlp workload's shape: one layer is most of the bytes
        torch.nn.Linear(64, 300), torch.nn.Tanh(), torch.nn.Linear(300, 300),
        torch.nn.Tanh(), torch.nn.Linear(300, 16),
    )  # fmt: skip
    return [mlp, TinyGPT(vocab=50, context=16, dim=32, layers=2, heads=4), _Odd()]


@pytest.mark.parametrize("model", _models(), ids=["mlp", "charlm", "odd"])
@pytest.mark.parametrize("fragments", [2, 3, 4, 7])
def test_rows_fragments_hold_1_over_f_of_the_bytes_and_every_element_once(
    model: torch.nn.Module, fragments: int
) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    got = row_fragments(params, fragments, f"diloco:64:{fragments}")
    # Within one increment of 1/F: the largest row of a tensor that was cut, or the largest
    # tensor that went whole (fewer rows than F, a scalar, a non-contiguous one).
    step = max(
        p.numel() * p.element_size() // (p.shape[0] if p.shape[0] >= fragments else 1)
        if p.dim() and p.is_contiguous() else p.numel() * p.element_size()
        for p in params
    )  # fmt: skip
    total = sum(p.numel() * p.element_size() for p in params)
    for tensors in got:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        assert abs(nbytes - total / fragments) <= step, (nbytes, total / fragments, step)
    # Every element in exactly one fragment: number the elements, read them back through the
    # fragments' tensors (views), and find each number once.
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(torch.arange(offset, offset + p.numel(), dtype=p.dtype).view_as(p))
            offset += p.numel()
    seen = torch.cat([flatten(tensors) for tensors in got])
    assert torch.equal(seen.sort().values, torch.arange(offset, dtype=seen.dtype))
    # and writing through them writes the parameters: a fragment's copy_into lands in place
    with torch.no_grad():
        for p, tensors in enumerate(got):
            copy_into(torch.full((sum(t.numel() for t in tensors),), float(p)), tensors)
    owner = torch.cat([p.detach().reshape(-1) for p in params])
    assert torch.bincount(owner.long(), minlength=fragments).tolist() == [
        sum(t.numel() for t in tensors) for tensors in got
    ]


def test_tensors_the_rows_split_cannot_cut_go_whole_to_the_lightest_fragment() -> None:
    model = _Odd()
    params = [p for p in model.parameters() if p.requires_grad]
    assert not model.strided.is_contiguous()
    got = row_fragments(params, 3, "diloco:6:3")
    # Parameter order: the module's own (scale, row, strided, few), then the Linear's. Whole,
    # each to the lightest fragment so far: scale (1 value) to 0, row (50) to 1, strided (600)
    # to 2, few (14) to 0 (1 < 50 < 600). The weight's 301 rows: 100 each and the extra row to
    # the lightest, 0 (15 values); then the bias's extra row to the lightest, 1 (4050 values,
    # against 4055 and 4600).
    held = [{id(t) for t in tensors} for tensors in got]
    for tensor, fragment in ((model.scale, 0), (model.row, 1), (model.strided, 2), (model.few, 0)):
        assert [id(tensor) in h for h in held] == [p == fragment for p in range(3)]
    weight_rows = [t.shape[0] for f in got for t in f if t.dim() == 2 and t.shape[1] == 40]
    bias_rows = [t.shape[0] for f in got for t in f if t.dim() == 1]
    assert (weight_rows, bias_rows) == ([101, 100, 100], [100, 101, 100])
    assert [sum(t.numel() for t in f) for f in got] == [
        1 + 14 + 101 * 40 + 100,
        50 + 100 * 40 + 101,
        600 + 100 * 40 + 100,
    ]


def test_offsets_are_spread_h_over_f_apart_with_the_last_on_plain_diloco_steps() -> None:
    assert offsets(8, 1) == [0]
    assert offsets(8, 4) == [2, 4, 6, 0]
    assert offsets(8, 3) == [2, 5, 0]
    assert offsets(4, 4) == [1, 2, 3, 0]


# -- int4, the 4-bit pseudo-gradient ----------------------------------------------------------


def test_int4_sends_half_a_byte_per_value_and_feeds_its_rounding_back(one_rank: None) -> None:
    compressor = parse_compression("int4")
    assert compressor.spec == "int4" and compressor.feedback
    state = compressor.make_state(None)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 5, 1000)
    first = compressor.hook(state, FlatBucket(x.clone())).wait()
    assert state.bytes_sent == 1000 // 2 + 4 * 8  # 4 bits a value, one fp32 scale per 128
    # rounded to nearest: within half a step (max|x| / 7 over the value's chunk of 128)
    step = torch.cat([c.abs().max().expand(c.numel()) for c in x.split(128)]) / 7
    assert torch.all((first - x).abs() <= step / 2 * (1 + 1e-6))
    assert len(torch.unique(first[:128])) <= 15
    # what was rounded away is sent with the next exchange of the same bucket: nothing is lost
    second = compressor.hook(state, FlatBucket(x.clone())).wait()
    torch.testing.assert_close(first + second + state.residuals[0], 2 * x, rtol=0, atol=1e-5)


def test_a_checkpoint_is_refused_under_another_split(one_rank: None) -> None:
    def sync(strategy: str) -> gs.Synchronizer:
        model = streaming_ranks._workload().build_model()
        return gs.Synchronizer(model, streaming_ranks._optimizer(model), strategy=strategy)

    made = [sync(s) for s in ("diloco:4:2:1:layers", "diloco:4:2:1", "diloco:4:1:1")]
    by_layers, by_rows, one = made
    try:
        state = by_layers.state_dict()
        assert state["strategy"]["streaming"]["split"] == "layers"
        assert by_rows.state_dict()["strategy"]["streaming"]["split"] == "rows"
        says = (
            "saved by diloco with its fragments split by layers; this run is diloco:4:2:1, split "
            "by rows"
        )
        with pytest.raises(UsageError, match=says):
            by_rows.load_state_dict(state)
        with pytest.raises(UsageError, match="split by rows; this run is diloco:4:2:1:layers"):
            by_layers.load_state_dict(by_rows.state_dict())
        # written before the split was recorded: by the layers split, the only one there was
        del state["strategy"]["streaming"]["split"]
        with pytest.raises(UsageError, match=says):
            by_rows.load_state_dict(state)
        by_layers.load_state_dict(state)
        # one fragment is one flat layout whatever the split that wrote it
        alone = one.state_dict()
        alone["strategy"]["streaming"]["split"] = "layers"
        one.load_state_dict(alone)
    finally:
        for s in made:
            s.close()


def test_gradsync_run_refuses_more_fragments_than_the_workload_has_before_starting() -> None:
    """The workers' own refusal, made before any worker starts (it was made on every rank)."""
    from gradsync.runner.config import RunConfig

    with pytest.raises(UsageError, match="F=4 fragments, but the model has only 3 layers"):
        RunConfig(workload="mlp", strategy="diloco:8:4:layers", out="run")
    RunConfig(workload="mlp", strategy="diloco:8:3:layers", out="run")  # 3 layers: fits
    RunConfig(workload="mlp", strategy="diloco:8:4", out="run")  # rows: cuts its matrices


def test_a_state_whose_exchange_lacks_sent_is_refused_by_keep_before_anything_loads(
    one_rank: None,
) -> None:
    """The Python API's load_state_dict across keep and ALPHA 0 (sync.load refuses the other
    spec before): a keep DiLoCo cannot merge an exchange saved without the values it was sent
    from, and refuses it leaving itself as it was; the reverse drops them."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))

    def trained(keep: bool, steps: int) -> gs.Synchronizer:
        torch.manual_seed(0)
        net = copy.deepcopy(model)
        sync = gs.Synchronizer(
            net,
            torch.optim.SGD(net.parameters(), lr=0.1),
            DiLoCo(6, fragments=2, delay=1, keep_local=keep),
        )
        for _ in range(steps):
            with sync.step():
                net(torch.randn(8, 4)).square().mean().backward()
        return sync

    plain = trained(False, 3).strategy.state_dict()  # fragment 0 in flight (started after 2)
    assert [("sent" in ex) for ex in plain["streaming"]["pending"]] == [False]
    kept = trained(True, 5)
    before = kept.strategy.state_dict()
    with pytest.raises(UsageError, match="was saved without keep; load it into a DiLoCo without"):
        kept.strategy.load_state_dict(plain)
    after = kept.strategy.state_dict()
    assert torch.equal(after["global"], before["global"])
    assert after["outer_optimizer"]["state"].keys() == before["outer_optimizer"]["state"].keys()
    # keep's state into a DiLoCo without it: its exchange is merged as ALPHA 0 merges
    saved = trained(True, 3).strategy.state_dict()
    into = trained(False, 1).strategy
    into.load_state_dict(saved)
    assert [ex.sent for ex in into._pending] == [None]


def test_a_diloco_state_with_eager_rounds_loads_only_into_an_eager_diloco() -> None:
    """The Python API's load_state_dict across eager and TAU (sync.load refuses the other spec
    before): an eager run's replicas hold their own global copies, which TAU would never
    reconcile, and the reverse found no rounds to load."""
    from gradsync.strategies.local_sgd import _check_saved_eager

    _check_saved_eager({"eager": [None]}, True, "diloco:4:1:eager")
    _check_saved_eager({}, False, "diloco:4")
    with pytest.raises(
        UsageError, match="saved with eager outer updates; load it into a DiLoCo with"
    ):
        _check_saved_eager({"eager": [None]}, False, "diloco:4")
    with pytest.raises(
        UsageError, match="saved without eager updates; load it into a DiLoCo without"
    ):
        _check_saved_eager({}, True, "diloco:4:1:eager")
