"""The compressors' fast kernels (issue 16): each one against a plain reference of the same math.

sign packs its bits eight to a byte through 64-bit words; topk finds the k largest magnitudes
through a sampled threshold instead of a selection over all n; int8 rounds with 16-bit noise
(from a table per encode: tests/unit/test_int8_noise.py); randomk draws one position per stratum
by integer hashing (``fused.strata``); PowerSGD builds its rank-R products as R multiply-adds. The
other compression tests run them at small sizes (most under topk's threshold size); these cover the
large, ragged and odd-dtype inputs the fast paths were written for, and the edge cases (ties,
NaN, signed zeros) where they could differ.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from gradsync.compression import _select, fused
from gradsync.compression._lowrank import compute_p, compute_q, subtract_outer, write_outer
from gradsync.compression._select import SMALL, top_magnitudes
from gradsync.compression._wire import derive_seed
from gradsync.compression.int4 import Int4Codec
from gradsync.compression.int8 import Int8Codec, dequantize, quantize, rounding_noise
from gradsync.compression.powersgd import Projection, plan_shapes
from gradsync.compression.sign import SignCodec, pack_signs, unpack_signs
from gradsync.compression.sparse import TopKCodec

pytestmark = pytest.mark.unit

# Up to several of the kernels' 262,144-element blocks, the last one ragged.
RAGGED = [1, 7, 8, 9, 63, 64, 65, 1000, 4093, 600_001]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def rand(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # Magnitudes over several decades, both signs.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).mul_(-6).exp_()
    return x.to(dtype)


# sign ---------------------------------------------------------------------------------------


def reference_sign(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad with zeros, a weighted sum per byte: the packing as first written."""
    n = x.numel()
    pad = (-n) % chunk
    rows = torch.nn.functional.pad(x.reshape(-1).float(), (0, pad)).view(-1, chunk)
    counts = torch.full((rows.shape[0],), float(chunk))
    counts[-1] = chunk - pad
    bits = (rows >= 0).to(torch.uint8).view(-1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    packed = (bits * weights).sum(dim=1, dtype=torch.uint8)[: -(-n // 8)]
    return rows.abs().sum(dim=1) / counts, packed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", RAGGED)
def test_sign_bytes_and_scales_match_the_reference(n: int, dtype: torch.dtype) -> None:
    x = rand(n, n, dtype)
    x[::5] = 0.0
    x[1::7] = -0.0  # zeros of either sign count as positive
    scale, packed = pack_signs(x, 64)
    ref_scale, ref_packed = reference_sign(x, 64)
    assert torch.equal(packed, ref_packed)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    signs = torch.where(x.float() >= 0, 1.0, -1.0)
    expected = signs * scale.repeat_interleave(64)[:n]
    assert torch.equal(unpack_signs(scale, packed, n, 64), expected)
    assert torch.equal(unpack_signs(scale, packed, n, 64, torch.float64), expected.double())


def test_sign_word_packing_equals_the_portable_path(monkeypatch: pytest.MonkeyPatch) -> None:
    x = rand(10_001, 3)
    fast = pack_signs(x, 64)[1]
    monkeypatch.setattr(sys, "byteorder", "big")  # takes the weighted-sum path
    assert torch.equal(pack_signs(x, 64)[1], fast)


def test_sign_accumulate_adds_exactly_the_decode() -> None:
    n = 600_001
    codec = SignCodec(n, 64, torch.float32)
    parts = codec.encode(rand(n, 4), 0)
    out = rand(n, 5)
    expected = out + codec.decode(parts, 0)
    codec.accumulate(parts, out, 0)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("n", [1000, 600_001])
def test_sign_accumulate_all_equals_one_accumulate_per_rank(n: int) -> None:
    # The all-gather decodes every rank's payload a block at a time: same adds, same order.
    codec = SignCodec(n, 64, torch.float32)
    payloads = [codec.encode(rand(n, 10 + r), 0) for r in range(3)]
    start = rand(n, 5)
    expected = start.clone()
    for parts in payloads:
        codec.accumulate(parts, expected, 0)
    out = start.clone()
    codec.accumulate_all(payloads, out, 0)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("n", [1000, 600_001])
def test_sign_contribution_subtracts_exactly_the_decode(n: int) -> None:
    codec = SignCodec(n, 64, torch.float32)
    x = rand(n, 4)
    x[::9] = -0.0
    parts = codec.encode(x, 0)
    expected = x - codec.decode(parts, 0)
    got = codec.contribution(parts, 0).subtract_from(x.clone())
    assert torch.equal(got, expected)


@pytest.mark.parametrize("n", [1000, 600_001])
@pytest.mark.parametrize("chunk", [64, 128])
def test_int4_contribution_subtracts_exactly_the_decode(n: int, chunk: int) -> None:
    # Error feedback's residual without the dense decode: the same bits as x - decode(parts).
    codec = Int4Codec(n, chunk, torch.float32)
    x = rand(n, 5)
    x[: chunk + 3] = 0.0  # a chunk of zeros: its scale is 0
    parts = codec.encode(x, 0)
    expected = x - codec.decode(parts, 0)
    got = codec.contribution(parts, 0).subtract_from(x.clone())
    assert torch.equal(got, expected)


# topk ---------------------------------------------------------------------------------------


def assert_top(x: torch.Tensor, index: torch.Tensor, values: torch.Tensor, k: int) -> None:
    """k distinct positions, the values there, and no unselected magnitude above a selected."""
    assert index.numel() == k and index.unique().numel() == k
    assert torch.equal(values, x[index])
    chosen = torch.zeros(x.numel(), dtype=torch.bool)
    chosen[index] = True
    mag = x.abs().double()
    if k < x.numel():
        assert mag[chosen].min() >= mag[~chosen].max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [SMALL, 100_003, 1_000_001])
@pytest.mark.parametrize("fraction", [0.0001, 0.01, 0.1])
def test_topk_threshold_search_selects_what_torch_topk_selects(
    n: int, fraction: float, dtype: torch.dtype
) -> None:
    x = rand(n, 6, dtype)
    k = math.ceil(fraction * n)
    index, values = top_magnitudes(x, k)
    assert_top(x, index, values, k)
    assert set(index.tolist()) == set(x.abs().topk(k).indices.tolist())
    assert torch.all(index[1:] > index[:-1])  # ascending: the scatter walks memory in order


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n", [70_001, 600_003])
def test_the_threshold_pass_marks_exactly_the_magnitudes_reaching_it(
    n: int, dtype: torch.dtype
) -> None:
    # Without the fallback behind it: a threshold equal to an element must count that element
    # (and its negative), NaN counts, zeros (either sign) never do.
    x = rand(n, 10, dtype)
    x[::97] = 0.0
    x[1::89] = -0.0
    x[[5, 600, n - 1]] = float("nan")
    x[[7, n - 2]] = float("inf")
    x[[8, 9]] = -float("inf")
    t = float(x[3_000].abs())
    x[[11, 12]] = torch.tensor([t, -t], dtype=dtype)
    expected = (~(x.abs() < t)).nonzero().squeeze(1)
    assert torch.equal(_select._reaching(x, t), expected)


def test_topk_finds_a_large_column_a_strided_sample_would_alias() -> None:
    x = torch.randn(20_000, 64, generator=torch.Generator().manual_seed(7))
    x[:, 5] *= 100.0  # one column: every 64th element
    x = x.reshape(-1)
    k = 20_000
    index, values = top_magnitudes(x, k)
    assert_top(x, index, values, k)
    assert set(index.tolist()) == set(x.abs().topk(k).indices.tolist())


def test_topk_ties_at_the_kth_magnitude_go_to_the_lowest_positions() -> None:
    n, k = 200_000, 2_000
    x = torch.ones(n)
    x[150_000:150_500] = 3.0  # 500 clear winners, then 1500 of the 199,500 tied ones
    x[1::2] *= -1.0
    index, values = top_magnitudes(x, k)
    assert_top(x, index, values, k)
    assert set(index.tolist()) == set(range(150_000, 150_500)) | set(range(1_500))


@pytest.mark.parametrize("where", [[90_000], [17, 90_000, 199_999]])
def test_topk_selects_nan_as_torch_topk_does(where: list[int]) -> None:
    # A NaN gradient must reach the wire (and the non-finite guard), not hide in a residual.
    x = rand(200_000, 8)
    x[where] = float("nan")
    index, _ = top_magnitudes(x, 2_000)
    assert index.numel() == 2_000 and index.unique().numel() == 2_000
    assert set(where) <= set(index.tolist())
    finite = x.nan_to_num(nan=float("inf")).abs().topk(2_000).indices
    assert set(index.tolist()) == set(finite.tolist())


def test_topk_falls_back_when_the_sample_overestimates() -> None:
    # Large values exactly where the sample looks, small elsewhere: fewer than k reach the
    # threshold the sample suggests, so the search must fall back and still be right.
    n, k = 1_000_000, 100_000
    x = torch.full((n,), 1e-3)
    x[torch.arange(0, n, 2)] = 2e-3  # so the k largest are not a tie
    x[_select._sample_positions(n, x.device)] = 5.0
    index, values = top_magnitudes(x, k)
    assert_top(x, index, values, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_codec_round_trips_large_ragged_inputs(dtype: torch.dtype) -> None:
    n = 100_003
    k = 1_001
    x = rand(n, 9, dtype)
    codec = TopKCodec(n, k, dtype, torch.promote_types(dtype, torch.float32))
    index, values = codec.encode(x, 0)
    assert index.dtype == torch.int32 and values.dtype == dtype
    assert_top(x, index.long(), values, k)
    out = codec.decode([index, values], 0)
    assert int((out != 0).sum()) == k and torch.equal(out[index.long()], values.to(out.dtype))
    # Error feedback's residual: the same as subtracting the dense decode, without building it.
    acc = x.to(out.dtype)
    got = codec.contribution([index, values], 0).subtract_from(acc.clone())
    assert torch.equal(got, acc - out)
    assert int((got != 0).sum()) == int((acc != 0).sum()) - k


# int8 ---------------------------------------------------------------------------------------


def test_rounding_noise_uses_16_bits_in_every_lane() -> None:
    # Four int16 lanes per 64-bit draw; a draw that leaves the top bit clear (random_() with
    # no range) makes every fourth element's noise non-negative: biased rounding.
    noise = rounding_noise(40_000, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert noise.dtype == torch.float32 and noise.numel() == 40_000
    assert torch.equal(noise - 0.5, (noise - 0.5).round())  # r + 1/2, r an integer
    for lane in range(4):
        part = noise[lane::4]
        assert part.min() >= -32767.5 and part.max() <= 32767.5
        assert part.min() < -30_000 and part.max() > 30_000
        assert abs(float((part < 0).float().mean()) - 0.5) < 0.03


def test_int8_codes_of_values_on_the_grid_are_exact() -> None:
    # x / s an integer: the noise, strictly inside (-1/2, 1/2), must never move it. Noise of
    # r / 2**16 alone would reach -1/2, and round half to even would then send odd codes down.
    n = 1_000_003
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(-127, 128, (n,), generator=gen).float()
    codes[::1024] = 127.0  # every chunk's max is 127: the scale is exactly 1
    for step in range(3):
        scale, got = quantize(codes, 1024, torch.Generator().manual_seed(step))
        assert torch.equal(scale, torch.ones_like(scale))
        assert torch.equal(got.float(), codes)


@pytest.mark.parametrize("fraction", [0.01, 0.3, 0.5, 0.9])
def test_int8_rounds_up_with_the_fractional_part_as_probability(fraction: float) -> None:
    n = 1_000_000
    x = torch.full((n,), 100.0 + fraction)
    x[::1024] = 127.0  # scale 1: x / s = 100 + fraction
    _, codes = quantize(x, 1024, torch.Generator().manual_seed(2))
    up = float((codes[x != 127.0] == 101).double().mean())
    assert set(codes[x != 127.0].unique().tolist()) <= {100, 101}
    assert abs(up - fraction) < 5 * math.sqrt(fraction * (1 - fraction) / n) + 2**-16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", RAGGED)
def test_int8_error_below_one_step_for_ragged_sizes_and_dtypes(n: int, dtype: torch.dtype) -> None:
    x = rand(n, n + 1, dtype)
    scale, codes = quantize(x, 64, torch.Generator().manual_seed(3))
    out = dequantize(scale, codes, 64)
    step = scale.repeat_interleave(64)[:n]
    assert torch.all((out - x.float()).abs() < step * (1 + 1e-5) + 1e-38)
    wide = codes.double() * scale.double().repeat_interleave(64)[:n]  # fp64 decodes in fp64
    assert torch.equal(dequantize(scale, codes, 64, torch.float64), wide)


def test_int8_accumulate_adds_the_decode_to_the_last_bit() -> None:
    n = 600_001
    codec = Int8Codec(n, 1024, (0,), torch.float32)
    parts = codec.encode(rand(n, 10), 0)
    out = rand(n, 11)
    decoded = codec.decode(parts, 0)
    expected = out + decoded
    codec.accumulate(parts, out, 0)
    # A fused multiply-add skips the rounding of the product: at most one unit in its last place.
    bound = 2**-23 * (decoded.abs() + expected.abs())
    assert torch.all((out - expected).abs() <= bound)


# randomk ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(1, 1), (10, 2), (64, 16), (1000, 300), (200_003, 2_001)])
def test_strata_are_one_position_in_each_reproducible_by_seed(n: int, k: int) -> None:
    seed = fused.seed_words(derive_seed(5), torch.device("cpu"))
    position, size = fused.strata(n, k, *seed)
    again, _ = fused.strata(n, k, *seed)
    assert torch.equal(position, again)
    j = torch.arange(k)
    start, stop = j * n // k, (j + 1) * n // k
    assert torch.all((position >= start) & (position < stop))
    assert torch.equal(size, stop - start) and int(size.sum()) == n
    other, _ = fused.strata(n, k, *fused.seed_words(derive_seed(6), torch.device("cpu")))
    assert n == k or not torch.equal(position, other)


def test_strata_include_every_position_equally_often() -> None:
    # 4000 draws of one position in each of 10 strata of 100: each is kept 40 times on
    # average, variance 39.6.
    n, k, draws = 1000, 10, 4000
    counts = torch.zeros(n)
    for step in range(draws):
        seed = fused.seed_words(derive_seed(6, step), torch.device("cpu"))
        counts[fused.strata(n, k, *seed)[0]] += 1
    expected = draws * k / n
    sd = math.sqrt(draws * (k / n) * (1 - k / n))
    assert float((counts - expected).abs().max()) < 5 * sd


# powersgd -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 2, 4, 5, 8])
def test_powersgd_products_equal_plain_matmuls(rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    # Small matrices take the matmul, a large one (2^19 elements) R broadcast multiply-adds.
    mats = [torch.randn(300, 70, generator=gen), torch.randn(16, 301, generator=gen)]
    mats.append(torch.randn(1024, 512, generator=gen))
    qs = [torch.randn(m.shape[1], rank, generator=gen) for m in mats]
    ps = [torch.empty(m.shape[0], rank) for m in mats]
    compute_p(mats, qs, ps)
    for m, q, p in zip(mats, qs, ps, strict=True):
        # Sums of up to 512 products, in another order than the reference's.
        torch.testing.assert_close(p, m @ q, rtol=1e-5, atol=2e-4)
    compute_q(mats, ps, qs)
    for m, p, q in zip(mats, ps, qs, strict=True):
        torch.testing.assert_close(p.t() @ p, torch.eye(rank), atol=1e-5, rtol=0)
        torch.testing.assert_close(q, m.t() @ p, rtol=1e-5, atol=2e-4)
        out = torch.empty_like(m)
        write_outer(out, p, q)
        torch.testing.assert_close(out, p @ q.t())
        base = torch.randn(m.shape, generator=gen)
        subtract_outer(out := base.clone(), p, q)
        torch.testing.assert_close(out, base - p @ q.t())


def test_powersgd_projection_leaves_the_residual_of_each_part() -> None:
    shapes = [[40, 30], [30], [3, 4]]
    plan = plan_shapes(shapes, 2, 2.0)
    gen = torch.Generator().manual_seed(12)
    corrected = torch.randn(1200 + 30 + 12, generator=gen)
    corrected[1205] = float("nan")  # in the plain part: the residual stays NaN, not 0
    p, q = torch.linalg.qr(torch.randn(40, 2, generator=gen)).Q, torch.randn(30, 2, generator=gen)
    expected = corrected.clone()
    expected[:1200] -= (p @ q.t()).reshape(-1)
    expected[1200:] = 0.0
    expected[1205] = float("nan")
    got = Projection(plan, [p], [q]).subtract_from(corrected)
    torch.testing.assert_close(got, expected, equal_nan=True)
