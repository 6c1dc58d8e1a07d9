"""Codec kernels for a GPU: whole-tensor torch functions that ``torch.compile`` fuses.

Why this module exists. The CPU codecs work a cache-sized block at a time, each block a few
torch ops; on a GPU every op is a kernel of its own that reads and writes its operands in
device memory, and a block loop is a string of launches. On an H200 (torch 2.11, 2026-11-30)
that ran the encode + decode of a 256 MB gradient at 3% to 7% of a device copy's rate: int8
134 GB/s, int4 129, sign 46, random-k 5 (BENCHMARKS.md, "gradsync on one GPU"). The functions
here compute the same encodings as whole-tensor expressions (the last chunk padded with zeros
inside the expression, not in memory), which ``torch.compile`` turns into a kernel or two
each. Measured side by side on the H200, compiled against the codec's own torch ops (same
section), 256 MB: int8 557 GB/s against 132, int4 636 against 129, sign 799 against 46. Those
figures are of an earlier form, whose decodes gathered each element's scale by index and added
into the sum in the compiled kernel; compiled for the CPU, both of those left a short last
chunk out (:func:`scaled`, :func:`accumulate`), so the decodes now pad, and the add is a torch
op of its own. The form kept has not been timed on a GPU. torch.compile is a maintained piece
that writes these kernels for every CUDA device torch supports; we write no kernel.

What each codec's device path sends:

- ``int4`` and ``sign``: the CPU path's sign bits, and int4's codes but where ``x / s`` falls
  within its last bit of a half (the compiler multiplies by ``1/7`` where the CPU divides by
  7; no such code was seen in the tests' 1,000,003 elements); a scale can differ in its last
  bit (that multiply, or for sign the order of its sum). Every rank of a group decodes what
  was sent with the same kernel, so the ranks still agree bit for bit; ranks of one group
  keep their buckets on one device type.
- ``int8``: the same format; the rounding noise comes from a hash of the element's index and the
  encode's seed (:func:`noise_bits`) instead of the CPU path's generator and table, so the
  codes differ from the CPU path's while holding the same guarantees (unbiased to ``2**-16`` of
  a step, error under one step, fresh per seed).
- ``randomk``: positions from :func:`strata` on every device (CPU too), so the two ends of a
  parameter-server push agree wherever they run; the gather and the scatter are compiled (for
  the hook and for pushes alike), the draw is not (:func:`strata` says why).

:class:`Kernel` wraps such a function; a codec whose tensors are on a CUDA device calls its
``run``, which compiles it for each new shape (bucket size, dtype, chunk), up to
``MAX_SHAPES`` of them: the first steps take a few seconds longer. The codec takes its own
path where ``run`` gives None: the blocked torch ops it runs on a CPU, or for random-k these
functions run as separate ops. That happens for shapes past ``MAX_SHAPES`` (a model with many
bucket sizes gets the kernels for its first few), when ``GRADSYNC_FUSED_CODECS=0`` turns
compilation off, or when a compilation fails (no Triton on the machine, a torch whose compiler
does not support the device): that warns once, naming the function and the error. On a CPU the
codecs never compile: the blocked path is faster there.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from gradsync import compat

#: set to "0" to run every device kernel eagerly (for debugging a compiled one)
ENV = "GRADSYNC_FUSED_CODECS"
_compiling = os.environ.get(ENV, "1") != "0"
_MASK32 = 0xFFFFFFFF


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the device path: a CUDA tensor (CPU tensors keep the blocked path)."""
    return t.device.type == "cuda"


#: sizes (and dtypes, chunks) each kernel is compiled for; calls with others take the codec's
#: own ops. Each compilation takes seconds, inside a step, and torch.compile runs a function
#: with too many (8 by default) as plain torch ops, slower than the codec's own: 3 leaves room
#: for compilations torch makes of its own accord.
MAX_SHAPES = 3


def _shape_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a compilation for ``args`` is specialised to, as counted against ``MAX_SHAPES``:
    tensor shapes and dtypes, integers, dtypes (a 0-dim tensor, a seed word, is none)."""
    return tuple(
        (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
        for a in args
        if not isinstance(a, torch.Tensor) or a.dim() > 0
    )


class Kernel:
    """One fusable function, compiled on its first :meth:`run` (module docstring)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.compiled: Callable[..., Any] | None = None
        self.broken = False
        self.shapes: set[tuple[Any, ...]] = set()
        self.lock = threading.Lock()

    def run(self, *args: Any) -> Any | None:
        """``fn(*args)`` compiled, or None where compilation is off or has failed, or where
        ``MAX_SHAPES`` other shapes are compiled already: the caller then takes its own path.
        A compilation fails before the kernel runs, so nothing it would write has been written
        when this returns None; any other error is raised."""
        if self.broken or not _compiling:
            return None
        key = _shape_key(args)
        with self.lock:
            if key not in self.shapes:
                if len(self.shapes) >= MAX_SHAPES:
                    return None
                self.shapes.add(key)
            if self.compiled is None:
                # Specialised to each shape: a dynamic kernel (one for all bucket sizes) ran
                # int8's encode at half the speed on the H200 (BENCHMARKS.md, GPU runs).
                self.compiled = torch.compile(self.fn, dynamic=False)
        try:
            return self.compiled(*args)
        except compat.compiler_errors() as exc:
            self.broken = True
            warnings.warn(
                f"gradsync: the fused device kernel {self.fn.__name__} could not be compiled "
                f"({type(exc).__name__}: {str(exc)[:300]}); the codec runs as separate torch "
                f"ops from now on (same format, slower). {ENV}=0 turns compilation off.",
                RuntimeWarning,
                stacklevel=2,
            )
            return None

    def run_on(self, tensor: torch.Tensor, *args: Any) -> Any | None:
        """:meth:`run` where ``tensor`` takes the device path (``on_device``), else None: the
        one test each codec method makes before its kernel."""
        return self.run(*args) if on_device(tensor) else None


def set_compiling(on: bool) -> bool:
    """Compile the device kernels (True, the default unless ``GRADSYNC_FUSED_CODECS=0``) or
    leave each codec to its separate torch ops; returns the previous setting
    (``benchmarks.gpu`` times both)."""
    global _compiling
    before, _compiling = _compiling, on
    return before


def padded_rows(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """Flat ``x`` as ``ceil(n / chunk) x chunk`` rows, the last padded with zeros."""
    return F.pad(flat, (0, (-flat.numel()) % chunk)).view(-1, chunk)


def chunk_absmax(rows: torch.Tensor) -> torch.Tensor:
    """``max |x|`` per row, bit for bit the CPU path's (zero padding changes no maximum)."""
    return torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg())


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two xor-shift-multiply rounds, constants under 2**31 so no
    product leaves int64) of int64 ``h`` in ``[0, 2**32)``."""
    h = ((h ^ (h >> 16)) * 0x21F0AAAD) & _MASK32
    h = ((h ^ (h >> 15)) * 0x735A2D97) & _MASK32
    return h ^ (h >> 15)


def seed_words(seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A 63-bit seed as two 0-dim int64 tensors (its 32-bit words) on ``device``: tensor
    arguments, so a compiled kernel is not compiled again for every seed, and made by fills,
    not copies from the host, so making them never waits for the device."""
    lo = torch.full((), seed & _MASK32, dtype=torch.int64, device=device)
    return lo, torch.full((), (seed >> 32) & _MASK32, dtype=torch.int64, device=device)


def noise_bits(index: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor) -> torch.Tensor:
    """32 random-looking bits per int64 ``index`` (>= 0, < 2**63) for a seed's two words: a
    counter-based stream, the same on every device, drawn in the kernel that uses it."""
    # The index is spread by a Weyl step first, so that consecutive indices differ in every
    # bit before the first mix. The seed must itself be well mixed (``derive_seed``'s are).
    spread = ((index & _MASK32) * 0x61C88647 + seed_lo) & _MASK32
    return _mix32(_mix32(spread) ^ seed_hi ^ (index >> 32))


def scaled(values: torch.Tensor, scale: torch.Tensor, numel: int, chunk: int) -> torch.Tensor:
    """The first ``numel`` of flat ``values``, each times its chunk's scale.

    As padded rows times a column, not ``values * scale[arange(n) // chunk]``: compiled by
    torch 2.13's Inductor for the CPU, that gather gave 0 for every element of a short last
    chunk of 1,024 (5,000 and 100,003 elements; tests/e2e/test_fused_compiled_cpu.py), so we
    do not trust it on a GPU either, though it timed faster there (BENCHMARKS.md, GPU runs)."""
    rows = padded_rows(values, chunk)
    return (rows * scale.to(values.dtype)[: rows.shape[0], None]).view(-1)[:numel]


# --- int4: round to nearest of x / (max|x| / 7), two codes a byte ---------------------------


def int4_encode(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 scale per chunk, packed codes): ``int4.quantize``'s bytes."""
    flat = x.reshape(-1).float()
    rows = padded_rows(flat, chunk)
    scale = chunk_absmax(rows) / 7.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (rows / safe[:, None]).round().clamp(-7, 7).add(8).to(torch.uint8).view(-1, 2)
    packed = codes[:, 0] | (codes[:, 1] << 4)
    return scale, packed[: (flat.numel() + 1) // 2]


def int4_decode(
    packed: torch.Tensor, scale: torch.Tensor, numel: int, chunk: int, dtype: torch.dtype
) -> torch.Tensor:
    """The decoded tensor, flat, of ``dtype``."""
    codes = torch.stack([packed & 15, packed >> 4], dim=1).view(-1).to(dtype) - 8
    return scaled(codes, scale, numel, chunk)


# --- sign: one bit per element, mean |x| per chunk -----------------------------------------


def sign_encode(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 ``mean |x|`` per chunk, sign bits eight to a byte): ``sign.pack_signs``'s."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    rows = padded_rows(flat, chunk)
    # Elements per chunk: chunk, but fewer in a short last one.
    counts = (n - torch.arange(rows.shape[0], device=flat.device) * chunk).clamp(max=chunk)
    scale = rows.abs().sum(dim=1) / counts.to(torch.float32)
    # Padding is 0, which counts as positive, as the CPU path's padding bits are set.
    bits = (rows >= 0).view(-1, 8).to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=x.device)
    packed = (bits * weights).sum(dim=1, dtype=torch.uint8)
    return scale, packed[: -(-n // 8)]


def sign_decode(
    packed: torch.Tensor, scale: torch.Tensor, numel: int, chunk: int, dtype: torch.dtype
) -> torch.Tensor:
    """``scale * (+1 or -1 per bit)``, flat, of ``dtype`` (the product is exact)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    signs = ((packed[:, None] >> shifts) & 1).view(-1).to(dtype) * 2 - 1
    return scaled(signs, scale, numel, chunk)


# --- int8: stochastic rounding with hashed noise -------------------------------------------


def int8_encode(
    x: torch.Tensor, chunk: int, seed_lo: torch.Tensor, seed_hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 scale per chunk, int8 codes ``round(x / s + (r + 1/2) / 2**16)``), ``r`` the top
    16 bits of :func:`noise_bits` of the element's index, less ``2**15``: uniform on the
    midpoints, as ``int8.rounding_noise`` is, so each code is unbiased to ``2**-16`` of a step
    and off by under one step."""
    flat = x.reshape(-1).float()
    rows = padded_rows(flat, chunk)
    scale = chunk_absmax(rows) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    index = torch.arange(rows.numel(), device=x.device).view_as(rows)
    r = (noise_bits(index, seed_lo, seed_hi) >> 16) - (1 << 15)
    noise = (r.to(torch.float32) + 0.5) * (2.0**-16)
    codes = (rows / safe[:, None] + noise).round().clamp(-127, 127).to(torch.int8)
    return scale, codes.view(-1)[: flat.numel()]


def int8_decode(
    codes: torch.Tensor, scale: torch.Tensor, chunk: int, dtype: torch.dtype
) -> torch.Tensor:
    """``codes * scale`` per chunk, flat, of ``dtype``."""
    return scaled(codes.to(dtype), scale, codes.numel(), chunk)


# --- random-k: one position per stratum ----------------------------------------------------


#: the largest bucket :func:`strata` draws from exactly, plus one
MAX_STRATA_NUMEL = 1 << 31


def strata(
    numel: int, k: int, seed_lo: torch.Tensor, seed_hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(position, stratum size) of each of ``k`` strata of ``[0, numel)``: stratum ``j`` is
    ``[j * numel // k, (j + 1) * numel // k)`` and its position is uniform in it, from
    :func:`noise_bits` of ``j``. Integer arithmetic only, so every device draws the same;
    exact for ``numel < MAX_STRATA_NUMEL`` (no product leaves int64).

    Never compiled: on an H200 (torch 2.11) the compiled form drew the CPU's positions for a
    5,000-element bucket, and for the first strata of a 1,000,003-element one (k = 10,000),
    but other positions in its last ones; ``j * numel`` passes 2**31 from stratum 2,148 there,
    so we suspect the compiler did that arithmetic in 32 bits (not confirmed). Run as torch
    ops it is a few kernels over k elements; the gather and the scatter, which touch the
    bucket, are compiled."""
    j = torch.arange(k, device=seed_lo.device)
    start = j * numel // k
    size = (j + 1) * numel // k - start
    # 32 random bits times a size < 2**31 stays in int64; >> 32 maps them onto [0, size).
    return start + ((noise_bits(j, seed_lo, seed_hi) * size) >> 32), size


def randomk_gather(
    flat: torch.Tensor, position: torch.Tensor, size: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The value at each of :func:`strata`'s positions, times its stratum's size, as ``dtype``."""
    return flat[position].to(dtype) * size


def randomk_scatter(values: torch.Tensor, position: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` zeros with ``values`` at :func:`strata`'s positions."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    return out.index_put_((position,), values)


def accumulate(decode: Kernel, out: torch.Tensor, sign: float, *args: Any) -> bool:
    """``out += sign * decode(*args)``: the decode compiled, the add a torch op of its own;
    False (nothing added) where ``decode`` did not run. Not one compiled in-place add: torch
    2.13's Inductor compiled ``out.add_(decoded)`` for the CPU leaving a short last chunk of
    int8 (1,024) and int4 (128) unadded (tests/e2e/test_fused_compiled_cpu.py)."""
    decoded = decode.run(*args)
    if decoded is None:
        return False
    out.add_(decoded, alpha=sign)
    return True


# --- the compiled kernels, each codec's device path -----------------------------------------

INT4_ENCODE = Kernel(int4_encode)
INT4_DECODE = Kernel(int4_decode)
SIGN_ENCODE = Kernel(sign_encode)
SIGN_DECODE = Kernel(sign_decode)
INT8_ENCODE = Kernel(int8_encode)
INT8_DECODE = Kernel(int8_decode)
RANDOMK_GATHER = Kernel(randomk_gather)
RANDOMK_SCATTER = Kernel(randomk_scatter)
