"""The ``Synchronizer``'s settings, grouped by concern, each validated once where it is declared.

Four frozen dataclasses, each field named as the ``Synchronizer`` keyword it stands for:

- ``Exchange``: how gradients are exchanged and combined (``bucket_mb``, ``allreduce``,
  ``accumulation``, ``broadcast_buffers``, ``balance``);
- ``Limits``: how long gradsync waits (``timeout_s``, ``between_steps_timeout_s``);
- ``Telemetry``: what is measured and where it goes (``telemetry_every``, ``record_spans``,
  ``on_records``);
- ``Checks``: what is checked as training goes (``check_every``, ``skip_nonfinite``).

``gs.Synchronizer(model, opt, "bsp", exchange=Exchange(bucket_mb=25), limits=Limits(timeout_s=60))``
is ``gs.Synchronizer(model, opt, "bsp", bucket_mb=25, timeout_s=60)``; ``telemetry=False`` turns
telemetry off, ``telemetry=Telemetry(...)`` configures it. A setting given both as a keyword and
in its group is refused (:meth:`Options.of`). The Synchronizer keeps the resolved ``Options``
(``sync.options.exchange.bucket_mb``). What stays a plain argument is an object or a spec rather
than a setting: the model, optimizer, strategy, compression, servers, scaler, group, ``slow``
and ``run_dir``.

A field that ``gradsync run`` sets carries its flag (:func:`gradsync.flags.flag`): its help,
metavar, option string and parser. ``RunConfig`` declares that flag with
:func:`gradsync.flags.flag_from`, so the option and its flag are declared once, here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from gradsync.balance import ShardBalancer
from gradsync.bucket_autotune import AUTO
from gradsync.checks.gate import DEFAULT_BETWEEN_STEPS_S
from gradsync.errors import UsageError
from gradsync.flags import flag
from gradsync.telemetry.records import StepRecord
from gradsync.topology import check_allreduce

__all__ = [
    "ACCUMULATION",
    "DEFAULT_TIMEOUT_S",
    "Checks",
    "Exchange",
    "Limits",
    "Options",
    "Telemetry",
    "parse_bucket_mb",
]

#: the accumulation conventions of ``Synchronizer(accumulation=...)``
ACCUMULATION = ("mean", "sum")
#: ``timeout_s`` when neither the script nor ``gradsync run --timeout`` names one
DEFAULT_TIMEOUT_S = 300.0


def parse_bucket_mb(text: str) -> float | str:
    """``--bucket-mb``: a size in MB, or ``auto`` (a size's range is checked with the other
    fields, so the command line and ``RunConfig`` refuse the same values alike)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid float value {text!r}: give a size in MB (a number > 0) or 'auto'"
        ) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Exchange:
    """How gradients are exchanged and combined.

    ``bucket_mb``: the gradient bucket size in MB; None for the default plan, ``"auto"`` to time
    a few plans over the first steps. ``allreduce``: ``"ring"`` or ``"hierarchical"`` (within
    each host, then across hosts). ``accumulation``: how the k backward passes of
    ``sync.step(micro_batches=k)`` combine, ``"mean"`` or ``"sum"`` (``Synchronizer``).
    ``broadcast_buffers``: buffers broadcast from rank 0 at each step, as DDP's.
    ``balance``: shard each global batch by measured speed (True, or a ``ShardBalancer``).
    ``find_unused_parameters``: as DDP's, a parameter that no rank used in a step keeps
    ``grad`` None (an optimizer then leaves it alone), at the cost of one small all-reduce a
    step; without it such a parameter gets a zero gradient (``bsp``; other strategies warn)."""

    bucket_mb: float | str | None = flag(
        None,
        metavar="MB",
        help="gradient bucket size in MB, or 'auto': time a few plans over the first steps and "
        "keep the fastest (default: an eighth of the gradient, from 1 to 25 MB; the first "
        "bucket at most 1 MB)",
        parse=parse_bucket_mb,
    )
    allreduce: str = flag(
        "ring",
        metavar="KIND",
        help="ring (flat) | hierarchical: sum within each host, then across hosts among one "
        "rank per host (bsp, zero:1, local:H, diloco:H; default: %(default)s)",
    )
    accumulation: str = "mean"
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    balance: bool | ShardBalancer = flag(
        False,
        help="shard each global batch by measured speed (bsp, zero:1, zero:2; the update "
        "stays exact; default: off)",
    )

    def __post_init__(self) -> None:
        bucket_mb = self.bucket_mb
        if bucket_mb not in (None, AUTO):
            if not (isinstance(bucket_mb, int | float) and _is_number(bucket_mb) and bucket_mb > 0):
                raise UsageError(
                    f"bucket_mb must be a number > 0, None for the default plan or {AUTO!r} to "
                    f"time a few plans over the first steps, got {bucket_mb!r}"
                )
            object.__setattr__(self, "bucket_mb", float(bucket_mb))  # 25 and 25.0 alike
        check_allreduce(self.allreduce)
        if self.accumulation not in ACCUMULATION:
            raise UsageError(
                f"accumulation must be one of {', '.join(ACCUMULATION)}, got "
                f"{self.accumulation!r}: 'mean' when each micro-batch's loss is its own mean "
                "(gradsync averages the k backward passes), 'sum' when the script divides each "
                "loss by k (as DDP scripts do with no_sync)"
            )
        _check_bool("broadcast_buffers", self.broadcast_buffers)
        _check_bool("find_unused_parameters", self.find_unused_parameters)
        if not isinstance(self.balance, bool | ShardBalancer):
            raise UsageError(
                f"balance must be True, False or a gradsync.ShardBalancer, got "
                f"{_described(self.balance)}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """How long gradsync waits.

    ``timeout_s`` bounds gradsync's own waits (a step block, ``save``, ``report``); None: the
    run's ``--timeout`` under ``gradsync run``, else 300 s. ``between_steps_timeout_s``: how
    long a rank still in its own code between steps is waited for before the next collective
    is posted; None turns that gate off (``timeout_s`` then bounds those waits too)."""

    timeout_s: float | None = flag(
        None,
        option="--timeout",
        metavar="S",
        help="seconds a synchronizing wait may take before failing (default: %(default)g)",
    )
    between_steps_timeout_s: float | None = DEFAULT_BETWEEN_STEPS_S
    #: ranks the gate counts together at a store of their own (``gradsync.checks.gate_groups``):
    #: None, automatic (flat below 64 ranks, else about the square root of the world); a size
    #: >= the world's makes it flat
    gate_group_size: int | None = None

    def __post_init__(self) -> None:
        timeout_s = self.timeout_s
        if timeout_s is not None and not (_is_number(timeout_s) and timeout_s > 0):
            raise UsageError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        between = self.between_steps_timeout_s
        if between is not None and not (_is_number(between) and between > 0):
            raise UsageError(
                f"between_steps_timeout_s must be > 0 or None (no gate), got {between!r}"
            )
        size = self.gate_group_size
        if size is not None and not (isinstance(size, int) and size >= 2):
            raise UsageError(
                f"gate_group_size must be an integer >= 2 (ranks counted together at the step "
                f"gate's group stores) or None (automatic), got {size!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Telemetry:
    """What is measured and where it goes (``Synchronizer(telemetry=False)`` turns it off).

    ``telemetry_every``: steps between the gathers of every rank's step records.
    ``record_spans``: keep timeline spans for ``gather_spans()`` (always on under
    ``gradsync run``). ``on_records``: called with every gathered batch of records, on every
    rank."""

    telemetry_every: int = 10
    record_spans: bool = False
    on_records: Callable[[list[StepRecord]], None] | None = None

    def __post_init__(self) -> None:
        every = self.telemetry_every
        if not isinstance(every, int) or isinstance(every, bool):
            raise UsageError(f"telemetry_every must be an integer >= 1, got {every!r}")
        if every < 1:
            raise UsageError(f"telemetry_every must be >= 1, got {every}")
        _check_bool("record_spans", self.record_spans)
        if self.on_records is not None and not callable(self.on_records):
            raise UsageError(
                "on_records must be a function taking a list of StepRecord, or None, got "
                f"{_described(self.on_records)}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Checks:
    """What is checked as training goes.

    ``check_every``: compare the replicas' fingerprints every N steps (0: never).
    ``skip_nonfinite``: skip, on every rank, an update whose gradient is not finite."""

    check_every: int = flag(
        100,
        metavar="N",
        help="compare replica fingerprints every N steps (0: off; default: %(default)s)",
    )
    skip_nonfinite: bool = True

    def __post_init__(self) -> None:
        every = self.check_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise UsageError(
                f"check_every must be an integer >= 0 (0 turns the check off), got {every!r}"
            )
        _check_bool("skip_nonfinite", self.skip_nonfinite)


#: the option groups: ``Synchronizer`` keyword (and ``Options`` field) -> its dataclass
GROUPS: dict[str, type] = {
    "exchange": Exchange,
    "limits": Limits,
    "telemetry": Telemetry,
    "checks": Checks,
}
#: each setting's ``Synchronizer`` keyword -> the group holding it (a field of the same name)
GROUP_OF: dict[str, str] = {f.name: g for g, cls in GROUPS.items() for f in fields(cls)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """A Synchronizer's settings, resolved: every group, ``telemetry`` None when it is off."""

    exchange: Exchange = field(default_factory=Exchange)
    limits: Limits = field(default_factory=Limits)
    telemetry: Telemetry | None = field(default_factory=Telemetry)
    checks: Checks = field(default_factory=Checks)

    def __post_init__(self) -> None:
        for name, cls in GROUPS.items():
            value = getattr(self, name)
            if not isinstance(value, cls) and not (name == "telemetry" and value is None):
                raise UsageError(
                    f"{name} must be a gradsync.options.{cls.__name__}, got {_described(value)}"
                )
        if self.exchange.balance is not False and self.telemetry is None:
            raise UsageError("balance=True needs telemetry (it balances on measured compute)")

    @classmethod
    def of(
        cls,
        keywords: Mapping[str, Any],
        *,
        exchange: Exchange | None = None,
        limits: Limits | None = None,
        telemetry: bool | Telemetry = True,
        checks: Checks | None = None,
    ) -> Options:
        """The options of ``Synchronizer(**keywords, exchange=..., ...)``: each group given, or
        made from the keywords of its fields. A keyword left at its default is not given; one
        given with its group too is refused, naming both."""
        if not isinstance(telemetry, bool | Telemetry):
            raise UsageError(
                f"telemetry must be True, False or a gradsync.options.Telemetry, got "
                f"{_described(telemetry)}"
            )
        given = {
            "exchange": exchange,
            "limits": limits,
            "telemetry": telemetry if isinstance(telemetry, Telemetry) else None,
            "checks": checks,
        }
        values: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        for keyword, value in keywords.items():
            name = GROUP_OF[keyword]
            default = _defaults(GROUPS[name])[keyword]
            if value is default or (type(value) is type(default) and value == default):
                continue
            group = given[name]
            if group is not None:
                raise UsageError(
                    f"{keyword}={value!r} and {name}={type(group).__name__}(...) both set "
                    f"{keyword}: give it one way, the keyword or the field of "
                    f"{type(group).__name__}"
                )
            values[name][keyword] = value
        made: dict[str, Any] = {
            name: given[name] or GROUPS[name](**values[name]) for name in GROUPS
        }
        if telemetry is False:
            made["telemetry"] = None  # its keywords were still checked above
        return cls(**made)

    def attached(self, timeout_s: float) -> Options:
        """These options in a run directory (``gradsync.attached_run``): the timeout it chose,
        and timeline spans recorded (spans.jsonl, trace.json's per-rank tracks)."""
        spans = None if self.telemetry is None else replace(self.telemetry, record_spans=True)
        return replace(self, limits=replace(self.limits, timeout_s=timeout_s), telemetry=spans)

    def resolved(self) -> Options:
        """Every default filled in: ``timeout_s`` None is ``DEFAULT_TIMEOUT_S``."""
        if self.limits.timeout_s is not None:
            return self
        return replace(self, limits=replace(self.limits, timeout_s=DEFAULT_TIMEOUT_S))


def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in fields(cls)}


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise UsageError(f"{name} must be True or False, got {_described(value)}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _described(value: object) -> str:
    shown = repr(value)
    return f"{type(value).__name__} {shown[:60]}{'...' if len(shown) > 60 else ''}"
