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

``reduce`` (to one root) is broadcast's mirror image: ring, a ring reduce-scatter then a
binomial gather of the pieces to the root, ``(n-1 + lg) alpha + 2(n-1)/n S beta``; tree,
``lg (alpha + S beta)``; rhd, Rabenseifner's recursive halving then a binomial gather,
``2 lg alpha + 2(n-1)/n S beta``; ``binary_tree`` is not offered (``BINARY_TREE_OPS``). The
additions themselves are not priced, as in the other reducing collectives.

Two levels (``hierarchical_allreduce_time``, ``flat_allreduce_time``): ``H`` hosts of ``L``
ranks, an ``intra`` link inside a host and an ``inter`` link between hosts. The hierarchical
all-reduce of ``gradsync.topology`` is three collectives in turn: a reduce to the host's
leader over ``L`` ranks on ``intra``, an all-reduce among the ``H`` leaders on ``inter``, a
broadcast over ``L`` ranks on ``intra``. A flat ring over all ``N = H L`` ranks (ranks of a
host adjacent in the ring, as torchrun numbers them) moves ``S/N`` over every link of the ring
at each of its ``2(N-1)`` steps, all at once, so a step lasts as long as its slowest link:
with ``H > 1`` it is the flat all-reduce over ``N`` ranks priced on the slower link, each
host's link carrying ``2(N-1)/N S`` against the leaders' ``2(H-1)/H S``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from gradsync.errors import UsageError

OPS = ("allreduce", "reducescatter", "allgather", "broadcast", "reduce")
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
    "reduce": lambda n: 1.0,
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
            # The mirror image of broadcast: ring reduce-scatter, then gather to the root.
            "reduce": (float(n - 1 + lg), 2.0 * part),
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
            "reduce": (float(lg), float(lg)),
        }[op]
    # Recursive halving (reduce-scatter) and recursive doubling (all-gather): Rabenseifner.
    return {
        "allreduce": (2.0 * lg, 2.0 * part),
        "reducescatter": (float(lg), part),
        "allgather": (float(lg), part),
        "broadcast": (2.0 * lg, 2.0 * part),
        "reduce": (2.0 * lg, 2.0 * part),
    }[op]


def collective_time(
    op: str, n: int, nbytes: float, alpha: float, beta: float, algorithm: str = "ring"
) -> float:
    """Seconds for one ``op`` over ``n`` ranks on a buffer of ``nbytes`` bytes."""
    if nbytes < 0:
        raise UsageError(f"message size must be 0 or more bytes, got {nbytes}")
    a, b = cost_terms(op, algorithm, n)
    return a * alpha + b * nbytes * beta


def _check_hosts(hosts: int, per_host: int) -> None:
    if hosts < 1 or per_host < 1:
        raise UsageError(f"need at least 1 host and 1 rank per host, got {hosts} x {per_host}")


def hierarchical_allreduce_time(
    hosts: int,
    per_host: int,
    nbytes: float,
    inter: AlphaBeta,
    intra: AlphaBeta,
    *,
    inter_nbytes: float | None = None,
) -> float:
    """Seconds for ``gradsync.topology``'s all-reduce of ``nbytes`` over ``hosts`` hosts of
    ``per_host`` ranks: reduce to the leader (``intra``), all-reduce among the leaders
    (``inter``), broadcast from the leader (``intra``), one after the other.

    ``inter_nbytes`` (default ``nbytes``) is what the leaders exchange: less than ``nbytes``
    under a compressor, which the runtime applies only across hosts (the host sums are exact).
    """
    _check_hosts(hosts, per_host)
    across = nbytes if inter_nbytes is None else inter_nbytes
    return (
        intra.time("reduce", per_host, nbytes)
        + inter.time("allreduce", hosts, across)
        + intra.time("broadcast", per_host, nbytes)
    )


def flat_allreduce_time(
    hosts: int, per_host: int, nbytes: float, inter: AlphaBeta, intra: AlphaBeta
) -> float:
    """Seconds for one all-reduce of ``nbytes`` over all ``hosts x per_host`` ranks, with
    ``inter``'s algorithm: every step waits for its slowest link, so across hosts it is the
    all-reduce over all the ranks priced on each link alone, the slower of the two (the module
    docstring)."""
    return flat_collective_time("allreduce", hosts, per_host, nbytes, inter, intra)


def flat_collective_time(
    op: str, hosts: int, per_host: int, nbytes: float, inter: AlphaBeta, intra: AlphaBeta
) -> float:
    """``flat_allreduce_time`` for any ``op`` of ``OPS``: a ring's reduce-scatter or all-gather
    moves the same share over every link at each step too, so the slower link paces it."""
    _check_hosts(hosts, per_host)
    n = hosts * per_host
    if hosts == 1:
        return intra.time(op, n, nbytes)
    # Per step each link costs alpha + (its share of S) beta, the same share on both links,
    # so the slowest step is one link's whole: not the larger alpha plus the larger beta.
    return max(
        collective_time(op, n, nbytes, link.alpha, link.beta, inter.algorithm)
        for link in (inter, intra)
    )


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
