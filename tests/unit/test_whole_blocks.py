"""Codecs on a device without cache blocking (a GPU) work a bucket as one block. That path is
checked here on the CPU, with the CPU treated as such a device: the blocking is a matter of
speed, so every deterministic codec must give the same bytes either way, and int8, whose
rounding noise is drawn per element there instead of from a table, must stay within a step."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

from gradsync.compression import _wire, parse_compression
from gradsync.compression.errorfeedback import _add_and_keep

# A resized output (a scratch buffer sized for cache blocks) warns: that is a failure here.
pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("error")]

SIZES = (70_001, 600_003)  # more than one cache block, and a ragged last chunk
DETERMINISTIC = ("int4", "sign", "topk:0.01", "fp16")


@pytest.fixture
def whole_blocks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_wire, "_CACHE_BLOCKED", set())
    assert list(_wire.blocks(600_003, 64, torch.device("cpu"))) == [(0, 600_003)]
    yield


def _gradient(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g).mul_(-6).exp_()


def _codec(spec: str, n: int) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        factory = parse_compression(spec).codec
    assert factory is not None
    return factory(n, torch.float32, [[n]], 0)


def _round_trip(spec: str, x: torch.Tensor) -> list[torch.Tensor]:
    codec = _codec(spec, x.numel())
    parts = codec.encode(x, 5)  # type: ignore[attr-defined]
    return [*parts, codec.decode(parts, 5)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("spec", DETERMINISTIC)
@pytest.mark.parametrize("n", SIZES)
def test_a_deterministic_codec_gives_the_same_bytes_in_one_block(
    spec: str, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _gradient(n, 1)
    blocked = _round_trip(spec, x)
    monkeypatch.setattr(_wire, "_CACHE_BLOCKED", set())
    whole = _round_trip(spec, x)
    assert all(torch.equal(a, b) for a, b in zip(blocked, whole, strict=True))


@pytest.mark.parametrize("n", SIZES)
def test_int8_in_one_block_rounds_each_element_to_a_neighbouring_step(
    n: int, whole_blocks: None
) -> None:
    x = _gradient(n, 2)
    scale, codes, decoded = _round_trip("int8", x)
    step = scale.repeat_interleave(_codec("int8", n).chunk)[:n]  # type: ignore[attr-defined]
    assert codes.abs().max() <= 127
    assert torch.all((decoded - x).abs() <= step * (1 + 1e-6))
    # Stochastic rounding: up about as often as down, so no drift in the mean.
    error = (decoded - x) / step
    assert abs(float(error.mean())) < 0.01


def test_error_feedback_adds_the_same_in_one_block(whole_blocks: None) -> None:
    buf, residual = _gradient(600_003, 3), _gradient(600_003, 4)
    expected = buf + residual
    out = _add_and_keep(buf.clone(), residual.clone())
    assert torch.equal(out, expected)
