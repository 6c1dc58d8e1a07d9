"""Push codecs (gradsync/compression/push.py): encode on a worker, decode on a server.

Pure logic, no process group: every test builds a worker codec and a separate server codec with
the same arguments, so decoding provably needs nothing but the payload, the step and the seed.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from gradsync.compression import int8, topk
from gradsync.compression.push import PushCodec, make_push_codec
from gradsync.compression.sign import DEFAULT_CHUNK as DEFAULT_SIGN_CHUNK
from gradsync.errors import UsageError

pytestmark = pytest.mark.unit

ALL_SPECS = ["none", "fp16", "bf16", "int8", "topk:0.1", "randomk:0.25", "sign", "powersgd:2"]
EF_SPECS = ["topk:0.1", "sign", "powersgd:2"]
# A shard of four parameters: two compressible matrices, a bias, and a matrix too small to
# save 2x at rank 2 (3 x 4 = 12 < 2 * (3 + 4) * 2), which PowerSGD must send plain.
SHAPES = [torch.Size([64, 48]), torch.Size([48]), torch.Size([3, 4]), torch.Size([32, 5, 6])]
N = sum(s.numel() for s in SHAPES)  # 3072 + 48 + 12 + 960 = 4092: not a multiple of 8 or 1024


def rand(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def pair(spec: str, n: int = N, seed: int = 7) -> tuple[PushCodec, PushCodec]:
    """(worker codec, server codec) built with the same arguments."""
    shapes = SHAPES if n == N else None
    worker = make_push_codec(spec, n, torch.float32, shapes=shapes, seed=seed)
    return worker, make_push_codec(spec, n, torch.float32, shapes=shapes, seed=seed)


def expected_bytes(spec: str, n: int) -> int:
    name, _, arg = spec.partition(":")
    chunks = math.ceil(n / 1024)
    if name == "none":
        return 4 * n
    if name in ("fp16", "bf16"):
        return 2 * n
    if name == "int8":
        return n + 4 * chunks
    if name == "sign":
        return math.ceil(n / 8) + 4 * math.ceil(n / DEFAULT_SIGN_CHUNK)
    k = math.ceil(float(arg) * n)
    if name == "topk":
        return 8 * k
    if name == "randomk":
        return 4 * k
    assert name == "powersgd"
    r = int(arg)
    # P + Q for [64, 48] and [32, 30]; the bias and the 3x4 matrix (60 elements) go plain.
    return 4 * ((64 + 48) * r + (32 + 30) * r + 48 + 12)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_payload_size_is_fixed_and_matches_the_documented_bytes(spec: str) -> None:
    worker, server = pair(spec)
    assert worker.payload_dtype == torch.uint8
    assert worker.payload_numel == server.payload_numel == expected_bytes(spec, N)
    for step in range(3):
        payload = worker.encode(rand(N, step) * (step + 1), step)
        assert payload.dtype == torch.uint8 and payload.dim() == 1
        assert payload.numel() == worker.payload_numel
        assert server.decode(payload, step).shape == (N,)
    assert worker.bytes_sent == 3 * worker.payload_numel
    assert worker.nominal_ratio == pytest.approx(worker.payload_numel / (4 * N))


@pytest.mark.parametrize(
    ("spec", "ratio"),
    [
        ("none", 1.0),
        ("fp16", 0.5),
        ("bf16", 0.5),
        ("int8", 0.2510),
        ("topk:0.01", 0.02),
        ("randomk:0.01", 0.01),
        ("sign", 0.0469),
        ("powersgd:4", 0.0090),
    ],
)
def test_ratio_against_fp32_on_a_large_shard(spec: str, ratio: float) -> None:
    # Sizes only: building a codec allocates nothing per element.
    n = 1_000_000
    codec = make_push_codec(spec, n, torch.float32, shapes=[[1000, 999], [1000]])
    assert codec.nominal_ratio == pytest.approx(ratio, abs=1e-4)


def test_none_is_exact_and_keeps_the_dtype() -> None:
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = rand(N, 0).to(dtype)
        worker = make_push_codec("none", N, dtype)
        server = make_push_codec(None, N, dtype)
        out = server.decode(worker.encode(x, 0), 0)
        assert out.dtype == dtype and torch.equal(out, x)
        assert worker.payload_numel == N * x.element_size()


@pytest.mark.parametrize(("spec", "half"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_precision_round_trip_is_the_cast(spec: str, half: torch.dtype) -> None:
    x = rand(N, 1) * 100
    worker, server = pair(spec)
    out = server.decode(worker.encode(x, 0), 0)
    assert torch.equal(out, x.to(half).float())
    eps = 2**-11 if half == torch.float16 else 2**-8
    assert torch.all((out - x).abs() <= eps * x.abs())


def test_int8_error_is_below_one_step_per_chunk() -> None:
    x = rand(N, 2) * torch.linspace(0.01, 10, N)  # chunks with very different scales
    worker, server = pair("int8")
    out = server.decode(worker.encode(x, 0), 0)
    pad = (-N) % 1024
    step = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, 1024).amax(1) / 127
    bound = step.repeat_interleave(1024)[:N]
    assert torch.all((out - x).abs() <= bound * (1 + 1e-6))


def test_topk_sends_the_largest_values_exactly() -> None:
    x = rand(N, 3)
    worker, server = pair("topk:0.1")
    out = server.decode(worker.encode(x, 0), 0)
    k = math.ceil(0.1 * N)
    top = x.abs().topk(k).indices
    assert torch.equal(out[top], x[top])
    assert int((out != 0).sum()) == k


def test_randomk_decodes_k_scaled_values_without_sending_indices() -> None:
    x = rand(N, 4)
    worker, server = pair("randomk:0.25")
    payload = worker.encode(x, 5)
    out = server.decode(payload, 5)
    k = math.ceil(0.25 * N)
    chosen = out != 0
    assert int(chosen.sum()) == k
    torch.testing.assert_close(out[chosen], x[chosen] * (N / k))
    # The indices come from (seed, step): another step or another worker's seed draws others.
    assert not torch.equal(server.decode(payload, 6), out)
    assert not torch.equal(pair("randomk:0.25", seed=8)[1].decode(payload, 5), out)


def test_sign_decodes_the_signs_times_the_mean_magnitude_per_chunk() -> None:
    x = rand(N, 5)
    worker, server = pair("sign")
    out = server.decode(worker.encode(x, 0), 0)
    assert torch.equal(out >= 0, x >= 0)
    chunk = DEFAULT_SIGN_CHUNK
    for start in range(0, N, chunk):
        piece = slice(start, min(N, start + chunk))
        mean = x[piece].abs().mean()
        torch.testing.assert_close(out[piece].abs(), mean.expand(out[piece].numel()))


def test_powersgd_reproduces_low_rank_matrices_and_sends_the_rest_exactly() -> None:
    # One local power iteration spans the column space of a rank-2 matrix exactly.
    gen = torch.Generator().manual_seed(6)
    parts = []
    for shape in SHAPES:
        if len(shape) >= 2 and shape.numel() > 12:
            rows, cols = shape[0], shape.numel() // shape[0]
            low = torch.randn(rows, 2, generator=gen) @ torch.randn(2, cols, generator=gen)
            parts.append(low.reshape(-1))
        else:
            parts.append(torch.randn(shape.numel(), generator=gen))
    x = torch.cat(parts)
    worker, server = pair("powersgd:2")
    out = server.decode(worker.encode(x, 0), 0)
    torch.testing.assert_close(out, x, rtol=1e-4, atol=1e-4)
    plain = slice(64 * 48, 64 * 48 + 48 + 12)
    assert torch.equal(out[plain], x[plain])


def test_powersgd_recovers_after_an_all_zero_gradient() -> None:
    # The PS zero-fills gradients that are None; a zero step leaves Q = M^T P = 0, and the
    # next P = M Q = 0 must still orthonormalize to a basis, or the matrix would never move.
    n = 64 * 48
    worker = make_push_codec("powersgd:2", n, torch.float32, shapes=[[64, 48]])
    server = make_push_codec("powersgd:2", n, torch.float32, shapes=[[64, 48]])
    server.decode(worker.encode(torch.zeros(n), 0), 0)
    g = (rand(128, 11).view(64, 2) @ rand(96, 12).view(2, 48)).reshape(-1)
    sent = server.decode(worker.encode(g, 1), 1) + server.decode(worker.encode(0 * g, 2), 2)
    torch.testing.assert_close(sent, g, rtol=1e-4, atol=1e-4)


def test_powersgd_without_shapes_sends_the_shard_plain() -> None:
    codec = make_push_codec("powersgd:4", N, torch.float32)
    assert codec.payload_numel == 4 * N


@pytest.mark.parametrize("spec", EF_SPECS)
def test_error_feedback_conserves_mass(spec: str) -> None:
    worker, server = pair(spec)
    inputs = [rand(N, 100 + t) for t in range(12)]
    decoded = [server.decode(worker.encode(g, t), t) for t, g in enumerate(inputs)]
    assert worker.residual is not None and server.residual is None
    total_in = torch.stack(inputs).sum(0)
    total_out = torch.stack(decoded).sum(0) + worker.residual
    torch.testing.assert_close(total_out, total_in, rtol=0, atol=1e-4)
    # The residual is what is left: the next push of a zero gradient carries it.
    nxt = server.decode(worker.encode(torch.zeros(N), 12), 12)
    assert torch.linalg.vector_norm(nxt) > 0


def test_unbiased_codecs_keep_no_residual_and_a_compressor_object_keeps_its_options() -> None:
    for spec in ("int8", "randomk:0.25", "fp16"):
        worker, _ = pair(spec)
        worker.encode(rand(N, 0), 0)
        assert worker.residual is None
    plain_topk = make_push_codec(topk(0.1), N, torch.float32)
    plain_topk.encode(rand(N, 0), 0)
    assert plain_topk.residual is None  # topk(0.1) has no error feedback; "topk:0.1" does
    fine = make_push_codec(int8(chunk=256), N, torch.float32)
    assert fine.payload_numel == N + 4 * math.ceil(N / 256)


def test_int8_is_unbiased_over_many_seeds() -> None:
    # Each decoded element lies in [x - s, x + s) and takes one of two values s apart, so by
    # Hoeffding the mean of S independent draws is within 3.5 s / sqrt(S) of its expectation
    # except with probability 2 exp(-2 * 3.5**2) = 5e-11 per element (2e-7 for all of them).
    # The overall mean of (error / s), over n * S draws, gets a bound sqrt(n) times tighter.
    n, draws = 2048, 1000
    x = rand(n, 9) * torch.linspace(0.1, 3, n)
    worker, server = pair("int8", n=n)
    total = torch.zeros(n, dtype=torch.float64)
    for step in range(draws):
        total += server.decode(worker.encode(x, step), step).double()
    mean = (total / draws).float()
    s = x.abs().view(-1, 1024).amax(1).repeat_interleave(1024) / 127
    assert torch.all((mean - x).abs() <= 3.5 * s / math.sqrt(draws))
    assert abs(float(((mean - x) / s).mean())) <= 4 / math.sqrt(n * draws)


def test_randomk_is_unbiased_over_many_seeds() -> None:
    # Element i decodes to x_i * n/k with probability k/n, else 0. Its inclusion frequency over
    # S steps is within 3.5 / sqrt(S) of k/n except with probability 5e-11 per element
    # (Hoeffding), so the mean decode is within (n/k) * 3.5 / sqrt(S) * |x_i| of x_i.
    n, draws, fraction = 2048, 1500, 0.25
    x = rand(n, 10)
    worker, server = pair("randomk:0.25", n=n)
    total = torch.zeros(n, dtype=torch.float64)
    for step in range(draws):
        total += server.decode(worker.encode(x, step), step).double()
    mean = (total / draws).float()
    assert torch.all((mean - x).abs() <= (1 / fraction) * 3.5 / math.sqrt(draws) * x.abs())
    # Exactly k elements are kept per step, so the average of mean_i / x_i over i is exactly
    # the scale times k/n: 1 when the scale is n/k (not a statistical check).
    assert float((mean.double() / x.double()).mean()) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_state_dict_round_trip_gives_identical_next_payloads(spec: str) -> None:
    worker, _ = pair(spec)
    for t in range(3):
        worker.encode(rand(N, 200 + t), t)
    buf = io.BytesIO()
    torch.save(worker.state_dict(), buf)
    buf.seek(0)
    resumed, _ = pair(spec)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for t in range(3, 5):
        g = rand(N, 200 + t)
        assert torch.equal(worker.encode(g, t), resumed.encode(g, t))


def test_state_of_another_codec_is_refused() -> None:
    worker, _ = pair("topk:0.1")
    other, _ = pair("sign")
    with pytest.raises(UsageError, match="'topk:0.1'"):
        other.load_state_dict(worker.state_dict())


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("topk:1.5", "outside"),
        ("powersgd:0", "at least 1"),
        ("gzip", "unknown compressor"),
        ("randomk", "needs a fraction"),
        ("int8:3", "takes no argument"),
    ],
)
def test_bad_specs_raise_usage_error_naming_the_valid_forms(spec: str, match: str) -> None:
    with pytest.raises(UsageError, match=match) as info:
        make_push_codec(spec, N, torch.float32)
    assert repr(spec) in str(info.value) and "valid forms" in str(info.value)


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(UsageError, match="shapes"):
        make_push_codec("powersgd:2", N + 1, torch.float32, shapes=SHAPES)
    with pytest.raises(UsageError, match="floating-point"):
        make_push_codec("int8", N, torch.int64)
    codec = make_push_codec("sign", N, torch.float32)
    with pytest.raises(ValueError, match=f"{N} elements"):
        codec.encode(torch.zeros(N - 1), 0)
    with pytest.raises(ValueError, match="payload"):
        codec.decode(torch.zeros(3, dtype=torch.uint8), 0)


def test_an_empty_shard_sends_an_empty_payload() -> None:
    for spec in ALL_SPECS:
        codec = make_push_codec(spec, 0, torch.float32, shapes=[])
        payload = codec.encode(torch.zeros(0), 0)
        assert codec.payload_numel == payload.numel() == 0
        assert codec.decode(payload, 0).numel() == 0
