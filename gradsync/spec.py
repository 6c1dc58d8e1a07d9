"""Strategy and compression spec strings: one parser for the library, the CLI and the simulator.

``parse_strategy_spec("local:8")`` gives a :class:`StrategySpec` and
``parse_compression_spec("topk:0.01")`` a :class:`CompressionSpec`: plain values, and no torch
here, so the simulator and the CLI can check a spec on a machine without it. What a spec builds
is up to the caller, which maps ``kind`` to a constructor: ``gradsync.strategies`` (a
``Strategy``), ``gradsync.compression.spec`` (a ``Compressor``), ``gradsync.sim.config`` (a
simulated strategy). A bad spec raises :class:`~gradsync.errors.UsageError` (a ``ValueError``)
naming the bad value and the valid forms, with the same message wherever it was typed.

Every form is one entry of ``STRATEGY_TABLE`` or ``COMPRESSION_TABLE``, and ``STRATEGY_FORMS``
and ``COMPRESSION_FORMS``, the text the messages end with, are written from them. A new strategy
is one ``StrategyForm`` (plus the ``StrategySpec`` field it fills, when its argument is a new
kind of value); a new compressor one ``CompressionForm`` and its constructor in
``gradsync.compression.spec``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from gradsync.errors import UsageError

__all__ = [
    "COMPRESSION_FORMS",
    "COMPRESSION_TABLE",
    "GRADIENT_COMPRESSION_FORMS",
    "OUTER_DEFAULTS",
    "PERIODIC_ONLY_COMPRESSION",
    "SPLITS",
    "STRATEGY_FORMS",
    "STRATEGY_TABLE",
    "CompressionForm",
    "CompressionSpec",
    "StrategyForm",
    "StrategySpec",
    "outer_options",
    "outer_settings",
    "parse_compression_spec",
    "parse_strategy_spec",
]


class _Refused(ValueError):
    """An argument broke its form's rule, for the reason given; the parser adds the spec and
    the valid forms."""


# -- strategies --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategySpec:
    """A parsed strategy spec; ``str()`` gives it back in canonical form (``"ssp:inf"``)."""

    kind: str
    period: int | None = None  # H for local/diloco
    staleness: float | None = None  # S for ssp (math.inf allowed)
    stage: int | None = None  # N for zero
    #: streaming DiLoCo (``diloco:H:F:TAU:ALPHA``): fragments, delay and mixing weight; None
    #: for plain ``diloco:H`` (and every other kind)
    fragments: int | None = None
    delay: int | None = None
    alpha: float | None = None
    #: how streaming DiLoCo cuts the model into its F fragments (``diloco:H:F:TAU:ALPHA:SPLIT``,
    #: one of ``SPLITS``): "layers" when asked for with F > 1, else None, which stands for the
    #: default, "rows" (with one fragment the split changes nothing, so it is not kept)
    split: str | None = None
    #: DiLoCo's outer SGD (``diloco:...:outer_lr=X:outer_momentum=M``), None for the default
    #: (``OUTER_DEFAULTS``): only a value that differs from it is kept
    outer_lr: float | None = None
    outer_momentum: float | None = None
    #: DiLoCo with eager outer updates (``diloco:H:F:eager``): each exchange is applied a
    #: period after it started, this rank's own share of it at once
    #: (``gradsync.strategies.eager``); ``fragments`` is then set, ``delay`` and ``alpha`` not
    eager: bool = False
    #: streaming DiLoCo keeping the local progress (``diloco:H:F:TAU:keep``): where an exchange
    #: is applied, the fragment becomes its new global copy plus the local steps taken while the
    #: exchange was in flight, instead of ALPHA's mix (``alpha`` is then 0)
    keep: bool = False

    def __str__(self) -> str:
        form = STRATEGY_TABLE.get(self.kind)
        if form is None or form.show is None:
            return self.kind
        return f"{self.kind}:{form.show(self)}"

    @property
    def uses_servers(self) -> bool:
        """Whether the strategy runs parameter-server ranks besides the workers."""
        form = STRATEGY_TABLE.get(self.kind)
        return form is not None and form.servers


@dataclass(frozen=True, slots=True)
class StrategyForm:
    """One documented strategy form: ``kind``, or ``kind:ARG`` when it takes an argument."""

    kind: str
    #: the argument's name in the forms ("H"); "" when the strategy takes none
    arg: str = ""
    #: what the argument must be ("an integer >= 1"), for the forms and the messages
    rule: str = ""
    #: the argument's text -> the ``StrategySpec`` fields it sets; raises ``ValueError`` when
    #: the text breaks ``rule`` (``_Refused(reason)`` to say something more specific)
    parse: Callable[[str], dict[str, Any]] | None = None
    #: the argument of a parsed spec, as ``str(spec)`` writes it
    show: Callable[[StrategySpec], str] | None = None
    #: whether the strategy runs parameter-server ranks besides the workers
    servers: bool = False
    #: optional arguments after ARG, as the forms write them ("[:F]"), and their rules
    options: str = ""
    option_rules: str = ""

    @property
    def usage(self) -> str:
        return f"{self.kind}:{self.arg}{self.options}" if self.arg else self.kind


def _period(text: str) -> dict[str, Any]:
    period = int(text)
    if period < 1:
        raise ValueError(text)
    return {"period": period}


def _staleness(text: str) -> dict[str, Any]:
    if text == "inf":
        return {"staleness": math.inf}
    bound = int(text)
    if bound < 0:
        raise ValueError(text)
    try:
        return {"staleness": float(bound)}
    except OverflowError:
        raise _Refused(f"S={text} is too large for a float; use inf") from None


def _stage(text: str) -> dict[str, Any]:
    stage = int(text)
    if stage not in (1, 2, 3):
        raise ValueError(text)
    return {"stage": stage}


def default_delay(period: int, fragments: int) -> int:
    """Streaming DiLoCo's TAU when none is given: one inner step of overlap where the schedule
    leaves room for it (F > 1 and TAU * F < H), so each fragment's exchange hides behind the
    next step's compute; 0 (no overlap, plain DiLoCo's timing) otherwise."""
    return 1 if 1 < fragments < period else 0


#: Streaming DiLoCo's ways to cut the model into fragments (``gradsync.strategies.streaming``),
#: the default first: "rows" cuts every tensor into F blocks of rows, so each fragment holds
#: about 1/F of the bytes; "layers" strides whole layers over the fragments (the paper's form).
SPLITS = ("rows", "layers")

#: the first gradient bucket's size cap, MiB, whatever ``bucket_mb`` is: DDP's first bucket
#: (torch's ``_DEFAULT_FIRST_BUCKET_BYTES``). Backward produces the last layers' gradients
#: first; a small first bucket sends them while backward goes on, where one bucket holding the
#: whole gradient of a model of a few MB is sent only once backward ends (10-20% of the step
#: on a 1 Gbit/s link, issue 48). Here, not in ``buckets``: the simulator (no torch) plans alike.
FIRST_BUCKET_MB = 1.0
#: the default plan's largest bucket, MiB (DDP's ``bucket_cap_mb``)
MAX_BUCKET_MB = 25.0
#: the default plan cuts a gradient into about this many buckets
DEFAULT_BUCKETS = 8


def default_bucket_mb(total_mb: float) -> float:
    """``bucket_mb`` where the user names none: an eighth of the gradient, at least the first
    bucket's size and at most ``MAX_BUCKET_MB``. Why not DDP's fixed 25 MB: a gradient of a few
    MB is then one bucket behind a 1 MB first one, sent only once backward ends; on the
    emulated cluster (2 hosts, 1 Gbit/s, ``python -m benchmarks.first_bucket --model
    transformer``) a 4.7 MB transformer stepped 1.07x DDP's time with 25 MB buckets and 0.89x
    with this plan (1 MB buckets there); a 5.7 MB mlp of a few large tensors was about even
    either way (BENCHMARKS.md, "first bucket"). Large gradients keep 25 MB buckets, as
    DDP's."""
    return min(MAX_BUCKET_MB, max(FIRST_BUCKET_MB, total_mb / DEFAULT_BUCKETS))


def bucket_sizes_mb(total_mb: float, bucket_mb: float) -> list[float]:
    """How a gradient of ``total_mb`` splits into buckets by size alone (``buckets.plan_buckets``
    also keeps each parameter whole and dtypes apart): a first of at most ``FIRST_BUCKET_MB``,
    then ones of ``bucket_mb``."""
    if total_mb <= 0:
        return []
    first = min(FIRST_BUCKET_MB, bucket_mb, total_mb)
    sizes = [first]
    rest = total_mb - first
    while rest > 1e-12:
        sizes.append(min(bucket_mb, rest))
        rest -= sizes[-1]
    return sizes


def _split_field(parts: list[str]) -> str | None:
    """Take SPLIT off the end of ``parts`` (H, F, ...): the last field after F when it is not a
    number (so ``diloco:8:3:layers`` needs no TAU or ALPHA before it), and the fifth field
    whatever it is; None if there is none."""
    if len(parts) < 3:
        return None
    if len(parts) <= 4:
        try:
            float(parts[-1])
            return None
        except ValueError:
            if not parts[-1]:
                return None  # an empty TAU or ALPHA, which their own checks name
    split = parts.pop()
    if split not in SPLITS:
        raise _Refused(f"SPLIT={split} must be {' or '.join(SPLITS)}")
    return split


#: DiLoCo's outer optimizer settings a spec may name (``outer_lr=X``, ``outer_momentum=M``,
#: as fields after the others), with their defaults: Nesterov SGD at lr 0.7, momentum 0.9, the
#: DiLoCo paper's. ``outer_lr=1:outer_momentum=0`` makes the outer step land on the average of
#: the ranks' parameters (local SGD's averaging, each fragment in turn when streaming).
OUTER_DEFAULTS: Mapping[str, float] = MappingProxyType({"outer_lr": 0.7, "outer_momentum": 0.9})


def _outer_fields(parts: list[str], kind: str) -> dict[str, float]:
    """Take the ``name=value`` fields off the end of ``parts``: the outer optimizer's settings
    that differ from ``OUTER_DEFAULTS`` (``kind``: the strategy, for the refusals)."""
    found: dict[str, float] = {}
    while len(parts) > 1 and "=" in parts[-1]:
        name, _, raw = parts.pop().partition("=")
        name = name.strip()
        if name not in OUTER_DEFAULTS:
            raise _Refused(f"{name}= is not a {kind} option; it takes {_OUTER_FORMS}")
        if name in found:
            raise _Refused(f"{name}= is given twice")
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        ok = 0 < value < math.inf if name == "outer_lr" else 0 <= value < 1
        if not ok:
            rule = "a number > 0" if name == "outer_lr" else "a number from 0 to below 1"
            raise _Refused(f"{name}={raw.strip()} must be {rule}")
        found[name] = value
    return {k: v for k, v in found.items() if v != OUTER_DEFAULTS[k]}


_OUTER_FORMS = "outer_lr=X (a number > 0) and outer_momentum=M (from 0 to below 1)"


def _eager_field(parts: list[str]) -> bool:
    """Take the word ``eager`` out of ``parts`` (after H, before or after SPLIT); whether it
    was there."""
    found = [i for i, part in enumerate(parts) if i > 0 and part == EAGER]
    if len(found) > 1:
        raise _Refused(f"{EAGER} is given twice")
    if found:
        del parts[found[0]]
    return bool(found)


#: the spec's word for eager outer updates (``diloco:H:F:eager``)
EAGER = "eager"
#: the spec's word, in ALPHA's place, for the merge that keeps the local progress made while an
#: exchange was in flight (``diloco:H:F:TAU:keep``)
KEEP = "keep"


def _keep_field(parts: list[str], text: str) -> bool:
    """Take the word ``keep`` out of ``parts`` (H, F, TAU, ALPHA, ...; ``text`` as written),
    where it stands for ALPHA; whether it was there. ``parts[3]`` becomes 0 so that the fields
    after it parse as they would after a number."""
    found = [i for i, part in enumerate(parts) if i > 0 and part.lower() == KEEP]
    if not found:
        return False
    if found != [3]:
        raise _Refused(
            f"{KEEP} takes ALPHA's place, after TAU, once: diloco:H:F:TAU:{KEEP} (got "
            f"{text.strip()})"
        )
    parts[3] = "0"
    return True


def _diloco(text: str) -> dict[str, Any]:
    """``H``, or ``H:F[:TAU[:ALPHA]][:SPLIT]`` for streaming DiLoCo; one fragment with no delay
    and ALPHA 0 is plain ``diloco:H``, and parses as it (whatever the split: one fragment is
    the whole model). ``H[:F]:eager[:SPLIT]``: eager outer updates, F fragments (1 if not
    given), with no TAU or ALPHA (each exchange is applied a period after it starts)."""
    parts = [part.strip() for part in text.split(":")]
    outer = _outer_fields(parts, "diloco")
    eager = _eager_field(parts)
    keep = _keep_field(parts, text)
    split = _split_field(parts)
    if len(parts) > 4:
        raise _Refused(f"diloco takes at most H:F:TAU:ALPHA:SPLIT, got {len(parts) + 1} values")
    if eager and keep:
        raise _Refused(f"{EAGER} and {KEEP} are two ways of applying an exchange: take one")
    if eager and len(parts) > 2:
        raise _Refused(
            f"{EAGER} takes no TAU or ALPHA (got {':'.join(parts[2:])}): each fragment's "
            "exchange is applied a period after it starts, this rank's own share at once"
        )
    fields = {**_period(parts[0]), **outer}
    if len(parts) == 1 and not eager:
        return fields
    period = fields["period"]
    try:
        fragments = int(parts[1]) if len(parts) > 1 else 1
    except ValueError:
        fragments = 0
    if not 1 <= fragments <= period:
        raise _Refused(f"F={parts[1]} must be an integer from 1 to H={period}")
    if eager:
        chosen = {**fields, "fragments": fragments, "eager": True}
        if split is not None and split != SPLITS[0] and fragments > 1:
            chosen["split"] = split
        return chosen
    delay = default_delay(period, fragments)
    if len(parts) > 2:
        try:
            delay = int(parts[2])
        except ValueError:
            delay = -1
        if delay < 0 or delay * fragments >= period:
            raise _Refused(
                f"TAU={parts[2]} must be an integer >= 0 below H/F={period / fragments:g}"
            )
    alpha = 0.0
    if len(parts) > 3:
        try:
            alpha = float(parts[3])
        except ValueError:
            alpha = math.nan
        if not 0.0 <= alpha <= 1.0:
            raise _Refused(f"ALPHA={parts[3]} must be a number from 0 to 1")
    if keep and delay == 0:
        raise _Refused(
            f"{KEEP} needs TAU >= 1: with no delay no local step falls between an exchange's "
            "start and its application, so there is no local progress to keep"
        )
    if fragments == 1 and delay == 0 and alpha == 0:
        return fields
    streaming = {**fields, "fragments": fragments, "delay": delay, "alpha": alpha}
    if keep:
        streaming["keep"] = True
    # Only the non-default split is kept, and only where it changes something (F > 1), so
    # every way of writing one run parses to one spec.
    if split is not None and split != SPLITS[0] and fragments > 1:
        streaming["split"] = split
    return streaming


def _noloco(text: str) -> dict[str, Any]:
    """``H[:outer_lr=X][:outer_momentum=M]``: gossip's period and the outer step's settings
    (``gradsync.strategies.gossip.NoLoCo``; the defaults are DiLoCo's, as NoLoCo's)."""
    parts = [part.strip() for part in text.split(":")]
    outer = _outer_fields(parts, "noloco")
    if len(parts) > 1:
        raise _Refused(f"noloco takes H and the outer options only, got {':'.join(parts)}")
    return {**_period(parts[0]), **outer}


def _show_noloco(spec: StrategySpec) -> str:
    return f"{spec.period}{outer_options(outer_settings(spec))}"


def outer_settings(spec: StrategySpec) -> dict[str, Any]:
    """The outer optimizer settings ``spec`` names (those that differ from ``OUTER_DEFAULTS``),
    by keyword: what ``DiLoCo`` and ``NoLoCo`` take (floats, typed ``Any`` as keyword
    arguments)."""
    return {k: v for k in OUTER_DEFAULTS if (v := getattr(spec, k)) is not None}


def outer_options(values: Mapping[str, float | None]) -> str:
    """The spec fields (``:outer_lr=1.0:outer_momentum=0.0``) of the outer optimizer settings
    in ``values`` that differ from ``OUTER_DEFAULTS`` (None: the default)."""
    return "".join(
        f":{name}={value!r}"
        for name in OUTER_DEFAULTS
        if (value := values.get(name)) is not None and value != OUTER_DEFAULTS[name]
    )


def _show_diloco(spec: StrategySpec) -> str:
    outer = outer_options(outer_settings(spec))
    if spec.fragments is None:
        return f"{spec.period}{outer}"
    if spec.eager:
        split = f":{spec.split}" if spec.split is not None else ""
        return f"{spec.period}:{spec.fragments}:{EAGER}{split}{outer}"
    alpha = f":{KEEP}" if spec.keep else f":{spec.alpha!r}" if spec.alpha else ""
    split = f":{spec.split}" if spec.split is not None else ""
    return f"{spec.period}:{spec.fragments}:{spec.delay or 0}{alpha}{split}{outer}"


def _show_stage(spec: StrategySpec) -> str:
    return str(spec.stage)


def _show_period(spec: StrategySpec) -> str:
    return str(spec.period)


def _show_staleness(spec: StrategySpec) -> str:
    s = spec.staleness
    return "inf" if s is not None and math.isinf(s) else str(int(s or 0))


def _table(forms: Iterable[Any]) -> Mapping[str, Any]:
    return MappingProxyType({form.kind: form for form in forms})


#: Every strategy spec form, in the order the messages list them.
STRATEGY_TABLE: Mapping[str, StrategyForm] = _table(
    [
        StrategyForm("bsp"),
        StrategyForm("zero", "N", "1, 2 or 3", _stage, _show_stage),
        StrategyForm("local", "H", "an integer >= 1", _period, _show_period),
        StrategyForm(
            "diloco",
            "H",
            "an integer >= 1",
            _diloco,
            _show_diloco,
            options="[:F[:TAU[:ALPHA]|:eager][:SPLIT]][:outer_lr=X][:outer_momentum=M]",
            option_rules="F an integer from 1 to H, TAU an integer >= 0 below H/F, "
            f"ALPHA in [0, 1] or {KEEP} (TAU >= 1), SPLIT {' or '.join(SPLITS)}, X > 0 "
            "(default 0.7), "
            "M in [0, 1) (default 0.9)",
        ),
        StrategyForm(
            "ssp", "S", "an integer >= 0 or inf", _staleness, _show_staleness, servers=True
        ),
        StrategyForm("async", servers=True),
        StrategyForm("hogwild"),
        StrategyForm("gossip", "H", "an integer >= 1", _period, _show_period),
        StrategyForm(
            "noloco",
            "H",
            "an integer >= 1",
            _noloco,
            _show_noloco,
            options="[:outer_lr=X][:outer_momentum=M]",
        ),
    ]
)


def _strategy_forms(table: Mapping[str, StrategyForm]) -> str:
    """``bsp, local:H, ... (H an integer >= 1, ...)``: the forms, then each argument's rule."""
    usages = ", ".join(form.usage for form in table.values())
    rules = dict.fromkeys(
        rule
        for f in table.values()
        if f.arg
        for rule in (f"{f.arg} {f.rule}", f.option_rules)
        if rule
    )
    return f"{usages} ({', '.join(rules)})" if rules else usages


STRATEGY_FORMS = _strategy_forms(STRATEGY_TABLE)


def parse_strategy_spec(spec: str) -> StrategySpec:
    """Parse a strategy spec (``bsp``, ``zero:N``, ``local:H``, ``diloco:H``, ``ssp:S``,
    ``async``).

    Case and surrounding blanks are ignored. Anything else raises ``UsageError`` (a
    ``ValueError``) naming ``spec`` and ``STRATEGY_FORMS``. This is the one strategy parser:
    ``gradsync.strategies`` re-exports it and builds a ``Strategy`` from its result, and the
    simulator and the CLI check specs with it.
    """
    if not isinstance(spec, str):
        raise UsageError(
            f"strategy must be a spec string or a Strategy, got {type(spec).__name__}; "
            f"valid: {STRATEGY_FORMS}"
        )
    kind, colon, arg = spec.strip().lower().partition(":")
    arg = arg.strip()
    form = STRATEGY_TABLE.get(kind)
    if form is None:
        raise UsageError(f"unknown strategy {spec!r}; valid: {STRATEGY_FORMS}")
    if form.parse is None:
        if colon:
            raise UsageError(
                f"unknown strategy {spec!r}: {kind} takes no parameter; valid: {STRATEGY_FORMS}"
            )
        return StrategySpec(kind=kind)
    if not arg:
        raise UsageError(
            f"unknown strategy {spec!r}: {kind} needs a parameter, as in {form.usage}; "
            f"valid: {STRATEGY_FORMS}"
        )
    try:
        fields = form.parse(arg)
    except ValueError as exc:
        reason = str(exc) if isinstance(exc, _Refused) else f"{form.arg} must be {form.rule}"
        raise UsageError(f"strategy {spec!r}: {reason}; valid: {STRATEGY_FORMS}") from None
    return StrategySpec(kind=kind, **fields)


# -- compression -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CompressionSpec:
    """A parsed compression spec; ``str()`` gives the canonical spec, the one the
    ``Compressor`` built from it reports as ``Compressor.spec``."""

    kind: str
    #: FRACTION for topk/randomk (a float), RANK for powersgd (an int), (DENSITY, CHUNK, BETA)
    #: for sparseloco; None for the others
    argument: float | int | tuple[float, int, float] | None = None

    def __str__(self) -> str:
        if self.argument is None:
            return self.kind
        if isinstance(self.argument, tuple):
            return ":".join([self.kind, *(str(value) for value in self.argument)])
        return f"{self.kind}:{self.argument}"


@dataclass(frozen=True, slots=True)
class CompressionForm:
    """One documented compression form: ``kind``, or ``kind:ARG`` when it takes an argument."""

    kind: str
    #: the argument's name in the forms ("FRACTION"); "" when the compressor takes none
    arg: str = ""
    #: what the argument must be, written after the forms that share it ("integer >= 1")
    rule: str = ""
    #: ``(kind, argument text)`` -> the argument; raises ``_Refused(reason)`` (text may be "")
    parse: Callable[[str, str], float | int | tuple[float, int, float]] | None = None
    #: whether the argument may be left out (``sparseloco`` alone takes its defaults)
    optional: bool = False
    #: whether it runs only under a periodic average (``local:H``, ``diloco:H``): its state
    #: is the outer momentum (``sparseloco``), so bsp and zero:1 refuse it
    periodic_only: bool = False

    @property
    def usage(self) -> str:
        if not self.arg:
            return self.kind
        return f"{self.kind}[:{self.arg}]" if self.optional else f"{self.kind}:{self.arg}"


def _fraction(kind: str, text: str) -> float:
    if not text:
        raise _Refused(f"{kind} needs a fraction, as in {kind}:0.01")
    try:
        fraction = float(text)
    except ValueError:
        raise _Refused(f"fraction {text!r} is not a number") from None
    if math.isnan(fraction) or not 0.0 < fraction <= 1.0:
        raise _Refused(f"fraction {text} is outside (0, 1]")
    return fraction


def _rank(kind: str, text: str) -> int:
    if not text:
        raise _Refused(f"{kind} needs a rank, as in {kind}:4")
    try:
        rank = int(text)
    except ValueError:
        raise _Refused(f"rank {text!r} is not an integer") from None
    if rank < 1:
        raise _Refused(f"rank {text} must be at least 1")
    return rank


#: sparseloco's (DENSITY, CHUNK, BETA) when the spec leaves them out: 2% of each chunk of 4096
#: kept (k = 82), the accumulator decayed by 0.95 per exchange (see gradsync.compression.sparseloco)
SPARSELOCO_DEFAULTS: tuple[float, int, float] = (0.02, 4096, 0.95)
#: the CHUNK sparseloco accepts: its in-chunk indices travel in ceil(log2(CHUNK)) bits
SPARSELOCO_CHUNKS = (16, 65536)


def _sparseloco(kind: str, text: str) -> tuple[float, int, float]:
    """``[DENSITY[:CHUNK[:BETA]]]``, each part left out taking its default."""
    parts = [part.strip() for part in text.split(":")] if text else []
    if len(parts) > 3:
        raise _Refused(f"{kind} takes at most DENSITY:CHUNK:BETA, got {len(parts)} values")
    density, chunk, beta = SPARSELOCO_DEFAULTS
    if parts and parts[0]:
        try:
            density = float(parts[0])
        except ValueError:
            density = math.nan
        if not 0.0 < density <= 1.0:  # NaN fails too
            raise _Refused(f"DENSITY={parts[0]} must be a number in (0, 1]")
    if len(parts) > 1:
        low, high = SPARSELOCO_CHUNKS
        try:
            chunk = int(parts[1])
        except ValueError:
            chunk = 0
        if not low <= chunk <= high:
            raise _Refused(f"CHUNK={parts[1]} must be an integer from {low} to {high}")
    if len(parts) > 2:
        try:
            beta = float(parts[2])
        except ValueError:
            beta = math.nan
        if not 0.0 <= beta <= 1.0:
            raise _Refused(f"BETA={parts[2]} must be a number from 0 to 1")
    return density, chunk, beta


#: Every compression spec form, in the order the messages list them.
COMPRESSION_TABLE: Mapping[str, CompressionForm] = _table(
    [
        CompressionForm("none"),
        CompressionForm("fp16"),
        CompressionForm("bf16"),
        CompressionForm("int8"),
        CompressionForm("int4"),
        CompressionForm("sign"),
        CompressionForm("topk", "FRACTION", "0 < FRACTION <= 1", _fraction),
        CompressionForm("randomk", "FRACTION", "0 < FRACTION <= 1", _fraction),
        CompressionForm("powersgd", "RANK", "integer >= 1", _rank),
        CompressionForm(
            "sparseloco",
            "DENSITY[:CHUNK[:BETA]]",
            f"0 < DENSITY <= 1, CHUNK an integer from {SPARSELOCO_CHUNKS[0]} to "
            f"{SPARSELOCO_CHUNKS[1]}, 0 <= BETA <= 1",
            _sparseloco,
            optional=True,
            periodic_only=True,
        ),
    ]
)


def _compression_forms(table: Mapping[str, CompressionForm]) -> str:
    """``none, ..., topk:FRACTION, randomk:FRACTION (0 < FRACTION <= 1), ...``: a rule follows
    the last of the consecutive forms that share it."""
    forms = list(table.values())
    parts = []
    for form, after in zip(forms, [*forms[1:], None], strict=True):
        last = form.rule and (after is None or after.rule != form.rule)
        parts.append(f"{form.usage} ({form.rule})" if last else form.usage)
    return ", ".join(parts)


COMPRESSION_FORMS = _compression_forms(COMPRESSION_TABLE)
#: The forms that compress a gradient all-reduce (bsp and zero:1 take every one): every form
#: but those that need a periodic average. A message suggesting such a strategy lists these,
#: not ``COMPRESSION_FORMS``: zero:1 refuses sparseloco (``factory.check_compressor``).
GRADIENT_COMPRESSION_FORMS = _compression_forms(
    {kind: form for kind, form in COMPRESSION_TABLE.items() if not form.periodic_only}
)
#: The forms that run only under a periodic average (``sparseloco``), comma-separated.
PERIODIC_ONLY_COMPRESSION = ", ".join(
    form.kind for form in COMPRESSION_TABLE.values() if form.periodic_only
)


def _bad_compression(spec: str, reason: str) -> UsageError:
    return UsageError(
        f"invalid compression spec {spec!r}: {reason}; valid forms: {COMPRESSION_FORMS}"
    )


def parse_compression_spec(spec: str | None) -> CompressionSpec:
    """Parse a compression spec (``fp16``, ``topk:0.01``, ``powersgd:4``, ...); None is ``none``.

    Case and blanks around the spec and its argument are ignored. Anything else raises
    ``UsageError`` (a ``ValueError``) naming ``spec`` and ``COMPRESSION_FORMS``.
    ``gradsync.compression.parse_compression`` builds a ``Compressor`` from the result.
    """
    if spec is None:
        return CompressionSpec(kind="none")
    if not isinstance(spec, str):
        raise UsageError(
            f"compression must be a spec string, a Compressor or None, got {type(spec).__name__}"
            f" {spec!r}; valid forms: {COMPRESSION_FORMS}"
        )
    kind, colon, arg = spec.strip().lower().partition(":")
    arg = arg.strip()
    form = COMPRESSION_TABLE.get(kind)
    if form is None:
        raise _bad_compression(spec, f"unknown compressor {kind!r}")
    if form.parse is None:
        if colon:
            raise _bad_compression(spec, f"{kind} takes no argument")
        return CompressionSpec(kind=kind)
    try:
        return CompressionSpec(kind=kind, argument=form.parse(kind, arg))
    except _Refused as exc:
        raise _bad_compression(spec, str(exc)) from None
