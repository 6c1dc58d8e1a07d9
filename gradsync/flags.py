"""Command-line flags declared once, on a config dataclass's fields.

A field made with :func:`flag` carries what only the command line needs: its help text,
metavar, the help group it is shown in (none: the parser's own options), the values it may
take (``choices``) and, where it is not ``--field-name``, its option string. The rest comes
from the field itself: the name (``batch_size`` -> ``--batch-size``), the default, and the
argparse type or action from the annotation (``int``, ``float``, ``str``, optional ones,
``list[X]``: a repeatable option whose values are appended, and ``bool``: ``--name`` turns on a
field that defaults to off, ``--no-name`` turns off one that defaults to on). :func:`add_flags`
builds the options of a parser from ``dataclasses.fields`` and :func:`from_namespace` builds the
config back from the parsed values, so validation stays the config's own (its
``__post_init__``). A field without a flag is set by code only.

A flag that sets a library option is declared on that option's field (``gradsync.options``:
the Synchronizer's settings); a command's config takes it with :func:`flag_from`, which copies
the declaration and adds the help group, and :func:`sourced` reads the values back out to
build the option's dataclass.

Every command's flags are declared this way: ``run`` and ``compare`` (``gradsync.runner.config``;
the Synchronizer's options among them on ``gradsync.options``),
``simulate`` and ``bench allreduce`` (``gradsync.sim.options``), ``cluster``
(``gradsync.cluster.cli``). Torch-free: nothing here imports more than the standard library.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

FLAG_KEY = "gradsync.flag"  # the key of a field's metadata that holds its Flag
SOURCE_KEY = "gradsync.flag_from"  # (dataclass, field name) whose flag a field declares

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Flag:
    """What the command line shows for one config field (everything else is the field's)."""

    help: str
    group: str | None = None  # None: the parser's own "options" group
    metavar: str | None = None
    option: str | None = None  # the option string, where it is not --field-name
    choices: Sequence[str] | None = None  # argparse refuses any other value, naming these
    #: parses the value where the field's type alone cannot (``float | str``: a number or a
    #: word); raises ``ValueError`` or ``argparse.ArgumentTypeError`` naming what is valid
    parse: Callable[[str], Any] | None = None

    def option_for(self, f: dataclasses.Field[Any]) -> str:
        if self.option is not None:
            return self.option
        name = f.name.replace("_", "-")
        if f.default is True:
            return f"--no-{name}"  # a bool that defaults to on: the flag turns it off
        return f"--{name}"


def flag(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    group: str | None = None,
    metavar: str | None = None,
    option: str | None = None,
    choices: Sequence[str] | None = None,
    factory: Callable[[], Any] | None = None,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A dataclass field with its command-line flag: ``nproc: int = flag(4, help=...)``.

    ``factory`` instead of ``default`` makes the default computed per config (``--out``); the
    flag then defaults to None, which :func:`from_namespace` reads as "not given". A
    ``list[X]`` field takes ``factory=list``: its repeatable flag starts from an empty list.
    """
    spec = Flag(
        help=help, group=group, metavar=metavar, option=option, choices=choices, parse=parse
    )
    meta = {FLAG_KEY: spec}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_from(
    cls: type, name: str, *, default: Any = dataclasses.MISSING, group: str | None = None
) -> Any:
    """A config field whose flag is the one field ``name`` of dataclass ``cls`` declares (its
    help, metavar, option string, choices and parser), shown in help group ``group``, with
    that field's default unless ``default`` is given: ``bucket_mb: float | None =
    flag_from(Exchange, "bucket_mb", group=SYNC)``. The flag is thus declared once, beside the
    library option it sets; :func:`sourced` reads the config's values back out for ``cls``."""
    source = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    spec = None if source is None else flag_of(source)
    if source is None or spec is None:
        raise TypeError(f"{cls.__name__}.{name} declares no flag")
    value = source.default if default is dataclasses.MISSING else default
    meta = {FLAG_KEY: dataclasses.replace(spec, group=group), SOURCE_KEY: (cls, name)}
    return dataclasses.field(default=value, metadata=meta)


def sourced(config: Any, cls: type) -> dict[str, Any]:
    """The values of ``config``'s fields declared by :func:`flag_from` on fields of ``cls``,
    keyed by those fields' names: ``Exchange(**sourced(run_config, Exchange))``."""
    values = {}
    for f in dataclasses.fields(config):
        source = f.metadata.get(SOURCE_KEY)
        if source is not None and source[0] is cls:
            values[source[1]] = getattr(config, f.name)
    return values


def flag_of(f: dataclasses.Field[Any]) -> Flag | None:
    """The flag a field declares, or None for a field set by code only."""
    spec = f.metadata.get(FLAG_KEY)
    return spec if isinstance(spec, Flag) else None


def flag_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of dataclass ``cls`` that have a flag, in field order, with their flags."""
    return [(f, spec) for f in dataclasses.fields(cls) if (spec := flag_of(f)) is not None]


def option_of(cls: type, name: str) -> str:
    """The option string of field ``name`` of ``cls``: what users type, for error messages."""
    for f, spec in flag_fields(cls):
        if f.name == name:
            return spec.option_for(f)
    raise KeyError(f"{cls.__name__} has no flag field {name!r}")


def add_flags(
    parser: argparse.ArgumentParser, cls: type, *, unlisted: frozenset[str] = frozenset()
) -> None:
    """Add an option for every flag field of dataclass ``cls``, in field order, by group.

    A field without a group goes among the parser's own options (after ``-h``). The fields
    named in ``unlisted`` are parsed but left out of the help (a command that refuses them
    says so when they are given)."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f, spec in flag_fields(cls):
        where: Any = parser
        if spec.group is not None:
            if spec.group not in groups:
                groups[spec.group] = parser.add_argument_group(spec.group)
            where = groups[spec.group]
        shown = argparse.SUPPRESS if f.name in unlisted else spec.help
        where.add_argument(
            spec.option_for(f), dest=f.name, help=shown, **_how(f, hints[f.name], spec)
        )


def _how(f: dataclasses.Field[Any], hint: Any, spec: Flag) -> dict[str, Any]:
    """The argparse keywords that parse field ``f``'s values: action, or type and default."""
    kind = _scalar(hint)
    if kind is bool:
        if f.default not in (True, False) or spec.metavar is not None or spec.choices:
            raise TypeError(
                f"bool field {f.name} needs a default of True or False, no metavar or choices"
            )
        return {"action": "store_false" if f.default else "store_true"}
    how: dict[str, Any] = {"metavar": spec.metavar}
    if typing.get_origin(kind) is list:  # repeatable: each use appends one value
        (kind,) = typing.get_args(kind)
        if f.default_factory is not list:
            raise TypeError(f"list field {f.name} needs factory=list")
        how.update(action="append", default=[])
    else:
        how["default"] = None if f.default is dataclasses.MISSING else f.default
    if spec.parse is not None:
        how["type"] = spec.parse
        return how
    if kind not in (int, float, str):
        raise TypeError(f"field {f.name}: no command-line type for {hint!r}")
    if kind is not str:
        how["type"] = kind
    if spec.choices is not None:
        how["choices"] = spec.choices
    return how


def _scalar(hint: Any) -> Any:
    """``X`` for ``X`` or ``X | None``; the hint itself for anything else."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def from_namespace(cls: Callable[..., T], args: argparse.Namespace, **extra: Any) -> T:
    """``cls`` from the parsed flags (and ``extra``, fields without a flag); a flag left at
    None takes a computed default's value."""
    values: dict[str, Any] = dict(extra)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if flag_of(f) is None or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if f.default_factory is not dataclasses.MISSING and value in (None, ""):
            continue  # not given (or given empty): the factory's default, e.g. runs/<timestamp>
        values[f.name] = value
    return cls(**values)
