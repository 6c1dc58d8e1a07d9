"""The codecs' device kernels compiled by torch.compile for the CPU, against the same functions
run as torch ops: what CI can check of the compiled kernels without a GPU. A compiler that
miscompiles a form on the CPU may well do so on a GPU; two forms that did here are no longer
used (``fused.scaled``, ``fused.accumulate``). e2e, not unit: Inductor runs a C++ compiler as
a process."""

from __future__ import annotations

import shutil

import pytest
import torch

from gradsync.compression import fused
from gradsync.compression._wire import derive_seed

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not (shutil.which("c++") or shutil.which("g++")), reason="Inductor needs a C++ compiler"
    ),
]

#: a single short chunk, and short last chunks of 1,024 (int8), 128 (int4) and 64 (sign)
LENGTHS = (7, 5000, 100_003)
F32 = torch.float32


def _gradient(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen)
    x[::17] = 0.0
    return x


def _compiled(fn: object, *args: object) -> object:
    got = fused.Kernel(fn).run(*args)  # type: ignore[arg-type]
    assert got is not None, f"{fn} was not compiled"
    return got


@pytest.mark.parametrize("n", LENGTHS)
def test_every_kernel_compiled_for_the_cpu_gives_what_its_torch_ops_give(n: int) -> None:
    x = _gradient(n)
    seed = fused.seed_words(derive_seed(9), torch.device("cpu"))
    for encode, decode, chunk in (
        (fused.int4_encode, fused.int4_decode, 128),
        (fused.sign_encode, fused.sign_decode, 64),
    ):
        scale, packed = encode(x, chunk)
        got_scale, got_packed = _compiled(encode, x, chunk)  # type: ignore[misc]
        assert torch.equal(got_packed, packed), encode.__name__
        torch.testing.assert_close(got_scale, scale, rtol=1e-6, atol=0)
        expected = decode(packed, scale, n, chunk, F32)
        assert torch.equal(_compiled(decode, packed, scale, n, chunk, F32), expected)
    scale, codes = fused.int8_encode(x, 1024, *seed)
    got_scale, got_codes = _compiled(fused.int8_encode, x, 1024, *seed)  # type: ignore[misc]
    torch.testing.assert_close(got_scale, scale, rtol=2**-23, atol=0)
    assert int((got_codes.int() - codes.int()).abs().max()) <= 1
    expected = fused.int8_decode(codes, scale, 1024, F32)
    assert torch.equal(_compiled(fused.int8_decode, codes, scale, 1024, F32), expected)
    position, size = fused.strata(n, max(1, n // 100), *seed)
    values = fused.randomk_gather(x, position, size, F32)
    assert torch.equal(_compiled(fused.randomk_gather, x, position, size, F32), values)
    scattered = fused.randomk_scatter(values, position, n)
    assert torch.equal(_compiled(fused.randomk_scatter, values, position, n), scattered)


@pytest.mark.parametrize("n", LENGTHS)
def test_an_accumulate_through_a_compiled_decode_adds_every_chunk(n: int) -> None:
    x = _gradient(n)
    scale, codes = fused.int8_encode(x, 1024, *fused.seed_words(3, torch.device("cpu")))
    for sign in (1.0, -1.0):
        out = torch.ones(n)
        assert fused.accumulate(fused.Kernel(fused.int8_decode), out, sign, codes, scale, 1024, F32)
        expected = torch.ones(n).add_(fused.int8_decode(codes, scale, 1024, F32), alpha=sign)
        assert torch.equal(out, expected)
