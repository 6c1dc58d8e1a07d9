"""Alpha-beta cost of collectives, nccl-tests bandwidths, and the least-squares fit of alpha/beta.

A message of ``S`` bytes between two ranks costs ``alpha + S * beta`` (alpha: latency in
seconds, beta: seconds per byte). Every algorithm here is a sequence of such rounds, so each
cost is ``latency_terms(n) * alpha + bandwidth_terms(n) * S * beta``, with ``S`` the full
buffer as nccl-tests counts it (for all-gather the gathered output, for reduce-scatter the
input). Formulas follow Thakur, Rabenseifner and Gropp (2005); ``lg`` is ``ceil(log2 n)``,
exact for powers of two and a slight underestimate otherwise (MPICH adds a fix-up round).

``tree`` is the binomial tree (the minimum spanning tree MPI libraries use); ``binary_tree`` is
a complete binary tree in heap order, not pipelined, in the single-port model (a rank sends
or receives one whole message at a time), with its round count computed exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from gradsync.errors import UsageError

OPS = ("allreduce", "reducescatter", "allgather", "broadcast")
ALGORITHMS = ("ring", "tree", "binary_tree", "rhd")
# A binary tree is only modelled where its cost is well defined without a scatter schedule.
BINARY_TREE_OPS = ("allreduce", "broadcast")

# nccl-tests (doc/PERFORMANCE.md): busbw = algbw * factor, so that busbw is comparable to the
# link's peak whatever the rank count.
_BUS_FACTORS = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def _check(op: str, algorithm: str, n: int) -> None:
    if op not in OPS:
        raise UsageError(f"unknown collective {op!r}; valid: {', '.join(OPS)}")
    if algorithm not in ALGORITHMS:
        raise UsageError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    if n < 1:
        raise UsageError(f"number of ranks must be at least 1, got {n}")
    if algorithm == "binary_tree" and op not in BINARY_TREE_OPS:
        raise UsageError(
            f"binary_tree models {' and '.join(BINARY_TREE_OPS)} only, not {op}; "
            "use ring, tree (binomial) or rhd"
        )


def _children(m: int) -> tuple[int, int]:
    """Sizes of the two subtrees under the root of a complete binary tree of ``m`` nodes.

    A subtree of a complete tree in heap order is complete itself, so its shape, and hence
    its cost, depends on its size alone.
    """
    if m <= 1:
        return 0, 0
    h = m.bit_length() - 1  # levels below the root
    half = 1 << (h - 1)  # room on the left subtree's last level
    left = (half - 1) + min(m - ((1 << h) - 1), half)
    return left, m - 1 - left


@lru_cache(maxsize=256)
def binary_tree_rounds(m: int) -> tuple[int, int]:
    """``(reduce, broadcast)`` rounds on a complete binary tree of ``m`` ranks, single-port.

    Reduce: a rank receives its children's partial sums one after the other, the one that is
    ready first first, then is ready to send up. Broadcast: a rank sends to its children one
    after the other, the one whose subtree takes longer first.
    """
    left, right = _children(m)
    if left == 0:
        return 0, 0
    kids = [binary_tree_rounds(k) for k in (left, right) if k > 0]
    t = 0
    for ready in sorted(r for r, _ in kids):
        t = max(t, ready) + 1
    down = sorted((b for _, b in kids), reverse=True)
    return t, max(i + 1 + b for i, b in enumerate(down))


def cost_terms(op: str, algorithm: str, n: int) -> tuple[float, float]:
    """``(a, b)`` such that the collective costs ``a * alpha + b * S * beta``."""
    _check(op, algorithm, n)
    if n == 1:
        return 0.0, 0.0
    lg = math.ceil(math.log2(n))
    part = (n - 1) / n
    if algorithm == "ring":
        # Reduce-scatter then all-gather around the ring, n-1 rounds each of S/n bytes;
        # broadcast is a scatter (binomial) followed by a ring all-gather (van de Geijn).
        return {
            "allreduce": (2.0 * (n - 1), 2.0 * part),
            "reducescatter": (float(n - 1), part),
            "allgather": (float(n - 1), part),
            "broadcast": (float(lg + n - 1), 2.0 * part),
        }[op]
    if algorithm == "binary_tree":
        # Whole messages up the tree (reduce), then down (broadcast): every round moves S.
        up, down = binary_tree_rounds(n)
        rounds = float(up + down) if op == "allreduce" else float(down)
        return rounds, rounds
    if algorithm == "tree":
        # Binomial tree moving whole messages: reduce to a root, then broadcast back down.
        return {
            "allreduce": (2.0 * lg, 2.0 * lg),
            "reducescatter": (2.0 * lg, lg + part),
            "allgather": (2.0 * lg, lg + part),
            "broadcast": (float(lg), float(lg)),
        }[op]
    # Recursive halving (reduce-scatter) and recursive doubling (all-gather): Rabenseifner.
    return {
        "allreduce": (2.0 * lg, 2.0 * part),
        "reducescatter": (float(lg), part),
        "allgather": (float(lg), part),
        "broadcast": (2.0 * lg, 2.0 * part),
    }[op]


def collective_time(
    op: str, n: int, nbytes: float, alpha: float, beta: float, algorithm: str = "ring"
) -> float:
    """Seconds for one ``op`` over ``n`` ranks on a buffer of ``nbytes`` bytes."""
    if nbytes < 0:
        raise UsageError(f"message size must be 0 or more bytes, got {nbytes}")
    a, b = cost_terms(op, algorithm, n)
    return a * alpha + b * nbytes * beta


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes per second: ``S / t``."""
    return nbytes / seconds if seconds > 0 else math.inf


def busbw(op: str, n: int, nbytes: float, seconds: float) -> float:
    """Bus bandwidth in bytes per second, as nccl-tests defines it."""
    _check(op, "ring", n)
    return algbw(nbytes, seconds) * _BUS_FACTORS[op](n)


@dataclass(frozen=True, kw_only=True, slots=True)
class AlphaBeta:
    """Link parameters: ``alpha`` seconds per message, ``beta`` seconds per byte."""

    alpha: float
    beta: float
    algorithm: str = "ring"

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and math.isfinite(self.alpha)):
            raise UsageError(f"alpha must be a finite number >= 0 seconds, got {self.alpha}")
        if not (self.beta >= 0 and math.isfinite(self.beta)):
            raise UsageError(f"beta must be a finite number >= 0 s/byte, got {self.beta}")
        if self.algorithm not in ALGORITHMS:
            raise UsageError(
                f"unknown algorithm {self.algorithm!r}; valid: {', '.join(ALGORITHMS)}"
            )

    def time(self, op: str, n: int, nbytes: float) -> float:
        return collective_time(op, n, nbytes, self.alpha, self.beta, self.algorithm)

    @property
    def bandwidth(self) -> float:
        """Link bandwidth in bytes per second (``1 / beta``)."""
        return 1.0 / self.beta if self.beta > 0 else math.inf


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """A least-squares fit of alpha and beta to measured collective times."""

    alpha: float
    beta: float
    op: str
    algorithm: str
    n: int
    max_rel_error: float

    def model(self) -> AlphaBeta:
        # A noisy fit can go slightly negative; the model needs non-negative link parameters.
        return AlphaBeta(
            alpha=max(self.alpha, 0.0), beta=max(self.beta, 0.0), algorithm=self.algorithm
        )


def fit_alpha_beta(
    sizes: Sequence[float],
    times: Sequence[float],
    *,
    n: int,
    op: str = "allreduce",
    algorithm: str = "ring",
) -> Fit:
    """Fit ``alpha`` and ``beta`` of ``op``/``algorithm`` on ``n`` ranks to measured times.

    Minimises the relative error, not the absolute one: sizes span several decades and an
    absolute fit would let the largest message decide alpha alone.
    """
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if s.shape != t.shape or s.ndim != 1:
        raise UsageError("sizes and times must be two lists of the same length")
    if len(np.unique(s)) < 2:
        raise UsageError("fitting alpha and beta needs at least two distinct message sizes")
    if np.any(t <= 0):
        raise UsageError("measured times must all be positive")
    if n < 2:
        raise UsageError(f"fitting a collective needs at least 2 ranks, got {n}")
    a, b = cost_terms(op, algorithm, n)
    design = np.column_stack([np.full_like(s, a), b * s]) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    predicted = a * alpha + b * s * beta
    err = float(np.max(np.abs(predicted - t) / t))
    return Fit(
        alpha=float(alpha), beta=float(beta), op=op, algorithm=algorithm, n=n, max_rel_error=err
    )
