"""One codec per compressor family (issue 12, item 5): every valid spec has a hook and a codec.

The codec is the family's encode/decode of a flat tensor (``Compressor.codec``, defined next to
the hook); parameter-server pushes frame it, and the hook builds its collective around it. These
tests take every valid form, check both halves exist, and round-trip the codec through the
packed bytes within the family's documented error bound, decoding on a separately built codec
as a server would.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import pytest
import torch

from gradsync.compression import (
    VALID_FORMS,
    Compressor,
    FlatBucket,
    allreduce_hook,
    error_feedback,
    parse_compression,
    topk,
)
from gradsync.compression._wire import from_payload, to_payload
from gradsync.compression.push import make_push_codec
from gradsync.errors import UsageError

pytestmark = pytest.mark.unit

#: one instance of every form VALID_FORMS names.
FORMS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "sign",
    "topk:0.1",
    "randomk:0.1",
    "powersgd:2",
    "sparseloco",
]
#: parse_compression wraps these in error feedback (sparseloco keeps its own accumulator)
BIASED = {"int4", "sign", "topk:0.1", "powersgd:2"}

# Two matrices PowerSGD compresses, a bias, and a 3x4 matrix too small to save 2x at rank 2.
SHAPES = [[64, 48], [48], [3, 4], [32, 5, 6]]
N = sum(math.prod(s) for s in SHAPES)  # 4092: not a multiple of 8, 64 or 1024
STREAM, STEP = 7, 3


def families(forms: str) -> set[str]:
    """The compressor names in a 'valid forms' sentence: 'topk:FRACTION (...)' -> 'topk'."""
    return set(re.findall(r"(?:^|, )([a-z][a-z0-9]*)", forms))


def gradient(seed: int) -> torch.Tensor:
    """Both signs, magnitudes from 1e-3 to 10 (inside fp16's normal range), ragged chunks."""
    r = torch.randn(N, generator=torch.Generator().manual_seed(seed))
    return torch.where(r >= 0, 1.0, -1.0) * (0.01 + r.abs()) * torch.linspace(0.1, 10.0, N)


def low_rank(seed: int) -> torch.Tensor:
    """A gradient whose compressible matrices have rank 2: PowerSGD:2 must reproduce it."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for shape in SHAPES:
        size = math.prod(shape)
        if len(shape) >= 2 and size > 12:
            rows, cols = shape[0], size // shape[0]
            m = torch.randn(rows, 2, generator=gen) @ torch.randn(2, cols, generator=gen)
            parts.append(m.reshape(-1))
        else:
            parts.append(torch.randn(size, generator=gen))
    return torch.cat(parts)


def round_trip(c: Compressor, x: torch.Tensor) -> torch.Tensor:
    """Encode on one codec, pack to bytes, unpack and decode on another built the same way."""
    assert c.codec is not None
    encoder = c.codec(N, x.dtype, SHAPES, STREAM)
    decoder = c.codec(N, x.dtype, SHAPES, STREAM)
    pieces = encoder.encode(x.clone(), STEP)
    assert [(p.dtype, p.numel()) for p in pieces] == list(encoder.layout)
    assert list(decoder.layout) == list(encoder.layout)
    out = decoder.decode(from_payload(to_payload(pieces), decoder.layout), STEP)
    assert out.shape == (N,) and out.dtype == torch.float32
    return out


def _exact(x: torch.Tensor, out: torch.Tensor) -> None:
    assert torch.equal(out, x)


def _half(half: torch.dtype, eps: float) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def check(x: torch.Tensor, out: torch.Tensor) -> None:
        assert torch.equal(out, x.to(half).float())
        assert torch.all((out - x).abs() <= eps * x.abs())  # half a unit in the last place

    return check


def _int8(x: torch.Tensor, out: torch.Tensor) -> None:
    # Below one quantization step s = max|x| / 127 of the element's 1024-element chunk.
    rows = torch.nn.functional.pad(x.abs(), (0, (-N) % 1024)).view(-1, 1024)
    step = (rows.amax(1) / 127).repeat_interleave(1024)[:N]
    assert torch.all((out - x).abs() <= step * (1 + 1e-6))


def _int4(x: torch.Tensor, out: torch.Tensor) -> None:
    # Rounded to nearest: within half a step s = max|x| / 7 of the element's 128-element chunk.
    rows = torch.nn.functional.pad(x.abs(), (0, (-N) % 128)).view(-1, 128)
    step = (rows.amax(1) / 7).repeat_interleave(128)[:N]
    assert torch.all((out - x).abs() <= step / 2 * (1 + 1e-6))


def _sign(x: torch.Tensor, out: torch.Tensor) -> None:
    # scale * sign(x) per 64-element chunk, scale = mean|x|: the error's energy is exactly
    # |x|^2 - |x|_1^2 / c per chunk, at most (1 - 1/c) |x|^2.
    assert torch.equal(out >= 0, x >= 0)
    for start in range(0, N, 64):
        xs, got = x[start : start + 64].double(), out[start : start + 64].double()
        c = xs.numel()
        torch.testing.assert_close(got.abs(), xs.abs().mean().expand(c), rtol=1e-6, atol=0)
        energy = float((got - xs).square().sum())
        assert energy == pytest.approx(float(xs.square().sum() - xs.abs().sum() ** 2 / c))
        assert energy <= (1 - 1 / c) * float(xs.square().sum()) * (1 + 1e-6)


def _topk(x: torch.Tensor, out: torch.Tensor) -> None:
    k = math.ceil(0.1 * N)
    top = x.abs().topk(k).indices
    assert torch.equal(out[top], x[top]) and int((out != 0).sum()) == k
    # What is dropped is the smallest n - k: at most (1 - k/n) of the energy.
    assert (out - x).square().sum() <= (1 - k / N) * x.square().sum()


def _randomk(x: torch.Tensor, out: torch.Tensor) -> None:
    k = math.ceil(0.1 * N)
    kept = out != 0
    assert int(kept.sum()) == k
    # One position in each of k strata, scaled by the stratum's size: unbiased (kept w.p.
    # one over that size). 410 does not divide 4092, so the sizes are 9 and 10.
    starts = torch.arange(k + 1) * N // k
    stratum = torch.searchsorted(starts, kept.nonzero().view(-1), right=True) - 1
    assert torch.equal(stratum, torch.arange(k))
    size = (starts[1:] - starts[:-1]).to(x.dtype)
    torch.testing.assert_close(out[kept], x[kept] * size)


def _powersgd(x: torch.Tensor, out: torch.Tensor) -> None:
    # Rank-2 matrices come back exactly (to float rounding); the rest travels uncompressed.
    torch.testing.assert_close(out, x, rtol=1e-4, atol=1e-4)
    plain = slice(64 * 48, 64 * 48 + 48 + 12)
    assert torch.equal(out[plain], x[plain])


def _sparseloco(x: torch.Tensor, out: torch.Tensor) -> None:
    # One chunk of 4096 holds all N: its k = ceil(0.02 N) largest magnitudes, signs kept, each
    # at one of two levels (see tests/unit/test_sparseloco.py for the levels themselves).
    k = math.ceil(0.02 * N)
    sent = out.nonzero().squeeze(1)
    assert torch.equal(sent, x.abs().topk(k).indices.sort().values)
    assert torch.equal(out[sent].sign(), x[sent].sign())
    assert out[sent].abs().unique().numel() <= 2


BOUNDS: dict[str, tuple[Callable[[int], torch.Tensor], Callable[..., None]]] = {
    "none": (gradient, _exact),
    "fp16": (gradient, _half(torch.float16, 2**-11)),
    "bf16": (gradient, _half(torch.bfloat16, 2**-8)),
    "int8": (gradient, _int8),
    "int4": (gradient, _int4),
    "sign": (gradient, _sign),
    "topk:0.1": (gradient, _topk),
    "randomk:0.1": (gradient, _randomk),
    "powersgd:2": (low_rank, _powersgd),
    "sparseloco": (gradient, _sparseloco),
}


def test_the_forms_here_are_every_form_the_spec_accepts() -> None:
    assert families(VALID_FORMS) == {form.partition(":")[0] for form in FORMS}
    assert set(BOUNDS) == set(FORMS)


@pytest.mark.parametrize("form", FORMS)
def test_every_valid_form_has_a_hook_and_a_codec_that_round_trips_within_its_bound(
    form: str,
) -> None:
    c = parse_compression(form)
    assert callable(c.hook), form
    assert c.codec is not None, f"{form} has no codec"
    assert c.feedback == (form in BIASED)
    make, check = BOUNDS[form]
    x = make(STREAM)
    check(x, round_trip(c, x))
    # The push path frames the same codec: same bytes as the codec's pieces, packed.
    push = make_push_codec(c, N, torch.float32, shapes=SHAPES, seed=STREAM)
    pieces = c.codec(N, torch.float32, SHAPES, STREAM).encode(x.clone(), STEP)
    assert torch.equal(push.encode(x, STEP), to_payload(pieces))


def test_powersgd_codec_never_grows_a_full_rank_matrix() -> None:
    # On a full-rank matrix one power iteration is a projection, P P^T M: rank 2, no longer.
    c = parse_compression("powersgd:2")
    x = gradient(11)
    out = round_trip(c, x)
    m, approx = x[: 64 * 48].view(64, 48), out[: 64 * 48].view(64, 48)
    assert torch.linalg.matrix_rank(approx) == 2
    assert approx.norm() <= m.norm() * (1 + 1e-5)


@pytest.mark.parametrize("form", ["none", "fp16", "bf16", "sign", "topk:0.1", "sparseloco"])
def test_on_one_rank_the_hook_returns_its_codecs_round_trip(one_rank: None, form: str) -> None:
    # With one rank the hook's mean is this rank's decoded payload. The deterministic families
    # must give exactly the codec's round trip; a hook with its own encoding would not.
    c = parse_compression(form)
    x = gradient(5)
    hooked = c.hook(c.make_state(None), FlatBucket(x.clone())).wait()
    assert c.codec is not None
    codec = c.codec(N, torch.float32, [[N]], 0)
    assert torch.equal(hooked, codec.decode(codec.encode(x.clone(), 0), 0))


def test_a_compressor_without_a_codec_is_refused_with_a_clear_message() -> None:
    hook_only = Compressor(spec="mine", make_state=lambda group: None, hook=allreduce_hook)
    assert hook_only.codec is None and not hook_only.feedback
    with pytest.raises(UsageError, match=r"compression 'mine' has no codec") as info:
        make_push_codec(hook_only, N, torch.float32)
    assert "parameter-server pushes" in str(info.value) and VALID_FORMS in str(info.value)
    # Error feedback wraps the codec it is given: none stays none.
    wrapped = error_feedback(dataclasses.replace(topk(0.1), codec=None))
    assert wrapped.feedback
    with pytest.raises(UsageError, match=r"'topk:0.1' has no codec"):
        make_push_codec(wrapped, N, torch.float32)
