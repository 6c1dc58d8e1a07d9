"""Streaming DiLoCo (``diloco:H:F:TAU:ALPHA``): the spec and its checks, the fragments and their
schedule, and on two gloo ranks: plain DiLoCo unchanged, a float64 reference matched, fragments
agreeing after their merges, final models agreeing, compression per fragment, checkpoints."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import gradsync as gs
from gradsync.compression import FlatBucket, parse_compression
from gradsync.errors import UsageError
from gradsync.spec import STRATEGY_FORMS, StrategySpec, parse_strategy_spec
from gradsync.strategies import DiLoCo, parse_strategy
from gradsync.strategies.streaming import layers, offsets, strided_fragments
from gradsync.testing import run_ranks
from tests import streaming_ranks
from tests.streaming_ranks import FRAGMENTS_OF_TWO

WORLD = 2

# -- the spec and the constructor --------------------------------------------------------------


@pytest.mark.unit
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
    ],
)
def test_streaming_specs_parse_with_defaults_and_round_trip(
    text: str, fields: dict[str, Any], canonical: str | None
) -> None:
    parsed = parse_strategy_spec(text)
    period = int(text.split(":")[1])
    assert parsed == StrategySpec(kind="diloco", period=period, **fields)
    assert parse_strategy_spec(str(parsed)) == parsed
    if canonical is not None:
        assert str(parsed) == canonical


@pytest.mark.unit
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
        ("diloco:8:2:1:0:7", "diloco takes at most H:F:TAU:ALPHA, got 5 values"),
        ("diloco:0:2", "H must be an integer >= 1"),
    ],
)
def test_a_bad_streaming_spec_names_the_value_and_the_forms(text: str, says: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_strategy_spec(text)
    message = str(err.value)
    assert says in message and repr(text) in message
    assert message.endswith(f"valid: {STRATEGY_FORMS}")
    assert "diloco:H[:F[:TAU[:ALPHA]]]" in STRATEGY_FORMS


@pytest.mark.unit
def test_the_api_form_is_checked_by_the_same_parser() -> None:
    made = DiLoCo(8, fragments=2, delay=3, alpha=0.25)
    assert (made.spec, made.fragments, made.delay, made.alpha) == ("diloco:8:2:3:0.25", 2, 3, 0.25)
    assert DiLoCo(8, fragments=2).delay == 1  # the spec's default
    assert not DiLoCo(8).streaming and DiLoCo(8).spec == "diloco:8"
    built = parse_strategy("diloco:8:2:1:0.5")
    assert isinstance(built, DiLoCo) and built.spec == "diloco:8:2:1:0.5"
    for kwargs, says in [
        ({"fragments": 9}, "F=9 must be an integer from 1 to H=8"),
        ({"fragments": 2, "delay": 4}, "TAU=4 must be an integer >= 0 below H/F=4"),
        ({"alpha": -0.5}, "ALPHA=-0.5 must be a number from 0 to 1"),
    ]:
        with pytest.raises(UsageError, match=says):
            DiLoCo(8, **kwargs)


# -- fragments and schedule --------------------------------------------------------------------


@pytest.mark.unit
def test_fragments_are_strided_across_layers_and_f_is_bounded_by_them() -> None:
    model = streaming_ranks._workload().build_model()  # Linear, Tanh, Linear, Tanh, Linear
    params = list(model.parameters())
    assert layers(model, params) == [[0, 1], [2, 3], [4, 5]]
    assert strided_fragments(model, params, 2, "diloco:4:2") == list(map(list, FRAGMENTS_OF_TWO))
    assert strided_fragments(model, params, 3, "diloco:6:3") == [[0, 1], [2, 3], [4, 5]]
    assert strided_fragments(model, params, 1, "diloco:4") == [[0, 1, 2, 3, 4, 5]]
    with pytest.raises(UsageError, match="F=4 fragments, but the model has only 3 layers"):
        strided_fragments(model, params, 4, "diloco:8:4")


@pytest.mark.unit
def test_a_model_with_fewer_layers_than_fragments_is_refused_at_setup(one_rank: None) -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(UsageError, match="F=2 fragments, but the model has only 1 layers"):
        gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="diloco:4:2")


@pytest.mark.unit
def test_offsets_are_spread_h_over_f_apart_with_the_last_on_plain_diloco_steps() -> None:
    assert offsets(8, 1) == [0]
    assert offsets(8, 4) == [2, 4, 6, 0]
    assert offsets(8, 3) == [2, 5, 0]
    assert offsets(4, 4) == [1, 2, 3, 0]


# -- int4, the 4-bit pseudo-gradient ----------------------------------------------------------


@pytest.mark.unit
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


# -- two gloo ranks ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs() -> Iterator[list[dict[str, Any]]]:
    yield run_ranks(streaming_ranks.scenarios, WORLD, timeout_s=100)


def _fragment(flat: torch.Tensor, p: int) -> torch.Tensor:
    """Fragment p of F=2 out of flat mlp parameters."""
    model = streaming_ranks._workload().build_model()
    sizes = [t.numel() for t in model.parameters()]
    parts = torch.split(flat, sizes)
    return torch.cat([parts[i] for i in FRAGMENTS_OF_TWO[p]])


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_one_fragment_without_delay_is_plain_diloco_bitwise(runs: list[dict[str, Any]]) -> None:
    for r in range(WORLD):
        plain, one = runs[r]["plain"], runs[r]["one fragment"]
        assert all(torch.equal(a, b) for a, b in zip(plain["after"], one["after"], strict=True))
        assert torch.equal(plain["params"], one["params"])
        assert plain["bytes"] == one["bytes"] and plain["barrier"] == one["barrier"]


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_two_ranks_match_the_float64_reference(runs: list[dict[str, Any]]) -> None:
    # H=4, F=2, TAU=1, ALPHA=0.25 over 12 steps: fragment 1 starts after the last step, so its
    # exchange is still in flight when report() flushes it.
    for name, alpha, delay in (("reference", 0.25, 1), ("alpha 0", 0.0, 1), ("no delay", 0.0, 0)):
        expected = streaming_ranks.reference(
            WORLD, 4, list(map(list, FRAGMENTS_OF_TWO)), delay, alpha, 12
        )
        for r in range(WORLD):
            got = runs[r][name]["params"]
            assert torch.allclose(got, expected[r], rtol=0, atol=1e-10), name
        assert torch.equal(runs[0][name]["params"], runs[1][name]["params"]), name


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_each_fragment_starts_on_its_schedule_and_is_applied_tau_steps_later(
    runs: list[dict[str, Any]],
) -> None:
    model = streaming_ranks._workload().build_model()
    sizes = [sum(list(model.parameters())[i].numel() for i in f) for f in FRAGMENTS_OF_TWO]
    run, plain = runs[0]["alpha 0"], runs[0]["plain"]
    # fragment 0 starts after steps 1, 5, 9 and fragment 1 after 3, 7, 11 (float64 values)
    starts = {1: 0, 5: 0, 9: 0, 3: 1, 7: 1, 11: 1}
    assert run["bytes"] == [8 * sizes[starts[s]] if s in starts else 0 for s in range(12)]
    # ranks wait for each other where an exchange is applied, one step after it started
    assert run["barrier"] == [s - 1 in starts for s in range(12)]
    # the same bytes over a period as plain DiLoCo, but the peak is one fragment's
    assert sum(run["bytes"]) == sum(plain["bytes"])
    assert max(run["bytes"]) == 8 * max(sizes) < max(plain["bytes"])


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_with_alpha_0_a_fragment_agrees_across_ranks_right_after_its_merge(
    runs: list[dict[str, Any]],
) -> None:
    a, b = runs[0]["alpha 0"]["after"], runs[1]["alpha 0"]["after"]
    merged = {2: 0, 6: 0, 10: 0, 4: 1, 8: 1}  # step -> the fragment applied after it
    for step in range(12):
        for p in (0, 1):
            same = torch.equal(_fragment(a[step], p), _fragment(b[step], p))
            # before its first merge a fragment has only seen each rank's own shard
            assert same == (merged.get(step) == p), (step, p)
    # with ALPHA 0.25 the local part keeps each rank's own steps: no agreement until the end
    half = runs[0]["reference"]["after"], runs[1]["reference"]["after"]
    assert not any(torch.equal(x, y) for x, y in zip(*half, strict=True))
    for name in ("reference", "alpha 0", "no delay", "learns", "int8", "topk", "int4"):
        assert torch.equal(runs[0][name]["params"], runs[1][name]["params"]), name


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_loss_falls_with_and_without_compression_per_fragment(
    runs: list[dict[str, Any]],
) -> None:
    for r in range(WORLD):
        for name in ("learns", "int8", "topk", "int4"):
            losses = runs[r][name]["losses"]
            first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
            assert last < 0.7 * first, (name, first, last)


@pytest.mark.ranks
@pytest.mark.timeout(150)
def test_a_checkpoint_with_an_exchange_in_flight_resumes_bitwise(tmp_path: Path) -> None:
    results = run_ranks(
        streaming_ranks.resumed, WORLD, str(tmp_path), "diloco:4:2:1", timeout_s=130
    )
    for r in range(WORLD):
        for spec, out in results[r].items():
            # the save waited for fragment 0's exchange (started after step 5) and holds it
            (pending,) = out["pending"]
            assert (pending["fragment"], pending["due"]) == (0, 6), spec
            assert out["residuals"] == ([0, 1] if spec.startswith("topk") else []), spec
            assert torch.equal(out["continued"], out["straight"]), spec
            assert torch.equal(out["resumed"], out["straight"]), spec
