"""Eager outer updates for DiLoCo (``diloco:H:F:eager``): each fragment's exchange is started
and not waited for; it is applied a period later, when that fragment's next exchange starts,
and what stands in for it meanwhile is this rank's own share of it.

The idea is Kale, Douillard and Donchev's ("Eager Updates For Overlapped Communication and
Computation in DiLoCo", 2025), written here from its description. Delaying the outer step by a
whole period hides the exchange behind a period of inner steps, but an outer step on the mean
of a period before converges worse; the eager step mixes the fresh and the stale: at round t
of a fragment, with W ranks, rank r steps its outer optimizer with

    g_r(t) = own_r(t) / W + (mean(t-1) - own_r(t-1) / W)

its own share of this round's mean, taken on trust now, and what the last round's mean added
to the share it took then: the peers' shares, which had a whole period to arrive. The first
round has nothing before it (its ``g`` is the own share alone). Over the rounds every mean is
applied once; the last round's rest, ``mean(T) - own_r(T) / W``, is applied at the run's end.

What follows from it, and how gradsync handles it:

- No round is waited for where it starts: an inner step waits only where an exchange is
  still in flight a whole period later.
- The ranks' global copies and outer momenta differ by their own shares: the replicas never
  agree mid-run (the divergence check measures, as under ``local:H``), and the run's end
  applies each fragment's rest, then averages the parameters once, uncompressed, so every
  rank leaves ``report()`` with the same model.
- A checkpoint holds, per fragment, the share the last round took and its mean (the exchange
  in flight is waited for), so a resumed run continues bitwise.
- Not under live membership: a replica that joins or heals has no previous round of its own,
  and a lost one's share of a mean could not be taken back out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: why eager outer updates do not run under live membership (refused before launch, by
#: ``membership.check_exchange``, and by ``DiLoCo.setup`` for a strategy built in Python)
NOT_UNDER_MEMBERSHIP = (
    "an eager outer step stands in for the peers' shares with the previous round's, which a "
    "replica that joins or heals does not have (gradsync.strategies.eager); use diloco:H:F:TAU"
)

#: what an exchange's result is while in flight: its future, or the mean once waited for
Result = torch.Tensor | torch.futures.Future[torch.Tensor]
#: waits for a fragment's exchange (``fragment``, its result) and returns the mean
Resolve = Callable[[int, Result], torch.Tensor]


class EagerRounds:
    """Per fragment, the share of its last round this rank took on trust and that round's
    exchange (in flight, or its mean once waited for)."""

    def __init__(self, fragments: int, world: int) -> None:
        self.world = world
        self._last: list[tuple[torch.Tensor, Result] | None] = [None] * fragments

    def owed(self, fragment: int, resolve: Resolve) -> torch.Tensor | None:
        """The last round's mean less the share taken of it (its exchange waited for if still
        in flight); None before the fragment's first round."""
        last = self._last[fragment]
        if last is None:
            return None
        taken, result = last
        mean = resolve(fragment, result)
        self._last[fragment] = (taken, mean)
        return mean - taken

    def share(self, own: torch.Tensor) -> torch.Tensor:
        """This rank's share of a round's mean (``own``, divided in place by W)."""
        return own.div_(self.world)

    def keep(self, fragment: int, taken: torch.Tensor, result: Result) -> None:
        """The share this round took on trust and its exchange, for the next round."""
        self._last[fragment] = (taken, result)

    def rest(self, resolve: Resolve) -> list[tuple[int, torch.Tensor]]:
        """At the end: each fragment's ``owed`` of its last round, every exchange waited for;
        nothing is left in flight, or owed."""
        found = []
        for fragment in range(len(self._last)):
            owed = self.owed(fragment, resolve)
            if owed is not None:
                found.append((fragment, owed))
            self._last[fragment] = None
        return found

    def settle(self, resolve: Resolve) -> None:
        """Wait for every round in flight (before the state is saved or replaced: an
        error-feedback residual comes back to the compressor's state only then)."""
        for fragment in range(len(self._last)):
            self.owed(fragment, resolve)

    def state_dict(self, resolve: Resolve) -> list[dict[str, torch.Tensor] | None]:
        """Each fragment's last round (its exchange waited for), or None before its first."""
        self.settle(resolve)
        saved: list[dict[str, torch.Tensor] | None] = []
        for fragment in range(len(self._last)):
            last = self._last[fragment]
            if last is None:
                saved.append(None)
                continue
            taken, mean = last
            assert isinstance(mean, torch.Tensor)
            saved.append({"taken": taken.detach().clone(), "mean": mean.detach().clone()})
        return saved

    def load_state_dict(self, saved: Any, device: torch.device) -> None:
        """Put back what ``state_dict`` saved (onto ``device``, where the global copies are)."""
        if not isinstance(saved, list) or len(saved) != len(self._last):
            raise ValueError(
                f"the checkpoint's eager rounds are {saved!r:.80}, not a list of "
                f"{len(self._last)} fragment(s)"
            )
        self._last = [
            None if entry is None else (entry["taken"].to(device), entry["mean"].to(device))
            for entry in saved
        ]
