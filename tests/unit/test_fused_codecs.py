"""The codecs' device kernels (``gradsync.compression.fused``), run here as plain torch ops on
the CPU, against the CPU path of the same codec: int4's and sign's bytes are the CPU path's,
int8's codes keep its guarantees with hashed noise, random-k's positions are one per stratum.
The compiled kernels on a GPU are compared with these in tests/e2e/test_gpu_compiled.py (the
compiler starts processes, which a unit test may not)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gradsync import compat
from gradsync.compression import fused, parse_compression
from gradsync.compression._wire import derive_seed
from gradsync.compression.int4 import Int4Codec
from gradsync.compression.int4 import quantize as int4_quantize
from gradsync.compression.int8 import Int8Codec
from gradsync.compression.sign import SignCodec, pack_signs

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

CPU = torch.device("cpu")
#: lengths around every chunk and byte boundary the kernels pad to
LENGTHS = (1, 7, 64, 1000, 1024, 5000, 100_003)


def _gradient(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen)
    x[::17] = 0.0  # zeros: signed as positive, and rows whose scale could be 0
    return x


F32 = torch.float32


class _Uncompiled(fused.Kernel):
    """A kernel that runs its function as plain torch ops, as a compiled one would run it."""

    def run(self, *args: Any) -> Any:
        return self.fn(*args)


def _uncompiled(fn: Callable[..., Any]) -> fused.Kernel:
    return _Uncompiled(fn)


def _seed(*parts: int, device: torch.device = CPU) -> tuple[torch.Tensor, torch.Tensor]:
    return fused.seed_words(derive_seed(*parts), device)


@pytest.mark.parametrize("n", LENGTHS)
def test_int4_kernels_send_the_cpu_paths_bytes_and_decode_as_it_does(n: int) -> None:
    x = _gradient(n)
    scale, packed = int4_quantize(x, 128)
    got_scale, got_packed = fused.int4_encode(x, 128)
    assert torch.equal(got_scale, scale) and torch.equal(got_packed, packed)
    decoded = Int4Codec(n, 128, torch.float32).decode([scale, packed], 0)
    assert torch.equal(fused.int4_decode(packed, scale, n, 128, torch.float32), decoded)
    out = torch.ones(n)
    assert fused.accumulate(_uncompiled(fused.int4_decode), out, -1.0, packed, scale, n, 128, F32)
    torch.testing.assert_close(out, 1 - decoded, rtol=0, atol=2**-22)


@pytest.mark.parametrize("n", LENGTHS)
def test_sign_kernels_send_the_cpu_paths_bits_and_decode_as_it_does(n: int) -> None:
    x = _gradient(n)
    x[1::19] = -0.0  # a signed zero counts as positive, as on the CPU path
    scale, packed = pack_signs(x, 64)
    got_scale, got_packed = fused.sign_encode(x, 64)
    assert torch.equal(got_packed, packed)
    # A sum per chunk: its order, and so its last bit, may differ from the CPU path's.
    torch.testing.assert_close(got_scale, scale, rtol=1e-6, atol=0)
    decoded = SignCodec(n, 64, torch.float32).decode([scale, packed], 0)
    assert torch.equal(fused.sign_decode(packed, scale, n, 64, torch.float32), decoded)
    out = decoded.clone()
    assert fused.accumulate(_uncompiled(fused.sign_decode), out, -1.0, packed, scale, n, 64, F32)
    assert torch.equal(out, torch.zeros(n))  # +-scale less itself: exact


@pytest.mark.parametrize("n", LENGTHS)
def test_int8_kernel_codes_are_within_one_step_and_reproducible_by_seed(n: int) -> None:
    x = _gradient(n)
    scale, codes = fused.int8_encode(x, 1024, *_seed(1, 2))
    reference_scale, _ = Int8Codec(n, 1024, (0,), torch.float32).encode(x, 0)
    assert torch.equal(scale, reference_scale)  # max |x| / 127, as the CPU path's
    assert codes.dtype == torch.int8 and codes.numel() == n
    decoded = fused.int8_decode(codes, scale, 1024, torch.float32)
    step = scale.repeat_interleave(1024)[:n]
    # Under one step, or exact where a chunk is all zeros (its scale 0).
    assert torch.all(((decoded - x).abs() < step) | ((step == 0) & (decoded == x)))
    assert torch.equal(fused.int8_encode(x, 1024, *_seed(1, 2))[1], codes)
    out = torch.ones(n)
    assert fused.accumulate(_uncompiled(fused.int8_decode), out, 1.0, codes, scale, 1024, F32)
    torch.testing.assert_close(out, 1 + decoded)


def test_int8_kernel_rounds_up_with_the_fractional_part_as_probability() -> None:
    # x / s = 38.1 everywhere (one element sets the scale): rounded up with probability 0.1.
    n, encodes = 1 << 16, 200
    x = torch.full((n,), 0.3)
    x[0] = 1.0
    ups = []
    for step in range(encodes):
        _, codes = fused.int8_encode(x, n, *_seed(7, 0, step))
        ups.append(float((codes[1:] == 39).double().mean()))
    mean = sum(ups) / encodes
    # 13,107,000 independent draws of probability 0.1: standard error 8.3e-5.
    assert abs(mean - 0.1) < 5 * math.sqrt(0.09 / (encodes * (n - 1)))
    assert len(set(ups)) > encodes // 2  # fresh noise per seed, not one fixed pattern


def test_int8_noise_bits_are_uniform_and_uncorrelated_between_neighbours() -> None:
    bits = fused.noise_bits(torch.arange(1 << 20), *_seed(3))
    u = (bits >> 16).double() / 2**16
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / u.numel())
    neighbours = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(neighbours)) < 5 / math.sqrt(u.numel())
    assert int((bits >> 16).unique().numel()) == 1 << 16


def test_randomk_kernels_gather_and_scatter_the_strata_positions() -> None:
    n, k = 10_007, 1_000
    x = _gradient(n)
    seed = _seed(4, 5)
    position, size = fused.strata(n, k, *seed)
    values = fused.randomk_gather(x, position, size, torch.float32)
    torch.testing.assert_close(values, x[position] * size)
    out = fused.randomk_scatter(values, position, n)
    assert torch.equal(out[position], values)
    assert int((out != 0).sum()) == int((values != 0).sum())


def _compiler(fails_with: BaseException | None = None) -> Callable[..., Any]:
    """A stand-in for torch.compile: the function itself, or one that raises ``fails_with``."""

    def compile(fn: Callable[..., Any], **_: Any) -> Callable[..., Any]:
        def compiled(*args: Any) -> Any:
            if fails_with is not None:
                raise fails_with
            return fn(*args)

        return compiled

    return compile


def test_a_kernel_that_cannot_be_compiled_warns_once_and_the_codec_takes_its_own_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cannot = compat.compiler_errors()[0]("no Triton here")
    monkeypatch.setattr(fused.torch, "compile", _compiler(cannot))
    kernel = fused.Kernel(fused.int4_encode)
    x = _gradient(1000)
    with pytest.warns(RuntimeWarning, match=r"int4_encode could not be compiled.*no Triton"):
        assert kernel.run(x, 128) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, and no second attempt
        assert kernel.run(x, 128) is None
    # A codec whose tensors take the device path gets the CPU path's bytes from its fallback.
    monkeypatch.setattr(fused, "on_device", lambda t: True)
    monkeypatch.setattr(fused, "INT4_ENCODE", kernel)
    parts = Int4Codec(1000, 128, torch.float32).encode(x, 0)
    assert torch.equal(parts[1], int4_quantize(x, 128)[1])


def test_an_error_of_the_kernel_itself_is_raised_not_taken_for_a_failed_compilation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Out of memory, say: falling back would hide it, and an accumulate that had written
    # part of its sum would be added twice.
    monkeypatch.setattr(fused.torch, "compile", _compiler(MemoryError("out of memory")))
    kernel = fused.Kernel(fused.int4_encode)
    with pytest.raises(MemoryError, match="out of memory"):
        kernel.run(_gradient(100), 128)
    assert not kernel.broken


def test_a_kernel_is_compiled_for_a_few_shapes_and_leaves_the_others_to_the_codec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fused.torch, "compile", _compiler())
    kernel = fused.Kernel(fused.int4_encode)
    for n in range(100, 100 + fused.MAX_SHAPES):
        assert kernel.run(_gradient(n), 128) is not None
    assert kernel.run(_gradient(100), 128) is not None  # a shape it has
    assert kernel.run(_gradient(99), 128) is None  # one too many: the codec's own ops


def test_no_compilation_is_attempted_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.compile was called")

    monkeypatch.setattr(fused.torch, "compile", refuse)
    before = fused.set_compiling(False)
    try:
        assert fused.Kernel(fused.int4_encode).run(_gradient(100), 128) is None
    finally:
        fused.set_compiling(before)


# --- every codec through its device path, the kernels run as plain torch ops ---------------


@pytest.fixture
def device_path(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """CPU tensors take the codecs' device path, each kernel running its function uncompiled;
    the names of the kernels called, in order."""
    called: list[str] = []

    def run(kernel: fused.Kernel, *args: Any) -> Any:
        called.append(kernel.fn.__name__)
        return kernel.fn(*args)

    monkeypatch.setattr(fused, "on_device", lambda t: True)
    monkeypatch.setattr(fused.Kernel, "run", run)
    return called


@pytest.mark.parametrize("spec", ["int8", "int4", "sign", "randomk:0.25"])
def test_every_codec_call_into_its_kernels_decodes_what_it_encoded(
    spec: str, device_path: list[str]
) -> None:
    n = 5000
    x = _gradient(n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        codec = parse_compression(spec).codec(n, torch.float32, [[n]], 3)
    parts = codec.encode(x, 7)
    decoded = codec.decode(parts, 7)
    out = torch.ones(n)
    if hasattr(codec, "accumulate"):
        codec.accumulate(parts, out, 7)
        torch.testing.assert_close(out, 1 + decoded)
    if hasattr(codec, "contribution"):
        left = codec.contribution(parts, 7).subtract_from(decoded.clone())
        torch.testing.assert_close(left, torch.zeros(n), atol=1e-6, rtol=0)
    if spec == "randomk:0.25":
        # The codec's key is derive_seed(seed 0, stream 3); each step's draw adds the step.
        position, size = fused.strata(n, n // 4, *_seed(derive_seed(0, 3), 7))
        torch.testing.assert_close(decoded[position], x[position] * size)
        rest = torch.ones(n, dtype=torch.bool)
        rest[position] = False
        assert not decoded[rest].any()
    else:
        step = (x.abs().max() / (7 if spec == "int4" else 127)).item()
        assert float((decoded - x).abs().max()) <= (step if spec != "sign" else x.abs().max())
    assert any(name.endswith("_encode") or name == "randomk_gather" for name in device_path)
    assert any("decode" in name or name == "randomk_scatter" for name in device_path)
