"""``sparseloco``: chunk top-k + 2-bit values with a decaying error-feedback accumulator that is
the outer momentum, under ``local:H`` and ``diloco:H`` (streaming fragments too).

Here: the codec (exact k per chunk, the torch.topk set, two levels per chunk, bytes), the
accumulator's bookkeeping through the hook on one rank, the spec and where it is refused. Two
gloo ranks training the mlp: tests/ranks/test_sparseloco_ranks.py."""

from __future__ import annotations

import math

import pytest
import torch

import gradsync as gs
from gradsync.compression import FlatBucket, error_feedback, parse_compression
from gradsync.compression._wire import from_payload, to_payload
from gradsync.compression.sparseloco import (
    SparseLoCoCodec,
    _select,
    _torch_select,
    chunk_top_k,
    index_bits,
    kept,
    levels,
    pack_uint,
    sparseloco,
    unpack_uint,
)
from gradsync.errors import UsageError
from gradsync.runner.config import RunConfig
from gradsync.spec import COMPRESSION_FORMS, parse_compression_spec
from gradsync.strategies.factory import check_compressor, parse_strategy

pytestmark = pytest.mark.unit


def gradient(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Both signs, magnitudes spread over decades (as pseudo-gradients are)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    return (x * torch.rand(n, generator=gen, dtype=torch.float64).mul_(-6).exp_()).to(dtype)


def chunks(n: int, chunk: int) -> list[slice]:
    return [slice(start, min(n, start + chunk)) for start in range(0, n, chunk)]


# -- the codec ---------------------------------------------------------------------------------

#: (elements, density, chunk): whole chunks with a ragged tail, the sampled selection (chunks
#: of 1024+), torch.topk's (small chunks, dense fractions), one short chunk only
CASES = [
    (50_000, 0.02, 4096),
    (20_000, 0.03, 1024),
    (3_000, 0.1, 64),
    (10_000, 0.5, 1000),
    (4_092, 0.02, 4096),
    (7, 0.02, 4096),
]


@pytest.mark.parametrize(("n", "density", "chunk"), CASES)
def test_round_trip_keeps_exactly_the_top_k_of_every_chunk(
    n: int, density: float, chunk: int
) -> None:
    x = gradient(n, seed=n)
    encoder = SparseLoCoCodec(n, density, chunk, torch.float32)
    pieces = encoder.encode(x.clone(), 0)
    assert [(p.dtype, p.numel()) for p in pieces] == list(encoder.layout)
    # Decoded from the bytes by a codec built separately, as the other ranks do.
    decoder = SparseLoCoCodec(n, density, chunk, torch.float32)
    out = decoder.decode(from_payload(to_payload(pieces), decoder.layout), 0)
    assert out.shape == (n,) and out.dtype == torch.float32
    for part in chunks(n, chunk):
        xs, got = x[part], out[part]
        k = kept(density, xs.numel())
        sent = got.nonzero().squeeze(1)
        assert sent.numel() == k  # exactly k per chunk (no exact zeros in this input)
        assert torch.equal(sent, xs.abs().topk(k).indices.sort().values)
        assert torch.equal(got[sent].sign(), xs[sent].sign())
    # On the wire a chunk's records come in ascending position order.
    records = unpack_uint(pieces[1], index_bits(chunk) + 2, encoder.total)
    columns = records & (2 ** index_bits(chunk) - 1)
    first = 0
    for part in chunks(n, chunk):
        k = kept(density, part.stop - part.start)
        assert bool((columns[first : first + k].diff() > 0).all())
        first += k


@pytest.mark.parametrize(("n", "density", "chunk"), CASES[:4])
def test_values_take_only_the_two_levels_of_their_chunk_each_the_mean_of_its_side(
    n: int, density: float, chunk: int
) -> None:
    x = gradient(n, seed=3 * n)
    codec = SparseLoCoCodec(n, density, chunk, torch.float32)
    pieces = codec.encode(x, 0)
    lv = pieces[0].view(-1, 2)  # (low, high) per chunk, on the wire
    out = codec.decode(pieces, 0)
    for i, part in enumerate(chunks(n, chunk)):
        xs, got = x[part], out[part]
        sent = got.nonzero().squeeze(1)
        low, high = lv[i]
        assert set(got[sent].abs().tolist()) <= {float(low), float(high)}
        # 2 bits: the sign and the level; the split is at the mean of the kept magnitudes
        kept_mag = xs[sent].abs().double()
        upper = kept_mag >= kept_mag.mean()
        assert torch.equal(got[sent].abs() == high, upper)
        assert float(high) == pytest.approx(float(kept_mag[upper].mean()), rel=1e-5)
        if (~upper).any():
            assert float(low) == pytest.approx(float(kept_mag[~upper].mean()), rel=1e-5)
        # each side's decoded magnitudes add up to its kept ones (L1 mass per level)
        assert float(got[sent].abs().double().sum()) == pytest.approx(
            float(kept_mag.sum()), rel=1e-5
        )


def test_bytes_are_the_levels_and_the_packed_records() -> None:
    n, density, chunk = 50_000, 0.02, 4096
    codec = SparseLoCoCodec(n, density, chunk, torch.float32)
    full, tail = divmod(n, chunk)
    records = full * kept(density, chunk) + kept(density, tail)
    bits = index_bits(chunk) + 2  # 12 bits of position, 2 of code
    assert bits == 14
    expected = 8 * math.ceil(n / chunk) + math.ceil(records * bits / 8)
    assert to_payload(codec.encode(gradient(n, 1), 0)).numel() == expected
    # about DENSITY * (index + value bits) of fp32's: 0.02 * 14 / 32 = 0.875%, plus levels
    assert expected / (4 * n) == pytest.approx(density * bits / 32, rel=0.1)
    assert parse_compression("sparseloco").nominal_ratio == pytest.approx(
        (8 + math.ceil(82 * 14 / 8)) / (4 * 4096)
    )


def packed_bit_by_bit(values: list[int], width: int) -> bytes:
    """The wire format spelled out: each value's bits, lowest first, back to back, bit i of
    the stream in byte i // 8 at bit i % 8."""
    stream = [(v >> b) & 1 for v in values for b in range(width)]
    stream += [0] * (-len(stream) % 8)
    return bytes(
        sum(bit << i for i, bit in enumerate(stream[j : j + 8])) for j in range(0, len(stream), 8)
    )


@pytest.mark.parametrize("width", [1, 2, 7, 12, 13, 14, 18, 25])
@pytest.mark.parametrize("count", [1001, 1000, 5])
def test_records_pack_back_to_back_and_unpack(width: int, count: int) -> None:
    gen = torch.Generator().manual_seed(width)
    values = torch.randint(0, 2**width, (count,), generator=gen)
    values[:2] = torch.tensor([0, 2**width - 1])
    packed = pack_uint(values, width)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(count * width / 8)
    assert bytes(packed.tolist()) == packed_bit_by_bit(values.tolist(), width)
    assert torch.equal(unpack_uint(packed, width, count), values)


def test_levels_mask_bits_as_torch_where_would_bit_for_bit() -> None:
    magnitudes = gradient(40 * 82, seed=4).abs().view(40, 82)
    magnitudes[3] = 0  # every magnitude at the mean: all high, low level 0
    magnitudes[5, :40] = 0
    lv, high = levels(magnitudes)
    expected_high = magnitudes >= magnitudes.mean(dim=1, keepdim=True)
    s_high = torch.where(expected_high, magnitudes, 0.0).sum(dim=1)
    s_low = torch.where(expected_high, 0.0, magnitudes).sum(dim=1)
    n_high = expected_high.sum(dim=1)
    assert torch.equal(high, expected_high)
    assert torch.equal(lv[:, 1], s_high / n_high.clamp(min=1))
    assert torch.equal(lv[:, 0], s_low / (82 - n_high).clamp(min=1))


def test_consecutive_encodes_and_decodes_are_independent() -> None:
    # The encode reads its input through numpy views and hands back tensors made from numpy
    # arrays: a second encode, or a change to the input, must not reach the first's pieces.
    n, density, chunk = 50_000, 0.02, 4096
    codec = SparseLoCoCodec(n, density, chunk, torch.float32)
    first, second = gradient(n, seed=21), gradient(n, seed=22)
    fresh = SparseLoCoCodec(n, density, chunk, torch.float32)
    expected_first = [p.clone() for p in fresh.encode(first.clone(), 0)]
    expected_second = [p.clone() for p in fresh.encode(second.clone(), 0)]
    pieces_first = codec.encode(first, 0)
    pieces_second = codec.encode(second, 0)
    first.mul_(-3)  # as the hook takes what was sent out of its accumulator
    got = pieces_first + pieces_second
    expected = expected_first + expected_second
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert not torch.equal(pieces_first[1], pieces_second[1])
    out_first = codec.decode(pieces_first, 0)
    out_second = codec.decode(pieces_second, 0)
    assert torch.equal(out_first, fresh.decode(expected_first, 0))
    out_first.zero_()
    assert torch.equal(out_second, fresh.decode(expected_second, 0))


def stable_top_k(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The CPU selection's rule, spelled out: the k largest magnitudes of each row, ties at the
    k-th to the lowest columns, columns ascending."""
    order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices
    return order[:, :k].sort(dim=1).values


@pytest.mark.parametrize("width", [4096, 3000, 1024])
def test_chunk_selection_handles_zeros_ties_and_structure(width: int) -> None:
    # Rows that stress the selection: all zeros (every position a candidate: partitioned
    # whole), half tied at 0.5, tiny values, one strided column of large ones, a strided run
    # of equal values that the k-th magnitude cuts through (ties to the lowest columns).
    x = torch.randn(40, width, generator=torch.Generator().manual_seed(0))
    x[3] = 0
    x[7, : width // 2] = 0.5
    x[9] *= 1e-30
    x[11, ::7] = 1e3
    x[13] = 0
    x[13, 5::9] = -2.0
    x[13, 100] = 3.0
    for k in (1, 20, 82, 120):
        cols = chunk_top_k(x, k)
        assert cols.shape == (40, k)
        assert torch.equal(cols, stable_top_k(x, k)), (width, k)
        assert torch.equal(cols[3], torch.arange(k))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("width", "k"), [(4096, 82), (1024, 31), (3000, 30), (64, 7), (195, 4), (12, 5)]
)
def test_the_cpu_selection_is_torch_topks_set_with_ties_to_the_lowest_columns(
    dtype: torch.dtype, width: int, k: int
) -> None:
    # _torch_select runs off the CPU; on the CPU numpy selects, on the floats' bits (groups of
    # 16, 8 or 4 elements give the threshold, or at width 12 the k-th magnitude itself).
    rows = gradient(9 * width, seed=width, dtype=torch.float64).view(9, width).to(dtype)
    rows[4] = rows[4].abs()  # one row of one sign: magnitudes compare as bits
    rows[5, ::3] = 0  # many zeros below the top k
    rows[6] = -0.25  # all tied: the first k columns
    cols, values = _select(rows, k)
    assert cols.dtype == torch.int64 and values.dtype == dtype
    assert torch.equal(cols, stable_top_k(rows, k))
    assert torch.equal(values, rows.gather(1, cols))
    torch_cols, torch_values = _torch_select(rows, k)
    assert torch.equal(torch_values, rows.gather(1, torch_cols))
    assert torch.equal(torch_cols.diff(dim=1) > 0, torch.ones(9, k - 1, dtype=torch.bool))
    kth = rows.abs().topk(k, dim=1).values[:, -1:]
    # the same set up to ties: both above the k-th magnitude, or at it
    assert bool((rows.abs().gather(1, torch_cols) >= kth).all())
    assert torch.equal(cols[6], torch.arange(k))
    if dtype in (torch.float64, torch.float32):  # no ties at the k-th but in row 6
        untied = [r for r in range(9) if r != 6]
        assert torch.equal(cols[untied], torch_cols[untied])


# -- the accumulator, on one rank --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_what_was_sent_plus_the_accumulator_is_the_decayed_accumulator_plus_delta(
    one_rank: None, dtype: torch.dtype
) -> None:
    c = parse_compression("sparseloco:0.05:1024:0.9")
    state = c.make_state(None)
    n = 10_000
    expected = torch.zeros(n, dtype=torch.float64)
    total_sent = torch.zeros(n, dtype=torch.float64)
    for step in range(4):
        delta = gradient(n, seed=step, dtype=dtype)
        before = state.accumulators.get(7, torch.zeros(n, dtype=dtype)).double().clone()
        # On one rank the mean is this rank's own decoded payload: what it sent.
        sent = c.hook(state, FlatBucket(delta.clone(), index=7)).wait()
        assert sent.dtype == dtype and sent.shape == (n,)
        after = state.accumulators[7]
        assert after.dtype == dtype
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(
            sent.double() + after.double(), 0.9 * before + delta.double(), rtol=0, atol=tol
        )
        # what was sent: 5% of each chunk of 1024, the short last one included
        assert int((sent != 0).sum()) == 9 * kept(0.05, 1024) + kept(0.05, n - 9 * 1024)
        expected = 0.9 * expected + delta.double()
        total_sent = 0.9 * total_sent + sent.double()
    # over several exchanges, nothing leaves e but what was sent (and the decay)
    torch.testing.assert_close(
        total_sent + state.accumulators[7].double(), expected, rtol=0, atol=1e-4
    )
    assert (
        state.bytes_sent
        == 4 * to_payload(SparseLoCoCodec(n, 0.05, 1024, dtype).encode(gradient(n, 0), 0)).numel()
    )


def test_the_accumulator_is_saved_as_a_copy_and_loaded_back() -> None:
    c = parse_compression("sparseloco:0.1:64:0.5")
    state = c.make_state(None)
    state.accumulators = {0: torch.arange(5.0), 3: torch.ones(2)}
    saved = state.state_dict()
    assert saved["density"] == 0.1 and saved["chunk"] == 64 and saved["beta"] == 0.5
    state.accumulators[0].mul_(0)  # the hook's in-place update must not reach a saved state
    assert torch.equal(saved["accumulators"][0], torch.arange(5.0))
    fresh = c.make_state(None)
    fresh.load_state_dict(saved)
    assert sorted(fresh.accumulators) == [0, 3]
    assert torch.equal(fresh.accumulators[0], torch.arange(5.0))


def test_it_is_its_own_error_feedback_and_cannot_be_wrapped_in_another() -> None:
    c = parse_compression("sparseloco")
    assert not c.feedback and c.replaces_momentum
    with pytest.raises(TypeError, match="does not record what it sent"):
        error_feedback(c).make_state(None)


# -- the spec, and where it runs ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("sparseloco", "sparseloco:0.02:4096:0.95"),
        (" SparseLoCo:0.01 ", "sparseloco:0.01:4096:0.95"),
        ("sparseloco:0.03:1024", "sparseloco:0.03:1024:0.95"),
        ("sparseloco::2048:0.9", "sparseloco:0.02:2048:0.9"),
        ("sparseloco:1:16:0", "sparseloco:1.0:16:0.0"),
    ],
)
def test_specs_take_defaults_and_round_trip(text: str, canonical: str) -> None:
    assert parse_compression(text).spec == canonical
    assert parse_compression(canonical).spec == canonical
    assert str(parse_compression_spec(canonical)) == canonical


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("sparseloco:0", "DENSITY=0 must be a number in (0, 1]"),
        ("sparseloco:1.5", "DENSITY=1.5 must be a number in (0, 1]"),
        ("sparseloco:nan", "DENSITY=nan must be a number in (0, 1]"),
        ("sparseloco:x", "DENSITY=x must be a number in (0, 1]"),
        ("sparseloco:0.02:8", "CHUNK=8 must be an integer from 16 to 65536"),
        ("sparseloco:0.02:100000", "CHUNK=100000 must be an integer from 16 to 65536"),
        ("sparseloco:0.02:4096.5", "CHUNK=4096.5 must be an integer from 16 to 65536"),
        ("sparseloco:0.02:4096:1.5", "BETA=1.5 must be a number from 0 to 1"),
        ("sparseloco:0.02:4096:-0.1", "BETA=-0.1 must be a number from 0 to 1"),
        ("sparseloco:0.02:4096:0.9:1", "sparseloco takes at most DENSITY:CHUNK:BETA, got 4"),
    ],
)
def test_a_bad_spec_names_the_value_and_the_valid_forms(text: str, says: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_compression(text)
    message = str(err.value)
    assert says in message and repr(text) in message
    assert message.endswith(f"valid forms: {COMPRESSION_FORMS}")
    assert "sparseloco[:DENSITY[:CHUNK[:BETA]]]" in COMPRESSION_FORMS
    # the constructor goes through the same parser, and words it the same way
    with pytest.raises(UsageError, match="DENSITY=0.0 must be"):
        sparseloco(0.0)


@pytest.mark.parametrize("strategy", ["bsp", "zero:1", "zero:2", "ssp:0", "async", "hogwild"])
def test_strategies_without_an_outer_step_refuse_it_in_one_line(strategy: str) -> None:
    with pytest.raises(UsageError) as err:
        check_compressor(parse_strategy(strategy), parse_compression("sparseloco"))
    message = str(err.value)
    assert "\n" not in message
    assert "local:H or diloco:H" in message and "sparseloco:0.02:4096:0.95" in message
    # before any rank starts, from the command line's checks (zero:2 and hogwild refuse every
    # compressor there, in their own words)
    with pytest.raises(UsageError, match="sparseloco:0.02:4096:0.95") as err:
        RunConfig(strategy=strategy, compression="sparseloco", out="run")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("strategy", ["local:4", "diloco:8", "diloco:8:2", "diloco:8:4:1:0.5"])
def test_the_periodic_strategies_take_it(strategy: str) -> None:
    check_compressor(parse_strategy(strategy), parse_compression("sparseloco"))


def test_bsp_refuses_it_in_the_synchronizer_too(one_rank: None) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="not bsp"):
        gs.Synchronizer(model, opt, strategy="bsp", compression="sparseloco")


@pytest.mark.parametrize(("compression", "momentum"), [("sparseloco", 0.0), ("int8", 0.9)])
def test_diloco_takes_its_outer_step_without_momentum_under_sparseloco(
    one_rank: None, compression: str, momentum: float
) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = gs.Synchronizer(model, opt, strategy="diloco:4", compression=compression)
    try:
        group = sync.strategy._outer_opt.param_groups[0]  # type: ignore[attr-defined]
        assert group["momentum"] == momentum and group["nesterov"] == (momentum > 0)
        assert group["lr"] == 0.7  # the outer learning rate is kept
    finally:
        sync.close()
