"""The Synchronizer's option groups (``gradsync.options``): each setting validated once, the old
keywords and the groups resolving alike, a setting given both ways refused, and the flags of
``gradsync run`` that set an option generated from that option's field."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import gradsync as gs
from gradsync.balance import ShardBalancer
from gradsync.errors import UsageError
from gradsync.flags import SOURCE_KEY, flag_of, sourced
from gradsync.options import (
    DEFAULT_TIMEOUT_S,
    GROUP_OF,
    GROUPS,
    Checks,
    Exchange,
    Limits,
    Options,
    Telemetry,
)
from gradsync.runner.cli import build_parser
from gradsync.runner.config import RunConfig

pytestmark = pytest.mark.unit


def _records(records: list[Any]) -> None:
    pass


# -- each group's validation: the bad value named, with what is valid -------------------------

INVALID: list[tuple[type, dict[str, Any], str]] = [
    (Exchange, {"bucket_mb": 0}, "bucket_mb must be a number > 0, None for the default plan"),
    (Exchange, {"bucket_mb": -1.5}, "or 'auto' to time a few plans over the first steps, got -1.5"),
    (Exchange, {"bucket_mb": "big"}, "bucket_mb must be a number > 0"),
    (Exchange, {"bucket_mb": True}, "bucket_mb must be a number > 0"),
    (Exchange, {"allreduce": "tree"}, "allreduce must be one of ring, hierarchical, got 'tree'"),
    (Exchange, {"accumulation": "avg"}, "accumulation must be one of mean, sum, got 'avg'"),
    (Exchange, {"broadcast_buffers": "yes"}, "broadcast_buffers must be True or False, got str"),
    (
        Exchange,
        {"find_unused_parameters": 1},
        "find_unused_parameters must be True or False, got int",
    ),
    (Exchange, {"balance": 2}, "balance must be True, False or a gradsync.ShardBalancer, got int"),
    (Limits, {"timeout_s": "10"}, "timeout_s must be a number of seconds > 0, got '10'"),
    (Limits, {"timeout_s": 0}, "timeout_s must be a number of seconds > 0, got 0"),
    (Limits, {"timeout_s": math.nan}, "timeout_s must be a number of seconds > 0, got nan"),
    (
        Limits,
        {"between_steps_timeout_s": 0},
        "between_steps_timeout_s must be > 0 or None (no gate), got 0",
    ),
    (
        Limits,
        {"between_steps_timeout_s": "1"},
        "between_steps_timeout_s must be > 0 or None (no gate), got '1'",
    ),
    (
        Limits,
        {"gate_group_size": 1},
        "gate_group_size must be an integer >= 2 (ranks counted together at the step gate's "
        "group stores) or None (automatic), got 1",
    ),
    (Telemetry, {"telemetry_every": "10"}, "telemetry_every must be an integer >= 1, got '10'"),
    (Telemetry, {"telemetry_every": 0}, "telemetry_every must be >= 1, got 0"),
    (Telemetry, {"record_spans": None}, "record_spans must be True or False, got NoneType"),
    (Telemetry, {"on_records": 3}, "on_records must be a function taking a list of StepRecord"),
    (Checks, {"check_every": -1}, "check_every must be an integer >= 0 (0 turns the check off)"),
    (Checks, {"check_every": 1.5}, "check_every must be an integer >= 0"),
    (Checks, {"skip_nonfinite": 1}, "skip_nonfinite must be True or False, got int 1"),
]


@pytest.mark.parametrize(
    ("cls", "values", "message"), INVALID, ids=[f"{c.__name__}-{v}" for c, v, _ in INVALID]
)
def test_each_group_refuses_a_bad_value_naming_it(
    cls: type, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(UsageError) as refused:
        cls(**values)
    assert message in str(refused.value)


def test_every_field_of_every_group_is_checked() -> None:
    checked = {(cls, name) for cls, values, _ in INVALID for name in values}
    assert checked == {(cls, f.name) for cls in GROUPS.values() for f in dataclasses.fields(cls)}


def test_the_groups_accept_their_defaults_and_normalise_sizes() -> None:
    assert Options() == Options(
        exchange=Exchange(), limits=Limits(), telemetry=Telemetry(), checks=Checks()
    )
    assert (
        Exchange(bucket_mb=25).bucket_mb == 25.0 and Exchange(bucket_mb="auto").bucket_mb == "auto"
    )
    assert Exchange(bucket_mb=25) == Exchange(bucket_mb=25.0)
    assert Limits(timeout_s=None, between_steps_timeout_s=None).timeout_s is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        Exchange().bucket_mb = 1.0  # type: ignore[misc]


def test_options_refuse_balance_without_telemetry_and_a_group_of_another_kind() -> None:
    with pytest.raises(UsageError, match=r"balance=True needs telemetry"):
        Options(exchange=Exchange(balance=True), telemetry=None)
    with pytest.raises(UsageError, match=r"limits must be a gradsync.options.Limits, got dict"):
        Options(limits={"timeout_s": 3})  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"telemetry must be True, False or a gradsync.options"):
        Options.of({}, telemetry=1)  # type: ignore[arg-type]


# -- the keywords and the groups ----------------------------------------------------------------

#: every setting, by keyword, away from its default
KEYWORDS: dict[str, Any] = {
    "bucket_mb": 25,
    "allreduce": "hierarchical",
    "accumulation": "sum",
    "broadcast_buffers": False,
    "find_unused_parameters": True,
    "balance": True,
    "timeout_s": 60.0,
    "between_steps_timeout_s": None,
    "gate_group_size": 8,
    "telemetry_every": 5,
    "record_spans": True,
    "on_records": _records,
    "check_every": 0,
    "skip_nonfinite": False,
}
GROUPED: dict[str, Any] = {
    "exchange": Exchange(
        bucket_mb=25.0,
        allreduce="hierarchical",
        accumulation="sum",
        broadcast_buffers=False,
        find_unused_parameters=True,
        balance=True,
    ),
    "limits": Limits(timeout_s=60.0, between_steps_timeout_s=None, gate_group_size=8),
    "telemetry": Telemetry(telemetry_every=5, record_spans=True, on_records=_records),
    "checks": Checks(check_every=0, skip_nonfinite=False),
}


def test_every_setting_keyword_is_a_field_with_the_synchronizers_default() -> None:
    """The Synchronizer's signature and the groups agree: a keyword left at its default is
    the group's default (which is what makes it "not given")."""
    parameters = inspect.signature(gs.Synchronizer).parameters
    assert set(KEYWORDS) == set(GROUP_OF)
    for keyword, group in GROUP_OF.items():
        default = {f.name: f.default for f in dataclasses.fields(GROUPS[group])}[keyword]
        assert parameters[keyword].default == default, keyword
    for group in GROUPS:
        assert group in parameters, group  # each group is a keyword of its own


def test_the_keywords_and_the_groups_resolve_alike() -> None:
    assert Options.of(KEYWORDS) == Options(**GROUPED)
    assert Options.of({}, **GROUPED) == Options(**GROUPED)
    # mixed: some groups given, the others' settings as keywords
    exchange = {k: v for k, v in KEYWORDS.items() if GROUP_OF[k] != "exchange"}
    assert Options.of(exchange, exchange=GROUPED["exchange"]) == Options(**GROUPED)
    # telemetry=False: off, whatever its settings (which are still checked)
    off = Options.of({"telemetry_every": 5}, telemetry=False)
    assert off.telemetry is None and off == Options(telemetry=None)
    with pytest.raises(UsageError, match="telemetry_every must be >= 1"):
        Options.of({"telemetry_every": 0}, telemetry=False)


@pytest.mark.parametrize("keyword", sorted(KEYWORDS))
def test_a_setting_given_both_ways_is_refused_naming_both(keyword: str) -> None:
    group = GROUP_OF[keyword]
    with pytest.raises(UsageError) as refused:
        Options.of({keyword: KEYWORDS[keyword]}, **{group: GROUPS[group]()})
    message = str(refused.value)
    assert f"{keyword}={KEYWORDS[keyword]!r}" in message, message
    assert f"{group}={GROUPS[group].__name__}(...)" in message, message
    # at its default, the keyword is not given: the group's value holds
    default = {f.name: f.default for f in dataclasses.fields(GROUPS[group])}[keyword]
    given = GROUPED[group]
    assert getattr(Options.of({keyword: default}, **{group: given}), group) == given


def test_the_resolved_options_fill_in_the_timeout_and_a_run_records_spans() -> None:
    assert Options().resolved().limits.timeout_s == DEFAULT_TIMEOUT_S
    assert Options(limits=Limits(timeout_s=5.0)).resolved().limits.timeout_s == 5.0
    attached = Options().attached(42.0)
    assert attached.limits.timeout_s == 42.0
    assert attached.telemetry is not None and attached.telemetry.record_spans
    assert Options(telemetry=None).attached(42.0).telemetry is None


# -- on a Synchronizer (a one-rank group in this process) ------------------------------------


def _model_and_sgd() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.usefixtures("one_rank")
def test_a_synchronizer_takes_the_keywords_or_the_groups_alike() -> None:
    # allreduce="hierarchical" needs hosts; the rest of the settings, away from the defaults
    keywords = {**KEYWORDS, "allreduce": "ring"}
    grouped = {**GROUPED, "exchange": dataclasses.replace(GROUPED["exchange"], allreduce="ring")}
    made = []
    for how in ({**keywords}, {**grouped}):
        model, sgd = _model_and_sgd()
        sync = gs.Synchronizer(model, sgd, "bsp", **how)
        made.append(sync.options)
        # the settings' old attributes read the resolved options
        assert (sync.timeout_s, sync.allreduce, sync.accumulation) == (60.0, "ring", "sum")
        assert (sync.check_every, sync.record_spans, sync.telemetry_enabled) == (0, True, True)
        assert sync.balancer is not None
        sync.close()
    assert made[0] == made[1] == Options(**grouped)


@pytest.mark.usefixtures("one_rank")
def test_a_synchronizer_refuses_a_setting_given_both_ways() -> None:
    model, sgd = _model_and_sgd()
    with pytest.raises(UsageError) as refused:
        gs.Synchronizer(model, sgd, bucket_mb=25, exchange=Exchange(bucket_mb=10))
    assert "bucket_mb=25 and exchange=Exchange(...) both set bucket_mb" in str(refused.value)
    with pytest.raises(UsageError, match=r"timeout_s=60 and limits=Limits\(...\)"):
        gs.Synchronizer(model, sgd, timeout_s=60, limits=Limits(timeout_s=60))
    with pytest.raises(UsageError, match=r"telemetry_every=5 and telemetry=Telemetry"):
        gs.Synchronizer(model, sgd, telemetry_every=5, telemetry=Telemetry())


@pytest.mark.usefixtures("one_rank")
def test_defaults_and_telemetry_off() -> None:
    model, sgd = _model_and_sgd()
    sync = gs.Synchronizer(model, sgd)
    assert sync.options == Options().resolved()
    sync.close()
    sync = gs.Synchronizer(model, sgd, telemetry=False)
    assert sync.options.telemetry is None and not sync.telemetry_enabled
    assert not sync.record_spans
    sync.close()


@pytest.mark.usefixtures("one_rank")
def test_a_run_directory_chooses_the_timeout_the_script_leaves_out(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"timeout": 42.0, "given": ["timeout"]}))
    model, sgd = _model_and_sgd()
    sync = gs.Synchronizer(model, sgd, run_dir=tmp_path)
    assert sync.options.limits.timeout_s == 42.0 == sync.timeout_s
    assert sync.options.telemetry is not None and sync.options.telemetry.record_spans
    sync.close()
    with pytest.raises(UsageError, match=r"gradsync run --timeout 42.0, but .* timeout_s=10.0"):
        gs.Synchronizer(model, sgd, run_dir=tmp_path, limits=Limits(timeout_s=10.0))


# -- the flags of `gradsync run` that set an option: generated from its field ----------------

#: RunConfig field -> (group, field) whose flag it is
FROM_OPTIONS = {
    "bucket_mb": (Exchange, "bucket_mb"),
    "allreduce": (Exchange, "allreduce"),
    "balance": (Exchange, "balance"),
    "timeout": (Limits, "timeout_s"),
    "check_every": (Checks, "check_every"),
}


def _run_options() -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["run"]._actions if a.option_strings}


def test_the_option_flags_of_run_are_declared_on_the_options_fields() -> None:
    sourced_fields = {
        f.name: f.metadata[SOURCE_KEY]
        for f in dataclasses.fields(RunConfig)
        if SOURCE_KEY in f.metadata
    }
    assert sourced_fields == FROM_OPTIONS
    actions = _run_options()
    for name, (cls, field_name) in FROM_OPTIONS.items():
        declared = flag_of(next(f for f in dataclasses.fields(cls) if f.name == field_name))
        assert declared is not None, (cls, field_name)
        action = actions[name]
        assert action.help == declared.help, name  # the field's own help text
        assert action.metavar == declared.metavar, name
        option = declared.option or "--" + name.replace("_", "-")
        assert action.option_strings == [option], name
        if declared.parse is not None:
            assert action.type is declared.parse, name


def test_the_option_flags_keep_their_names_and_defaults() -> None:
    from gradsync.runner.cli import _Default

    actions = _run_options()
    # run's parser holds the built-in workloads' defaults as _Default (given or not, beside a
    # script: gradsync.runner.cli.HELD_DEFAULTS); their value is the field's default
    shown = {
        actions[n].option_strings[0]: (
            d.value if isinstance(d := actions[n].default, _Default) else d
        )
        for n in FROM_OPTIONS
    }
    assert shown == {
        "--bucket-mb": None,
        "--allreduce": "ring",
        "--balance": False,
        "--timeout": 300.0,
        "--check-every": 100,
    }
    args = build_parser().parse_args(["run", "--bucket-mb", "auto", "--timeout", "60"])
    assert (args.bucket_mb, args.timeout) == ("auto", 60.0)


def test_a_runs_config_builds_the_groups_it_sets() -> None:
    cfg = RunConfig(out="run", bucket_mb=2.0, allreduce="ring", timeout=60.0, check_every=3)
    assert Exchange(**sourced(cfg, Exchange)) == Exchange(bucket_mb=2.0)
    assert Limits(**sourced(cfg, Limits)) == Limits(timeout_s=60.0)
    assert Checks(**sourced(cfg, Checks)) == Checks(check_every=3)
    assert sourced(cfg, Telemetry) == {}
    assert isinstance(Exchange(balance=ShardBalancer(2)).balance, ShardBalancer)


@pytest.mark.usefixtures("one_rank")
def test_a_run_directory_gets_the_records_no_gather_took_when_closed_without_report(
    tmp_path: Path,
) -> None:
    """``close()`` without ``report()`` (a front-door script may never call it): this rank's
    step records that no gather took go into metrics.jsonl, written by the rank itself."""
    model, sgd = _model_and_sgd()
    sync = gs.Synchronizer(model, sgd, run_dir=tmp_path)  # a gather every 10 steps
    for _ in range(3):  # fewer than a gather's 10
        with sync.step():
            model(torch.ones(2, 3)).sum().backward()
    assert not (tmp_path / "metrics.jsonl").exists()
    sync.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [(r["rank"], r["step"]) for r in records] == [(0, 0), (0, 1), (0, 2)]
