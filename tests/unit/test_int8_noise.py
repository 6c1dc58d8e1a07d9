"""int8's rounding noise from a table (issue 16; gradsync/compression/int8.py, ``RoundingNoise``).

An encode of more than ``NOISE_TABLE = 2**16`` elements draws one table of that many noise
values and adds it a piece of up to ``2**16`` elements at a time, each piece a cyclic window at
a random offset with a random sign. These tests read that noise back exactly, check that
``quantize`` adds exactly it, and check what the table must keep: every value one of the
``2**16`` midpoints, uniform; fresh at every step; no fixed stride at which it repeats; and sums
of rounding errors with the variance of independent rounding (what the random sign buys).
"""

from __future__ import annotations

import math

import pytest
import torch

from gradsync.compression._wire import blocks
from gradsync.compression.int8 import NOISE_TABLE, Int8Codec, RoundingNoise, quantize

pytestmark = pytest.mark.unit

T = NOISE_TABLE
CPU = torch.device("cpu")


def read_noise(numel: int, chunk: int, seed: int) -> torch.Tensor:
    """The noise ``quantize(x, chunk, Generator().manual_seed(seed))`` adds to ``x / s``."""
    noise = RoundingNoise(numel, chunk, torch.Generator().manual_seed(seed), CPU)
    out = torch.zeros(numel)
    for start, stop in blocks(numel, chunk):
        noise.add_(out[start:stop])
    return out


def unit_scale(values: torch.Tensor, chunk: int) -> torch.Tensor:
    """``values`` with 127 at every chunk's start: every scale is exactly 1, so x / s = x."""
    x = values.clone()
    x[::chunk] = 127.0
    return x


@pytest.mark.parametrize("chunk", [1024, 1000])  # blocks a multiple of the table, and not
def test_quantize_adds_exactly_the_noise_read_back(chunk: int) -> None:
    n = 3 * T + 1001
    gen = torch.Generator().manual_seed(1)
    x = unit_scale(torch.rand(n, generator=gen) * 250 - 125, chunk)
    scale, codes = quantize(x, chunk, torch.Generator().manual_seed(4))
    assert torch.equal(scale, torch.ones_like(scale))
    expected = (x + read_noise(n, chunk, 4)).round().clamp(-127, 127)
    assert torch.equal(codes.float(), expected)


def test_noise_values_are_the_midpoints_uniformly() -> None:
    # Values (r + 1/2) / 2**16, r an integer in [-2**15, 2**15): a missing + 1/2, a lost bit or a
    # wrong scale fails the first checks; a lopsided table the histogram.
    n = 4 * T + 77
    noise = torch.cat([read_noise(n, 1024, seed) for seed in range(4)]).double()
    r = noise * 2**16 - 0.5
    assert torch.equal(r, r.round())
    assert r.min() >= -(2**15) and r.max() < 2**15
    assert r.min() < -32_000 and r.max() > 32_000
    # A piece holds T draws from the table: about (1 - 1/e) T distinct values if it has T.
    assert noise[:T].unique().numel() > 0.6 * T
    # 64 equal bins of the 2**16 midpoints: chi-square, 63 degrees of freedom (p = 1e-6 at 130).
    # Pieces are windows of one table, so the sample is about 4 tables' worth, not 4n values.
    counts = torch.bincount(((r + 2**15) // 2**10).long(), minlength=64).double()
    expected = noise.numel() / 64
    assert float(((counts - expected) ** 2 / expected).sum()) < 130 * (noise.numel() / (4 * T))


def test_noise_is_fresh_at_every_step() -> None:
    # Same key, steps 0..S-1: the same table every step would repeat each element's noise.
    n, steps = 2 * T + 500, 16
    codec = Int8Codec(n, 1024, (3, 0, 1), torch.float32)
    x = unit_scale(torch.full((n,), 50.5), 1024)
    seen = torch.stack([codec.encode(x, step)[1] for step in range(steps)]).float()
    up = (seen[:, x != 127.0] == 51).double()
    # x / s = 50.5: each element is rounded up in about half of the steps, independently.
    assert abs(float(up.mean()) - 0.5) < 0.01
    assert float((up.mean(0) == 0).double().mean() + (up.mean(0) == 1).double().mean()) < 0.001
    for step in range(steps - 1):
        a, b = read_noise(n, 1024, step), read_noise(n, 1024, step + 1)
        assert float((a == b).double().mean()) < 0.001
        # A fixed table at fresh offsets would pass the above, and bias the rounding probability
        # the same way at every step (by its values' departure from uniform, about 1/sqrt(T)):
        # its first piece would hold the same values, rotated, at every step.
        assert not torch.equal(a[:T].abs().sort().values, b[:T].abs().sort().values)


def test_no_stride_at_which_the_noise_repeats() -> None:
    # One table added at the same offset in every piece would give elements T apart the same
    # noise every time; with random offsets two pieces coincide with probability 1 / T.
    n = 6 * T
    for seed in range(3):
        noise = read_noise(n, 1024, seed)
        for stride in (T, 2 * T, 1024, 1):
            same = (noise[stride:].abs() == noise[:-stride].abs()).double().mean()
            assert float(same) < 0.01, (seed, stride)


def test_sum_of_rounding_errors_has_the_variance_of_independent_rounding() -> None:
    # Element i at x / s = 100 + f_i, f_i spread: with independent rounding the sum of the
    # errors q - x / s has variance sum f (1 - f). Every element shares its table entry with one
    # element of each other piece; unsigned, those pairs correlate (about +0.5 on average over
    # spread fractions), giving about 1 + 7 * 0.5 = 4.5x at 8 pieces. A random sign per piece
    # cancels it on average. 200 encodes: the sample variance is within about 10% (one SD).
    n, draws = 8 * T, 200
    gen = torch.Generator().manual_seed(5)
    x = unit_scale(100.0 + torch.rand(n, generator=gen), 1024)
    keep = x != 127.0
    f = (x - 100.0).double()[keep]
    sums = []
    for step in range(draws):
        _, codes = quantize(x, 1024, torch.Generator().manual_seed(1000 + step))
        sums.append(float((codes.double()[keep] - 100.0 - f).sum()))
    ratio = float(torch.tensor(sums, dtype=torch.float64).var()) / float((f * (1 - f)).sum())
    assert 0.6 < ratio < 1.5, ratio


def test_each_element_is_unbiased_over_steps_above_the_table_size() -> None:
    # As test_push_codec's unbiasedness test, at a size that uses the table: per element, by
    # Hoeffding, the mean of S independent decodes is within 3.5 s / sqrt(S) of x except with
    # probability 5e-11 (steps are independent draws even where elements within one are not).
    n, draws = 2 * T + 3001, 200
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(n, generator=gen) * torch.linspace(0.1, 3, n)
    codec = Int8Codec(n, 1024, (0, 1, 2), torch.float32)
    total = torch.zeros(n, dtype=torch.float64)
    for step in range(draws):
        total += codec.decode(codec.encode(x, step), step).double()
    mean = total / draws
    scale, _ = quantize(x, 1024, torch.Generator())
    s = scale.double().repeat_interleave(1024)[:n]
    assert torch.all((mean - x.double()).abs() <= 3.5 * s / math.sqrt(draws))


def test_codes_are_a_function_of_the_key_and_step_only() -> None:
    n = 3 * T + 17
    x = torch.randn(n, generator=torch.Generator().manual_seed(6))
    before = torch.get_rng_state()
    a = Int8Codec(n, 1024, (0, 0, 0), torch.float32).encode(x, 3)
    torch.manual_seed(123)  # the global stream must not matter
    b = Int8Codec(n, 1024, (0, 0, 0), torch.float32).encode(x, 3)
    other_rank = Int8Codec(n, 1024, (0, 1, 0), torch.float32).encode(x, 3)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    assert not torch.equal(a[1], other_rank[1])
    torch.set_rng_state(before)
    Int8Codec(n, 1024, (0, 0, 0), torch.float32).encode(x, 4)
    assert torch.equal(torch.get_rng_state(), before)
