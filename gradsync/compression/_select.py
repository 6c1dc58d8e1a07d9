"""Selection kernels for the sparsifiers (``sparse.py``): which k of n elements to send.

:func:`top_magnitudes` is topk's: the k largest magnitudes, found through a threshold estimated
from a fixed sample instead of a selection over all n: a few passes over memory where
``torch.topk`` cost 10x more on one core (issue 16). randomk's positions are
``fused.strata``.
"""

from __future__ import annotations

import functools
import math

import torch

from gradsync.compression._wire import block_elements, blocks

#: Below this many elements, or when k is more than 1/SPARSE_BELOW of them, ``torch.topk``
#: is as quick as the threshold search and is used directly.
SMALL = 1 << 16
SPARSE_BELOW = 8
#: Elements drawn to estimate the threshold. More bracket the k-th largest more tightly (1.2k
#: candidates at 65,536 against 1.4k here, F = 0.01) but cost more than they save: 6M elements
#: took the same time with either, and 1M took 30% longer with 65,536.
SAMPLE = 1 << 14


@functools.lru_cache(maxsize=8)
def _sample_positions(numel: int, device: torch.device) -> torch.Tensor:
    # Fixed positions, the same on every call and rank: the selection must not depend on an RNG,
    # and a stride would alias with a matrix's columns (one large column, sampled every time).
    gen = torch.Generator().manual_seed(numel)
    return torch.randint(numel, (SAMPLE,), generator=gen).sort().values.to(device)


def _threshold(x: torch.Tensor, k: int) -> float | None:
    """A magnitude that, judging from a sample, at least ``k`` elements of ``|x|`` reach but
    not many more (None: the sample cannot tell, e.g. k is too close to n)."""
    sample = x[_sample_positions(x.numel(), x.device)].abs()
    expected = k * SAMPLE / x.numel()
    # Aim about 4 standard deviations plus 3% above the expected rank in the sample, so that
    # falling short of k (and searching again with torch.topk) is rare.
    rank = math.ceil(expected * 1.03 + 4 * math.sqrt(expected) + 8)
    if rank >= SAMPLE:
        return None
    return float(sample.kthvalue(SAMPLE - rank + 1).values)


def _just_below(t: float, dtype: torch.dtype) -> float | None:
    """The largest value of ``dtype`` below ``t`` (> 0), or None where that cannot be had."""
    if dtype not in (torch.float32, torch.float64) or not 0 < t < math.inf:
        return None
    here = torch.tensor(t, dtype=dtype)
    return float(torch.nextafter(here, torch.zeros((), dtype=dtype)))


def _reaching(x: torch.Tensor, t: float) -> torch.Tensor:
    """Ascending positions where ``|x| >= t``, or is NaN (as torch.topk ranks NaN largest)."""
    n = x.numel()
    hit = torch.empty(-(-n // 8) * 8, dtype=torch.bool, device=x.device)
    hit[n:] = False
    scratch = torch.empty(min(n, block_elements(x.device)), dtype=x.dtype, device=x.device)
    below = _just_below(t, x.dtype)
    for start, stop in blocks(n, device=x.device):
        # A block at a time into one reused buffer: no bucket-sized temporary.
        part = scratch[: stop - start]
        if below is not None:
            # hardshrink keeps x where |x| > below, i.e. |x| >= t, NaN included, and writes 0
            # elsewhere: nonzero exactly at the hits, which the copy to bool marks. Two passes
            # at memory speed, against abs and a comparison into bools, which torch does not
            # vectorize (3x the time on one core).
            torch.ops.aten.hardshrink.out(x[start:stop], below, out=part)
            hit[start:stop].copy_(part)
        else:
            torch.lt(torch.abs(x[start:stop], out=part), t, out=hit[start:stop])
            hit[start:stop].logical_not_()
    # nonzero over n bools costs as much as the rest of the encode: find the 8-byte words
    # with a hit first (n/8 of them), then the hits inside those words only.
    words = hit.view(torch.uint8).view(torch.int64)
    hot = words.nonzero().squeeze(1)
    inside = words[hot].view(torch.bool).nonzero().squeeze(1)
    return hot[inside >> 3] * 8 + (inside & 7)


def top_magnitudes(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the ``k`` largest ``|x|`` (flat ``x``), as torch.topk picks them, and the
    values of ``x`` there.

    Instead of a selection over all n elements: a threshold estimated from a fixed sample, the
    positions that reach it (about ``1.4 k`` at F = 0.01), and the exact top k among those. The
    set is that of ``x.abs().topk(k)`` up to ties at the k-th magnitude, which go to the lowest
    positions; when fewer than k reach the threshold, or NaNs make the count ambiguous, it falls
    back to ``torch.topk`` itself. Positions come back ascending, except from the fallback.

    On a GPU it is ``torch.topk`` itself: the search reads its threshold and counts on the
    host, each a wait for the device, and took 5.2 ms of an H200's 5.3 ms encode + decode of a
    256 MB gradient at F = 0.01, against 1.4 ms for ``torch.topk`` (2026-11-30).
    """
    n = x.numel()
    if x.device.type == "cuda":
        return _torch_topk(x, k)
    t = None if n < SMALL or k * SPARSE_BELOW > n else _threshold(x, k)
    cand = None if t is None else _reaching(x, t)
    if cand is None or cand.numel() < k:
        return _torch_topk(x, k)
    values = x[cand]
    if cand.numel() == k:
        return cand, values
    vals = values.abs()
    # Drop the c - k smallest candidates: keep those above the (c - k)-th smallest, then as
    # many of those equal to it as are still missing, lowest positions first.
    cut = vals.kthvalue(cand.numel() - k).values
    keep = torch.le(vals, cut).logical_not_()  # not "vals > cut": a NaN must count as above
    missing = k - int(keep.sum())
    ties = (vals == cut).nonzero().squeeze(1)
    if missing < 0 or ties.numel() < missing:  # NaN among the candidates: leave it to topk
        return _torch_topk(x, k)
    keep[ties[:missing]] = True
    return cand[keep], values[keep]


def _torch_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # sorted=False: order is irrelevant to the scatter and skips an O(k log k) sort.
    index = x.abs().topk(k, sorted=False).indices
    return index, x[index]
