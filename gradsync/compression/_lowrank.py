"""PowerSGD's dense math (``powersgd.py``): the power iteration's products and ``P Q^T``.

Each product is written in the layout one-thread MKL runs fastest, which for PowerSGD's skinny
factors is not the obvious one (issue 16): ``P^T = Q^T M^T`` and ``Q^T = P^T M`` instead of
``M Q`` and ``M^T P``, and ``P Q^T`` of a large matrix as R broadcast multiply-adds up to rank 4.
The hook and the push codec share these functions, so both encode the same way.
"""

from __future__ import annotations

import torch


def orthonormalize(p: torch.Tensor) -> None:
    """Replace the columns of ``p`` (rows x rank) by an orthonormal basis of their span, in place.

    Reduced QR: an all-zero ``p`` still becomes a basis, so a matrix whose gradient was zero
    for a step moves again on the next one.
    """
    p.copy_(torch.linalg.qr(p).Q)


def compute_p(mats: list[torch.Tensor], qs: list[torch.Tensor], ps: list[torch.Tensor]) -> None:
    """The first half of a power iteration: ``P = M Q`` for every matrix, written into ``ps``.

    Computed as ``P^T = Q^T M^T``: the same product, but MKL on one thread runs this layout of
    a skinny product about 3x faster (2.6 ms against 7.2 ms for a 2409 x 2409 matrix at rank
    4), and never slower at the ranks we measured (1 to 32).
    """
    for m, q, p in zip(mats, qs, ps, strict=True):
        p.copy_(torch.mm(q.t(), m.t()).t())


def compute_q(mats: list[torch.Tensor], ps: list[torch.Tensor], qs: list[torch.Tensor]) -> None:
    """The second half: orthonormalize every P in place, then ``Q = M^T P`` into ``qs``.

    As ``Q^T = P^T M``: 3 ms against 19 ms for ``M^T P`` (2409 x 2409, rank 4, one thread).
    """
    for m, p, q in zip(mats, ps, qs, strict=True):
        orthonormalize(p)
        q.copy_(torch.mm(p.t(), m).t())


#: Up to this rank, and from this many elements, ``P Q^T`` is built as R broadcast multiply-adds,
#: not a matmul: a rank-4 product of 2409 x 2409 took 3.2 ms that way against 6.9 ms in MKL (one
#: thread), 1024 x 1024 0.27 ms against 0.61; at rank 8 they tie, and below about 512 x 512 the
#: matmul wins (each of the R passes has a fixed cost: 21 us against 3 at 64 x 64).
OUTER_BY_COLUMNS = 4
OUTER_MIN_NUMEL = 1 << 19


def _by_columns(out: torch.Tensor, p: torch.Tensor) -> bool:
    # MKL's case only: on a GPU the R passes read and write ``out`` R times where one matmul
    # writes it once (PowerSGD's decode of 256 MB at rank 4 on an H200: 0.80 ms against 0.14).
    cpu = out.device.type == "cpu"
    return cpu and p.shape[1] <= OUTER_BY_COLUMNS and out.numel() >= OUTER_MIN_NUMEL


def write_outer(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """``out = P Q^T`` (``out`` rows x cols, same dtype as P and Q)."""
    if not _by_columns(out, p):
        torch.mm(p, q.t(), out=out)
        return
    qt = q.t().contiguous()  # a strided row of Q would take the slow broadcast path
    torch.mul(p[:, :1], qt[0], out=out)
    for r in range(1, p.shape[1]):
        out.addcmul_(p[:, r : r + 1], qt[r])


def subtract_outer(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """``out -= P Q^T``, in place."""
    if not _by_columns(out, p):
        out.addmm_(p, q.t(), alpha=-1.0)
        return
    qt = q.t().contiguous()  # a strided row of Q would take the slow broadcast path
    for r in range(p.shape[1]):
        out.addcmul_(p[:, r : r + 1], qt[r], value=-1.0)
