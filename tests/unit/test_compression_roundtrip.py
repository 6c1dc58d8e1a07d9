"""Single-rank behaviour of every compressor: reconstruction bounds, unbiasedness, error-feedback
mass conservation, PowerSGD exactness, bytes on the wire, and resumable state.

With one rank the mean over ranks is this rank's own decoded contribution, so every hook's
result *is* its reconstruction of the input.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from gradsync.compression import (
    ALLREDUCE,
    BF16,
    FP16,
    Compressor,
    FlatBucket,
    error_feedback,
    int8,
    parse_compression,
    powersgd,
    randomk,
    sign,
    topk,
)

# The hooks run their collectives on a one-rank group (see conftest).
pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank")]


def exchange(compressor: Compressor, state: object, x: torch.Tensor, index: int = 0, **kw: object):
    bucket = FlatBucket(x.clone(), index=index, **kw)  # type: ignore[arg-type]
    return compressor.hook(state, bucket).wait()


def rand(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("c", "dtype", "eps"), [(FP16, torch.float16, 2**-11), (BF16, torch.bfloat16, 2**-8)]
)
def test_half_precision_is_exact_to_its_precision(
    c: Compressor, dtype: torch.dtype, eps: float
) -> None:
    # magnitudes across fp16's normal range (about 6e-5 .. 65504), both signs
    x = torch.logspace(-3, 4, 1000) * rand(1000, 0).sign() * (1 + rand(1000, 9).abs())
    state = c.make_state(None)
    out = exchange(c, state, x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(out, x.to(dtype).float())
    assert torch.all((out - x).abs() <= eps * x.abs())
    assert state.bytes_sent == 2 * x.numel()


def test_int8_error_below_one_quantization_step_per_chunk() -> None:
    chunk = 64
    c = int8(chunk=chunk)
    state = c.make_state(None)
    x = rand(1000, 1) * torch.linspace(0.01, 100.0, 1000)  # chunks of very different scale
    out = exchange(c, state, x)
    n_chunks = math.ceil(1000 / chunk)
    padded = torch.nn.functional.pad(x, (0, n_chunks * chunk - 1000)).view(-1, chunk)
    step = (padded.abs().amax(1) / 127).repeat_interleave(chunk)[:1000]
    assert torch.all((out - x).abs() < step * (1 + 1e-5))
    assert state.bytes_sent == 1000 + 4 * n_chunks


def test_topk_keeps_exactly_the_largest_magnitudes() -> None:
    c = topk(0.1)
    state = c.make_state(None)
    x = rand(1000, 2)
    out = exchange(c, state, x)
    top = x.abs().topk(100).indices
    assert torch.equal(out[top], x[top])
    assert int((out != 0).sum()) == 100
    # documented bound: what is dropped is at most (1 - F) of the energy
    assert (out - x).norm() ** 2 <= 0.9 * x.norm() ** 2
    assert state.bytes_sent == 100 * (4 + 4)


def test_randomk_sends_k_rescaled_values() -> None:
    c = randomk(0.25)
    state = c.make_state(None)
    x = rand(400, 3)
    out = exchange(c, state, x)
    kept = out != 0
    assert int(kept.sum()) == 100
    torch.testing.assert_close(out[kept], x[kept] * 4.0)
    assert state.bytes_sent == 100 * 4


def test_sign_sends_signs_with_l1_preserving_scale() -> None:
    c = sign(chunk=64)
    state = c.make_state(None)
    x = rand(1000, 4) * torch.linspace(0.1, 10.0, 1000)
    out = exchange(c, state, x)
    assert torch.equal(torch.sign(out), torch.sign(x))
    for start in range(0, 1000, 64):
        part, got = x[start : start + 64], out[start : start + 64]
        torch.testing.assert_close(got.abs(), torch.full_like(got, float(part.abs().mean())))
    assert state.bytes_sent == 1000 // 8 + 16 * 4


def test_powersgd_reproduces_a_low_rank_matrix_after_warm_start() -> None:
    gen = torch.Generator().manual_seed(5)
    m = torch.randn(64, 3, generator=gen) @ torch.randn(3, 48, generator=gen)
    bias = torch.randn(48, generator=gen)
    flat = torch.cat([m.reshape(-1), bias])
    params = [torch.empty(64, 48), torch.empty(48)]
    c = powersgd(3, start_iter=1)
    state = c.make_state(None)
    first = exchange(c, state, flat, params=params)
    assert torch.equal(first, flat)  # start_iter: the first step is a plain all-reduce
    assert state.bytes_sent == 4 * flat.numel()
    for _ in range(2):
        out = exchange(c, state, flat, params=params)
        torch.testing.assert_close(out[: m.numel()].view(64, 48), m, rtol=1e-4, atol=1e-4)
        assert torch.equal(out[m.numel() :], bias)  # vectors go uncompressed
    assert state.bytes_sent == 4 * flat.numel() + 2 * 4 * (48 + 64 * 3 + 48 * 3)


def test_powersgd_is_a_projection_and_skips_matrices_it_cannot_shrink() -> None:
    gen = torch.Generator().manual_seed(6)
    big, small = torch.randn(40, 30, generator=gen), torch.randn(4, 4, generator=gen)
    flat = torch.cat([big.reshape(-1), small.reshape(-1)])
    params = [big, small]
    c = powersgd(2, start_iter=0)
    state = c.make_state(None)
    out = exchange(c, state, flat, params=params)
    approx = out[:1200].view(40, 30)
    assert approx.norm() <= big.norm() * (1 + 1e-5)  # P P^T M never grows
    assert torch.linalg.matrix_rank(approx) == 2
    assert not torch.allclose(approx, big, atol=1e-2)
    assert torch.equal(out[1200:], small.reshape(-1))  # 4x4 at rank 2 would not save 2x


@pytest.mark.parametrize("c", [int8(chunk=16), randomk(0.25, seed=3)], ids=["int8", "randomk"])
def test_stochastic_compressors_are_unbiased(c: Compressor) -> None:
    """The mean of N draws converges to the input. Per element, the draw's standard deviation
    is at most s/2 for int8 (s = one quantization step) and |x| sqrt(1/F - 1) for randomk; we
    require every element within 5 standard errors (sigma / sqrt(N)). Draws are seeded, so the
    test is deterministic; a biased variant (round-to-nearest, or no n/k rescale) fails it."""
    n_draws = 2000
    x = rand(64, 7)
    state = c.make_state(None)
    total = torch.zeros(64, dtype=torch.float64)
    for _ in range(n_draws):
        total += exchange(c, state, x).double()
    mean = total / n_draws
    if c.spec == "int8":
        sigma = (x.view(-1, 16).abs().amax(1) / 127 / 2).repeat_interleave(16).double()
    else:
        sigma = x.abs().double() * math.sqrt(1 / 0.25 - 1)
    assert torch.all((mean - x.double()).abs() <= 5 * sigma / math.sqrt(n_draws) + 1e-7)


EF_CASES = {
    "topk": error_feedback(topk(0.05)),
    "sign": error_feedback(sign(chunk=32)),
    "powersgd": error_feedback(powersgd(1, start_iter=2)),
    "int8": error_feedback(int8(chunk=32)),
}


@pytest.mark.parametrize("name", sorted(EF_CASES))
def test_error_feedback_conserves_mass(name: str) -> None:
    c = EF_CASES[name]
    state = c.make_state(None)
    params = [torch.empty(20, 10), torch.empty(50)]
    sent, inputs = torch.zeros(250, dtype=torch.float64), torch.zeros(250, dtype=torch.float64)
    for t in range(20):
        g = rand(250, 100 + t)
        inputs += g.double()
        sent += exchange(c, state, g, params=params).double()
    residual = state.state_dict()["residuals"][0]
    assert residual.abs().sum() > 1e-3  # something was held back, so the check has teeth
    torch.testing.assert_close(sent + residual.double(), inputs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("spec", ["topk:0.1", "sign", "int8"])
def test_all_gather_mean_lands_in_the_bucket_buffer(spec: str) -> None:
    # The mean is written into an fp32 bucket's own buffer (no new tensor, no copy back);
    # error feedback's residual keeps its memory from one exchange to the next.
    c = parse_compression(spec)
    state = c.make_state(None)
    residual = None
    for t in range(3):
        buf = rand(5000, t)
        out = c.hook(state, FlatBucket(buf)).wait()
        assert out.data_ptr() == buf.data_ptr()
        if c.feedback:
            now = state.residuals[0]
            assert residual is None or now.data_ptr() == residual.data_ptr()
            residual = now
    half = rand(5000, 7).half()  # not the accumulator dtype: a new tensor, in the buffer's dtype
    out = c.hook(state, FlatBucket(half.clone())).wait()
    assert out.dtype == torch.float16


def test_error_feedback_state_load_copies_the_residuals() -> None:
    c = parse_compression("sign")
    a = c.make_state(None)
    exchange(c, a, rand(300, 0))
    saved = a.state_dict()
    kept = saved["residuals"][0].clone()
    b = c.make_state(None)
    b.load_state_dict(saved)
    exchange(c, b, rand(300, 1))
    assert torch.equal(saved["residuals"][0], kept)  # b reused its own copy, not the caller's


@pytest.mark.parametrize(
    "spec", ["fp16", "bf16", "int8", "topk:0.1", "randomk:0.1", "sign", "powersgd:2", "none"]
)
def test_state_dict_resumes_exactly(spec: str) -> None:
    c = parse_compression(spec)
    if spec == "powersgd:2":
        c = error_feedback(powersgd(2, start_iter=1))
    params = [torch.empty(16, 12), torch.empty(12)]
    a = c.make_state(None)
    for t in range(3):
        exchange(c, a, rand(204, t), params=params)
    blob = io.BytesIO()
    torch.save(a.state_dict(), blob)
    blob.seek(0)
    b = c.make_state(None)
    b.load_state_dict(torch.load(blob, weights_only=True))
    for t in range(3, 5):
        g = rand(204, t)
        assert torch.equal(exchange(c, a, g, params=params), exchange(c, b, g, params=params))


def test_hooks_leave_the_global_rng_alone() -> None:
    torch.manual_seed(11)
    before = torch.get_rng_state()
    for spec in ["int8", "randomk:0.1", "powersgd:1"]:
        c = parse_compression(spec)
        state = c.make_state(None)
        for _ in range(12):
            exchange(c, state, rand(120, 0), params=[torch.empty(10, 12)])
    assert torch.equal(torch.get_rng_state(), before)


def test_error_feedback_rejects_a_state_that_does_not_report_what_it_sent() -> None:
    with pytest.raises(TypeError, match="sent"):
        error_feedback(ALLREDUCE).make_state(None)


def test_error_feedback_drops_a_residual_whose_bucket_changed_size() -> None:
    c = error_feedback(topk(0.1))
    state = c.make_state(None)
    exchange(c, state, rand(100, 0))
    x = rand(60, 1)
    out = exchange(c, state, x)  # a stale 100-element residual must not be added
    assert torch.equal(out, exchange(c, c.make_state(None), x))


def test_nominal_ratios_match_the_bytes_counted() -> None:
    n = 4096
    for spec in ["fp16", "bf16", "int8", "topk:0.01", "randomk:0.01", "sign", "none"]:
        c = parse_compression(spec)
        state = c.make_state(None)
        exchange(c, state, rand(n, 0))
        assert c.nominal_ratio is not None
        assert state.bytes_sent == pytest.approx(c.nominal_ratio * 4 * n, rel=0.01), spec
