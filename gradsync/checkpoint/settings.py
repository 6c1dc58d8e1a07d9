"""The strategy settings a checkpoint was saved under, and the one check of them that both
``sync.load`` and ``gradsync run --resume`` make.

A checkpoint names its strategy (``local``), which for the periodic strategies is not the whole
spec (``local:2`` and ``local:4`` both wrote ``local``), so their checkpoints also hold the
canonical spec (``strategy_spec``, from ``Strategy.settings_spec``), and a load under another
spec of the same strategy is refused, naming both (``check_strategy_spec``). Checkpoints
written before hold none and are not judged, nor is a strategy of the user's own
(docs/checkpoints.md, "Another strategy, or other settings of it").
"""

from __future__ import annotations

from typing import Any

from gradsync.checkpoint.files import CheckpointError
from gradsync.errors import UsageError

__all__ = ["STRATEGY_SPEC", "check_strategy_spec", "same_strategy"]

#: the key of a rank's file that holds the spec (absent where the name says it all)
STRATEGY_SPEC = "strategy_spec"


def same_strategy(saved: Any, given: str) -> bool:
    """Whether spec ``saved`` (as a checkpoint or a run's config.json holds it) and ``given``
    are one strategy with the same settings: compared in canonical form (``diloco:8`` and
    ``diloco:8:1`` are one spec; ``local:04`` is ``local:4``)."""
    from gradsync.spec import parse_strategy_spec

    try:
        return bool(parse_strategy_spec(str(saved)) == parse_strategy_spec(given))
    except (UsageError, ValueError):
        return str(saved) == given  # a spec of another version of gradsync: as written


def check_strategy_spec(step: int, saved: Any, current: str | None) -> None:
    """Refuse (``CheckpointError``) a checkpoint of ``step`` saved under strategy spec
    ``saved`` where this run's is ``current``, naming both: the strategy's state (the steps
    since the last average, the outer optimizer, the fragments in flight) belongs to its
    settings, and another period or outer step would quietly make another run than the one
    saved. Not judged when either is unknown (a checkpoint written before specs were recorded,
    a strategy of the user's own)."""
    if saved is None or current is None or same_strategy(saved, current):
        return
    raise CheckpointError(
        f"checkpoint at step {step} was saved under strategy {saved}, this run uses {current}: "
        f"its state (replicas, periods, outer optimizer, fragments) belongs to {saved}'s "
        f"settings. Resume with strategy={str(saved)!r} (gradsync run --strategy {saved}), or "
        "start in a new directory"
    )
