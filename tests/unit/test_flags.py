"""The flags of `gradsync run` and `gradsync compare` are RunConfig's fields, declared once.

Every field with a flag has exactly one option in both parsers, with the field's default and a
type that parses it back; every option is a field; and a value RunConfig refuses is refused by
the command line with exit code 2 and RunConfig's own message, naming the option users typed.

The flags of `simulate`, `bench allreduce` and `cluster ...` are declared the same way (on
SimulateOptions, BenchOptions and the cluster actions' dataclasses): their parsers hold exactly
the declared options, with the public defaults and choices pinned below, and no module of theirs
writes an add_argument by hand.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gradsync.processes.launch
import gradsync.telemetry.cli
from gradsync.cluster import cli as cluster_cli
from gradsync.errors import UsageError
from gradsync.flags import add_flags, flag, flag_fields, flag_of, from_namespace, option_of
from gradsync.runner.cli import HELD_DEFAULTS, _config_from_args, _Default, build_parser, main
from gradsync.runner.config import RunConfig
from gradsync.sim import cli as sim_cli
from gradsync.sim import options as sim_options

pytestmark = pytest.mark.unit

#: set by code (library callers, benchmarks) or, for script, by what follows `--`: no flag
CONFIG_ONLY = {"telemetry_every", "script", "replica_group"}
FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
FLAG_FIELDS = sorted(name for name, f in FIELDS.items() if flag_of(f) is not None)


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's options by dest, each dest once; compare's own two left out."""
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    dests = [a.dest for a in actions if a.dest not in ("strategies", "target_loss")]
    assert len(dests) == len(set(dests)), "a field with two options"
    return {a.dest: a for a in actions if a.dest in dests}


@pytest.mark.parametrize("command", ["run", "compare"])
def test_every_field_is_a_flag_and_every_flag_a_field(command: str) -> None:
    options = _options(_subparser(command))
    assert set(FIELDS) - set(options) == CONFIG_ONLY
    assert set(options) == set(FLAG_FIELDS)


@pytest.mark.parametrize("command", ["run", "compare"])
def test_flag_defaults_are_the_fields_defaults(command: str) -> None:
    options = _options(_subparser(command))
    for name in FLAG_FIELDS:
        field, action = FIELDS[name], options[name]
        if command == "compare" and name == "strategy":
            assert action.default is None  # compare refuses --strategy (use --strategies)
        elif field.default_factory is not dataclasses.MISSING:
            assert action.default is None, name  # not given: the factory's value
        else:
            if command == "run" and name in HELD_DEFAULTS:
                # told apart from a given --nproc 4 (--resume takes the saved run's), --link
                assert isinstance(action.default, _Default), name
                assert action.default.value == field.default, name
                assert str(action.default) == str(field.default), name  # help's %(default)s
                continue
            assert action.default == field.default, name
            assert type(action.default) is type(field.default), name


def test_no_flags_give_the_default_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _config_from_args(_subparser("run").parse_args([]))
    assert cfg.out.startswith("runs/")
    assert cfg == RunConfig(out=cfg.out)
    given = _config_from_args(_subparser("run").parse_args(["--out", "there"]))
    assert given.out == "there"


def test_each_flag_parses_its_default_back() -> None:
    """The option's type is the field's: ``--x=<default>`` gives the default, typed alike."""
    options, run = _options(_subparser("run")), _subparser("run")
    for name in FLAG_FIELDS:
        default, option = FIELDS[name].default, options[name].option_strings[0]
        if isinstance(default, bool):
            flipped = vars(run.parse_args([option]))[name]
            assert flipped is (not default), name
        elif default is not None and default is not dataclasses.MISSING:
            parsed = vars(run.parse_args([f"{option}={default}"]))[name]
            assert parsed == default and type(parsed) is type(default), name


# -- a value RunConfig refuses: the same refusal on the command line ------------------------

# Each case: the fields set (one bad value, or a combination), for every check RunConfig makes.
INVALID: list[dict[str, Any]] = [
    {"tracker": "nope"},
    {"nproc": 0},
    {"nproc": 257},
    {"workload": "nope"},
    {"strategy": "nope"},
    {"compression": "nope"},
    {"steps": 0},
    {"batch_size": 0},
    {"micro_batches": 0},
    {"micro_batches": 3},  # does not divide the default batch of 16
    {"threads": 0},
    {"backend": "mpi"},
    {"backend": "nccl", "nproc": 256},  # refused everywhere: no NCCL here, no 256 GPUs anywhere
    {"bucket_mb": 0.0},
    {"allreduce": "tree"},
    {"lr": -1.0},
    {"timeout": 0.0},
    {"timeout": math.inf},
    {"params": 10},
    {"straggler_window": 0},
    {"straggler_threshold": math.nan},
    {"straggler_warmup": -1},
    {"data": "no-such-file.txt"},
    {"balance": True, "strategy": "local:4"},
    {"check_every": -1},
    {"checkpoint_every": -1},
    {"keep_checkpoints": 0},
    {"max_restarts": 1001},
    {"kill": "nope"},
    {"kill": "9:3", "max_restarts": 1},
    {"kill": "1:3"},  # no --max-restarts to survive it
    {"kill": "4:3", "strategy": "async", "max_restarts": 1},  # rank 4 is the server
    {"hosts": -1},
    {"hosts": 3},  # 4 processes do not split over 3 hosts
    {"hosts": 2, "link": "fast"},
    {"servers": 0},
    {"servers": 2},  # bsp runs no servers
    {"slow": "nope"},
    {"slow": "7:2"},
    {"overwrite": True, "resume": True},
    {"timeout": 1e-9},
    {"seed": 2**64},
    {"data": "README.md", "workload": "mlp"},
    {"link": "100mbit"},  # no --hosts
    {"kill": "1:500", "max_restarts": 1},  # past the default 200 steps
    {"lr": 1e308},  # overflows float32 parameters in the first update
    {"lr": math.inf},
    {"batch_size": 1_000_000_000},  # terabytes of activations
    {"replica_groups": 1, "nproc": 1},  # no peer to go on without, or to heal from
    {"replica_groups": 2, "strategy": "zero:3"},  # its collectives would stay in one group
    {"replica_groups": 2, "heartbeat_timeout": 0.1},  # a busy group taken for lost
    {"lighthouse": "http://127.0.0.1:1"},  # no --replica-groups
    {"min_replicas": 3, "replica_groups": 2, "nproc": 1},  # never a quorum
]
ANY_VALUE = {"out", "resume", "progress", "plots"}  # no value of these is refused


def _argv(values: dict[str, Any]) -> list[str]:
    options = _options(_subparser("run"))
    argv = []
    for name, value in values.items():
        option = options[name].option_strings[0]
        argv.append(option if isinstance(value, bool) else f"{option}={value}")
    return argv


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[Any]]:
    calls: list[Any] = []

    def launch(*args: Any, **kwargs: Any) -> dict[int, Any]:
        calls.append(args)
        return {0: {}}

    monkeypatch.setattr(gradsync.processes.launch, "launch", launch)
    monkeypatch.setattr(
        gradsync.telemetry.cli,
        "analyze_run",
        lambda *a, **k: types.SimpleNamespace(format=lambda: "", records=[]),
    )
    monkeypatch.chdir(tmp_path)
    yield calls


def test_every_flag_is_checked_or_takes_any_value() -> None:
    checked = {name for case in INVALID for name in case}
    assert checked | ANY_VALUE == set(FLAG_FIELDS)


@pytest.mark.parametrize("values", INVALID, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
def test_cli_refuses_what_the_config_refuses_with_its_message(
    values: dict[str, Any], capsys: pytest.CaptureFixture[str], no_launch: list[Any]
) -> None:
    with pytest.raises(UsageError) as refused:
        RunConfig(out="run", **values)
    code = main(["run", "--out=run", *_argv(values)])
    err = capsys.readouterr().err
    assert code == 2 and not no_launch
    assert err.splitlines() == [f"gradsync: error: {refused.value}"]
    # It names what the user typed: the option, or (spec parsers) the bad value itself.
    options = _options(_subparser("run"))
    typed = [options[n].option_strings[0] for n in values] + [repr(str(v)) for v in values.values()]
    assert any(text in str(refused.value) for text in typed), refused.value


def test_cli_launches_what_the_config_accepts(
    capsys: pytest.CaptureFixture[str], no_launch: list[Any]
) -> None:
    values = {"nproc": 2, "workload": "mlp", "compression": "fp16", "lr": 0.5, "balance": True}
    code = main(["run", "--out=run", "--no-plots", "--no-progress", *_argv(values)])
    assert code == 0, capsys.readouterr().err
    (config,) = no_launch[0][1]
    assert {k: config[k] for k in values} == values
    assert config["plots"] is False and config["progress"] is False


# -- gradsync.flags on a config of its own ---------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class Toy:
    count: int = flag(3, metavar="N", help="count (default: %(default)s)", group="toy")
    rate: float | None = flag(None, help="rate (default: none)", group="toy")
    name: str = flag("a", option="--label", help="name (default: %(default)s)", group="other")
    loud: bool = flag(True, help="quiet (default: loud)", group="toy")
    dry: bool = flag(False, help="dry run (default: off)", group="toy")
    tag: str = flag(factory=lambda: "made", help="tag (default: made)", group="other")
    hidden: int = 0


def test_add_flags_derives_options_types_and_groups() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, Toy)
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert groups["toy"] == ["count", "rate", "loud", "dry"]
    assert groups["other"] == ["name", "tag"]
    args = parser.parse_args(["--count=5", "--rate=0.5", "--label=b", "--no-loud", "--dry"])
    assert from_namespace(Toy, args) == Toy(count=5, rate=0.5, name="b", loud=False, dry=True)
    assert from_namespace(Toy, parser.parse_args([])) == Toy()
    assert from_namespace(Toy, parser.parse_args(["--tag="])).tag == "made"
    with pytest.raises(SystemExit):
        parser.parse_args(["--count=x"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--hidden=1"])


@dataclasses.dataclass(kw_only=True)
class Toy2:
    kind: str = flag("a", choices=("a", "b"), help="a | b")
    seen: list[str] = flag(factory=list, metavar="X", help="repeatable", group="toy")
    sizes: list[int] = flag(factory=list, help="repeatable ints")


def test_add_flags_choices_lists_and_the_parsers_own_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, Toy2)
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert groups["options"] == ["help", "kind", "sizes"]  # no group: beside -h
    assert groups["toy"] == ["seen"]
    assert from_namespace(Toy2, parser.parse_args([])) == Toy2()
    args = parser.parse_args(["--kind=b", "--seen=x", "--seen=y", "--sizes=3"])
    assert from_namespace(Toy2, args) == Toy2(kind="b", seen=["x", "y"], sizes=[3])
    assert parser.parse_args([]).seen == []  # the default list is not shared across parses
    with pytest.raises(SystemExit):
        parser.parse_args(["--kind=c"])
    assert "invalid choice: 'c'" in capsys.readouterr().err


def test_a_field_argparse_cannot_parse_is_refused() -> None:
    @dataclasses.dataclass
    class NoFactory:
        seen: list[str] = flag(None, help="x")

    @dataclasses.dataclass
    class BoolChoices:
        on: bool = flag(False, choices=("a",), help="x")

    @dataclasses.dataclass
    class Dict:
        d: dict[str, int] = flag(factory=dict, help="x")

    for cls in (NoFactory, BoolChoices, Dict):
        with pytest.raises(TypeError):
            add_flags(argparse.ArgumentParser(), cls)


# -- simulate, bench allreduce and cluster: declared once too ---------------------------------

# Each command's options and the dataclass that declares them.
DECLARED: dict[str, type] = {
    "simulate": sim_options.SimulateOptions,
    "bench allreduce": sim_options.BenchOptions,
    "cluster up": cluster_cli.UpOptions,
    "cluster down": cluster_cli.DownOptions,
    "cluster status": cluster_cli.ClusterOptions,
    "cluster probe": cluster_cli.ProbeOptions,
}

# The public command line, pinned: option -> default, as before the flags were declarations
# (scripts depend on these). Choices are pinned in CHOICES.
PUBLIC: dict[str, dict[str, Any]] = {
    "simulate": {
        "--workers": None,
        "--steps": 100,
        "--compute": "20",
        "--jitter": 0.0,
        "--straggler": [],
        "--transient": None,
        "--seed": 0,
        "--comm-ms": None,
        "--message-mb": None,
        "--alpha-us": None,
        "--link-gbps": None,
        "--algorithm": None,
        "--calibration": None,
        "--gate-store-rate": None,
        "--gate-rtt-ms": 0.1,
        "--gate-group-size": None,
        "--compression-ratio": 1.0,
        "--hosts": None,
        "--allreduce": "ring",
        "--intra-gbps": None,
        "--intra-alpha-us": None,
        "--strategy": None,
        "--layers": None,
        "--overlap": False,
        "--backward-frac": 2 / 3,
        "--buckets": 4,
        "--sweep-staleness": None,
        "--sweep-workers": None,
        "--strategies": "bsp,zero:1,zero:2,ssp:4,async,local:8",
        "--plot-dir": None,
        "--table-steps": 20,
        "--json": False,
        "--from": None,
        "--remove-straggler": False,
        "--warmup": 2,
        "--resample": "steps",
        "--failures": False,
        "--gpus": None,
        "--failure-rate": None,
        "--step-s": None,
        "--checkpoint-every": None,
        "--restart-s": None,
        "--stall-s": None,
        "--heal-s": None,
        "--group-gpus": None,
    },
    "bench allreduce": {
        "--nproc": 2,
        "--sizes": None,
        "--repeats": 20,
        "--out": None,
        "--json": False,
    },
    "cluster up": {
        "--prefix": "gs-",
        "--hosts": 2,
        "--link": "1gbit",
        "--burst": None,
        "--name": None,
    },
    "cluster down": {"--prefix": "gs-", "--name": None},
    "cluster status": {"--prefix": "gs-"},
    "cluster probe": {
        "--prefix": "gs-",
        "--hosts": 2,
        "--link": "1gbit",
        "--burst": None,
        "--size-mb": 8.0,
        "--iters": 3,
        "--warmup": 1,
        "--nproc-per-host": 1,
        "--timeout": 300.0,
        "--json": None,
    },
}
CHOICES = {
    ("simulate", "--algorithm"): ("ring", "tree", "binary_tree", "rhd"),
    ("simulate", "--allreduce"): ("ring", "hierarchical"),
    ("simulate", "--resample"): ("steps", "ranks"),
}


def _command(path: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = build_parser()
    for name in path.split():
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _all_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("path", sorted(DECLARED))
def test_every_option_is_a_declared_field_and_no_other(path: str) -> None:
    """A flag added with a hand-written add_argument (or a parent parser) fails here: the
    parser's options are exactly the declaration's fields, in order, with their defaults."""
    cls = DECLARED[path]
    declared = [(spec.option_for(f), f.name) for f, spec in flag_fields(cls)]
    actions = _all_options(_command(path))
    assert [(a.option_strings[0], a.dest) for a in actions] == declared
    assert all(len(a.option_strings) == 1 for a in actions)
    for (f, spec), action in zip(flag_fields(cls), actions, strict=True):
        default = [] if f.default_factory is list else f.default
        assert action.default == default and type(action.default) is type(default), f.name
        assert action.choices == spec.choices and action.help == spec.help, f.name
    # not given: the declaration's defaults (its __post_init__'s checks pass on them)
    assert from_namespace(cls, _command(path).parse_args([])) == cls()


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_the_public_flags_keep_their_names_defaults_and_choices(path: str) -> None:
    actions = {a.option_strings[0]: a for a in _all_options(_command(path))}
    assert {o: a.default for o, a in actions.items()} == PUBLIC[path]
    choices = {o: tuple(a.choices) for o, a in actions.items() if a.choices is not None}
    assert choices == {o: c for (p, o), c in CHOICES.items() if p == path}


@pytest.mark.parametrize("module", [sim_cli, sim_options, cluster_cli])
def test_no_hand_written_options_in_the_command_modules(module: Any) -> None:
    """Their flags are dataclass fields; gradsync.flags alone calls add_argument."""
    tree = ast.parse(Path(module.__file__).read_text())
    calls = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("add_argument", "add_argument_group", "add_mutually_exclusive_group")
    ]
    assert calls == [], f"{module.__name__}: add_argument at lines {calls}"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["simulate", "--algorithm", "nope"], ["'nope'", "'ring'", "'rhd'"]),
        (["simulate", "--allreduce", "flat"], ["'flat'", "'ring'", "'hierarchical'"]),
        (["simulate", "--resample", "rows"], ["'rows'", "'steps'", "'ranks'"]),
        (["simulate", "--workers", "two"], ["--workers", "'two'"]),
        (["bench", "allreduce", "--repeats", "x"], ["--repeats", "'x'"]),
        (["cluster", "probe", "--size-mb", "big"], ["--size-mb", "'big'"]),
        (["cluster", "up", "--hosts", "1.5"], ["--hosts", "'1.5'"]),
    ],
)
def test_a_bad_value_is_named_with_what_is_valid(
    argv: list[str], named: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"gradsync {' '.join(argv[:-2])}: error: argument {argv[-2]}")
    for text in named:
        assert text in err, (text, err)


def test_option_of_names_what_users_type() -> None:
    assert option_of(sim_options.SimulateOptions, "from_run") == "--from"
    assert option_of(cluster_cli.ProbeOptions, "json_out") == "--json"
    assert option_of(RunConfig, "plots") == "--no-plots"
    with pytest.raises(KeyError):
        option_of(RunConfig, "telemetry_every")
