"""gradsync.spec: the one torch-free parser of strategy and compression spec strings."""

from __future__ import annotations

import ast
import math
import re
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradsync.spec as spec_module
from gradsync.errors import UsageError
from gradsync.spec import (
    COMPRESSION_FORMS,
    COMPRESSION_TABLE,
    STRATEGY_FORMS,
    STRATEGY_TABLE,
    CompressionSpec,
    StrategyForm,
    StrategySpec,
    parse_compression_spec,
    parse_strategy_spec,
)

pytestmark = pytest.mark.unit

# The texts the messages end with, as the API has always printed them.
STRATEGY_TEXT = (
    "bsp, zero:N, local:H, "
    "diloco:H[:F[:TAU[:ALPHA]|:eager][:SPLIT]][:outer_lr=X][:outer_momentum=M], "
    "ssp:S, async, hogwild, gossip:H, noloco:H[:outer_lr=X][:outer_momentum=M] "
    "(N 1, 2 or 3, H an integer >= 1, F an integer from 1 to H, TAU an integer >= 0 below H/F, "
    "ALPHA in [0, 1] or keep (TAU >= 1), SPLIT rows or layers, X > 0 (default 0.7), "
    "M in [0, 1) (default 0.9), S an integer >= 0 or inf)"
)
COMPRESSION_TEXT = (
    "none, fp16, bf16, int8, int4, sign, topk:FRACTION, randomk:FRACTION (0 < FRACTION <= 1), "
    "powersgd:RANK (integer >= 1), sparseloco[:DENSITY[:CHUNK[:BETA]]] (0 < DENSITY <= 1, "
    "CHUNK an integer from 16 to 65536, 0 <= BETA <= 1)"
)


def test_the_forms_are_written_from_the_tables_as_before() -> None:
    assert STRATEGY_FORMS == STRATEGY_TEXT
    assert COMPRESSION_FORMS == COMPRESSION_TEXT
    assert [f.usage for f in STRATEGY_TABLE.values()] == [
        "bsp",
        "zero:N",
        "local:H",
        "diloco:H[:F[:TAU[:ALPHA]|:eager][:SPLIT]][:outer_lr=X][:outer_momentum=M]",
        "ssp:S",
        "async",
        "hogwild",
        "gossip:H",
        "noloco:H[:outer_lr=X][:outer_momentum=M]",
    ]


# -- strategies --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected", "canonical"),
    [
        ("bsp", StrategySpec(kind="bsp"), "bsp"),
        (" BSP\t", StrategySpec(kind="bsp"), "bsp"),
        ("async", StrategySpec(kind="async"), "async"),
        ("local:8", StrategySpec(kind="local", period=8), "local:8"),
        ("local:1", StrategySpec(kind="local", period=1), "local:1"),
        ("DiLoCo:32", StrategySpec(kind="diloco", period=32), "diloco:32"),
        ("diloco: 4 ", StrategySpec(kind="diloco", period=4), "diloco:4"),
        ("ssp:0", StrategySpec(kind="ssp", staleness=0.0), "ssp:0"),
        ("ssp:3", StrategySpec(kind="ssp", staleness=3.0), "ssp:3"),
        ("SSP:INF", StrategySpec(kind="ssp", staleness=math.inf), "ssp:inf"),
        ("ssp: inf", StrategySpec(kind="ssp", staleness=math.inf), "ssp:inf"),
    ],
)
def test_valid_strategy_specs_round_trip_through_str(
    text: str, expected: StrategySpec, canonical: str
) -> None:
    parsed = parse_strategy_spec(text)
    assert parsed == expected
    assert str(parsed) == canonical
    assert parse_strategy_spec(str(parsed)) == parsed


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "unknown strategy ''"),
        ("sgd", "unknown strategy 'sgd'"),
        ("bps", "unknown strategy 'bps'"),
        ("ssp :3", "unknown strategy 'ssp :3'"),
        ("bsp:1", "bsp takes no parameter"),
        ("async:2", "async takes no parameter"),
        ("bsp:", "bsp takes no parameter"),
        ("local", "unknown strategy 'local': local needs a parameter, as in local:H"),
        ("diloco:", "diloco needs a parameter, as in diloco:H"),
        ("ssp", "unknown strategy 'ssp': ssp needs a parameter, as in ssp:S"),
        ("local:0", "H must be an integer >= 1"),
        ("local:-3", "H must be an integer >= 1"),
        ("diloco:x", "H must be an integer >= 1"),
        ("local:inf", "H must be an integer >= 1"),
        ("local:2.5", "H must be an integer >= 1"),
        ("ssp:-1", "S must be an integer >= 0 or inf"),
        ("ssp:1.5", "S must be an integer >= 0 or inf"),
        ("ssp:-inf", "S must be an integer >= 0 or inf"),
        ("ssp:nan", "S must be an integer >= 0 or inf"),
        ("ssp:" + "9" * 400, "is too large for a float; use inf"),
    ],
)
def test_every_invalid_strategy_spec_names_the_value_and_the_forms(text: str, says: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_strategy_spec(text)
    message = str(err.value)
    assert repr(text) in message
    assert message.endswith(f"valid: {STRATEGY_FORMS}")
    assert says in message
    assert isinstance(err.value, ValueError)  # the API promises ValueError for bad specs


@pytest.mark.parametrize("value", [None, 4, b"bsp", ["bsp"]])
def test_a_strategy_that_is_not_a_string_is_a_usage_error(value: object) -> None:
    with pytest.raises(UsageError) as err:
        parse_strategy_spec(value)  # type: ignore[arg-type]
    assert f"got {type(value).__name__}" in str(err.value)
    assert STRATEGY_FORMS in str(err.value)


def test_strategy_spec_str_of_a_spec_built_by_hand() -> None:
    # The same canonical text strategies/base.py's StrategySpec has always written.
    assert str(StrategySpec(kind="ssp")) == "ssp:0"
    assert str(StrategySpec(kind="ssp", staleness=2.0)) == "ssp:2"
    assert str(StrategySpec(kind="local", period=3)) == "local:3"
    assert str(StrategySpec(kind="nosuchkind")) == "nosuchkind"  # a kind no form describes


def test_strategy_spec_is_a_frozen_keyword_only_value() -> None:
    spec = parse_strategy_spec("local:4")
    with pytest.raises(AttributeError):
        spec.period = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        StrategySpec("bsp")  # type: ignore[misc]
    assert {spec, parse_strategy_spec("LOCAL:4")} == {spec}


def test_which_strategies_use_servers() -> None:
    texts = ("bsp", "local:2", "diloco:2", "ssp:1", "async")
    uses = {text: parse_strategy_spec(text).uses_servers for text in texts}
    assert uses == {"bsp": False, "local:2": False, "diloco:2": False, "ssp:1": True, "async": True}
    assert not StrategySpec(kind="gossip").uses_servers


def _stage(text: str) -> dict[str, int]:
    if text not in ("1", "2", "3"):
        raise ValueError(text)
    return {"period": int(text)}


def test_a_new_strategy_is_one_table_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {
        **STRATEGY_TABLE,
        "hogwild": StrategyForm("hogwild", servers=True),
        "stage": StrategyForm(
            "stage",
            "N",
            "1, 2 or 3",
            _stage,
            lambda s: str(s.period),
        ),
    }
    monkeypatch.setattr(spec_module, "STRATEGY_TABLE", table)
    assert spec_module._strategy_forms(table) == (
        "bsp, zero:N, local:H, "
        "diloco:H[:F[:TAU[:ALPHA]|:eager][:SPLIT]][:outer_lr=X][:outer_momentum=M], "
        "ssp:S, async, hogwild, gossip:H, noloco:H[:outer_lr=X][:outer_momentum=M], "
        "stage:N (N 1, 2 or 3, H an integer >= 1, F an integer from 1 to H, TAU an integer >= 0 "
        "below H/F, ALPHA in [0, 1] or keep (TAU >= 1), SPLIT rows or layers, X > 0 "
        "(default 0.7), M in [0, 1) (default 0.9), S an integer >= 0 or inf)"
    )
    hogwild = parse_strategy_spec("Hogwild")
    assert (hogwild, str(hogwild), hogwild.uses_servers) == (
        StrategySpec(kind="hogwild"),
        "hogwild",
        True,
    )
    assert str(parse_strategy_spec("stage:2")) == "stage:2"
    with pytest.raises(UsageError, match="N must be 1, 2 or 3"):
        parse_strategy_spec("stage:4")


def _typed(kinds: list[str]) -> st.SearchStrategy[str]:
    """Any text, or a known kind (in any case, with blanks) with any argument text."""
    kind = st.sampled_from(kinds).flatmap(
        lambda k: st.tuples(st.sampled_from(["", " "]), st.sampled_from([k, k.upper()]))
    )
    typed = st.tuples(kind, st.sampled_from([":", ": ", ""]), st.text()).map(
        lambda t: f"{t[0][0]}{t[0][1]}{t[1]}{t[2]}"
    )
    return st.one_of(st.text(), typed)


@settings(max_examples=300, deadline=None)
@given(text=_typed(list(STRATEGY_TABLE)))
def test_any_strategy_text_round_trips_or_names_the_forms(text: str) -> None:
    try:
        parsed = parse_strategy_spec(text)
    except UsageError as exc:
        assert STRATEGY_FORMS in str(exc) and repr(text) in str(exc)
    else:
        assert parse_strategy_spec(str(parsed)) == parsed


# -- compression -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected", "canonical"),
    [
        ("none", CompressionSpec(kind="none"), "none"),
        (" FP16 ", CompressionSpec(kind="fp16"), "fp16"),
        ("bf16", CompressionSpec(kind="bf16"), "bf16"),
        ("int8", CompressionSpec(kind="int8"), "int8"),
        ("sign", CompressionSpec(kind="sign"), "sign"),
        ("topk:0.01", CompressionSpec(kind="topk", argument=0.01), "topk:0.01"),
        ("TopK: 1", CompressionSpec(kind="topk", argument=1.0), "topk:1.0"),
        ("randomk:0.25", CompressionSpec(kind="randomk", argument=0.25), "randomk:0.25"),
        ("powersgd:4", CompressionSpec(kind="powersgd", argument=4), "powersgd:4"),
    ],
)
def test_valid_compression_specs_round_trip_through_str(
    text: str, expected: CompressionSpec, canonical: str
) -> None:
    parsed = parse_compression_spec(text)
    assert parsed == expected
    assert str(parsed) == canonical
    assert parse_compression_spec(str(parsed)) == parsed


def test_no_compression_is_none() -> None:
    assert parse_compression_spec(None) == CompressionSpec(kind="none")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "unknown compressor ''"),
        ("int3", "unknown compressor 'int3'"),
        ("fp16:2", "fp16 takes no argument"),
        ("none:", "none takes no argument"),
        ("topk", "topk needs a fraction, as in topk:0.01"),
        ("randomk:", "randomk needs a fraction, as in randomk:0.01"),
        ("randomk:abc", "fraction 'abc' is not a number"),
        ("topk:0", "fraction 0 is outside (0, 1]"),
        ("topk:1.5", "fraction 1.5 is outside (0, 1]"),
        ("topk:-0.1", "fraction -0.1 is outside (0, 1]"),
        ("topk:nan", "fraction nan is outside (0, 1]"),
        ("powersgd", "powersgd needs a rank, as in powersgd:4"),
        ("powersgd:1.5", "rank '1.5' is not an integer"),
        ("powersgd:0", "rank 0 must be at least 1"),
    ],
)
def test_every_invalid_compression_spec_names_the_value_and_the_forms(
    text: str, reason: str
) -> None:
    with pytest.raises(UsageError) as err:
        parse_compression_spec(text)
    assert str(err.value) == (
        f"invalid compression spec {text!r}: {reason}; valid forms: {COMPRESSION_FORMS}"
    )


def test_a_compression_that_is_not_a_string_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="got int 4; valid forms: none, fp16"):
        parse_compression_spec(4)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(text=_typed(list(COMPRESSION_TABLE)))
def test_any_compression_text_round_trips_or_names_the_forms(text: str) -> None:
    try:
        parsed = parse_compression_spec(text)
    except UsageError as exc:
        assert COMPRESSION_FORMS in str(exc) and repr(text) in str(exc)
    else:
        assert parse_compression_spec(str(parsed)) == parsed


# -- the callers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["none", "fp16", "bf16", "int8", "sign", "topk:0.5", "randomk:0.5", "powersgd:2"]
)
def test_the_compressor_built_from_a_spec_reports_the_spec(text: str) -> None:
    from gradsync.compression.spec import BUILDERS, VALID_FORMS, parse_compression

    assert set(BUILDERS) == set(COMPRESSION_TABLE)  # every form has a compressor
    assert VALID_FORMS == COMPRESSION_FORMS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert parse_compression(text).spec == str(parse_compression_spec(text))


@pytest.mark.parametrize("text", ["gossip", "ssp", "local:0", "ssp:-1", "async:2", "diloco:x"])
def test_the_simulator_refuses_a_spec_with_the_same_message(text: str) -> None:
    from gradsync.sim.config import parse_sim_strategy

    with pytest.raises(UsageError) as shared:
        parse_strategy_spec(text)
    with pytest.raises(UsageError) as sim:
        parse_sim_strategy(text)
    assert str(sim.value) == str(shared.value)


@pytest.mark.parametrize(
    ("kind", "param", "typed"),
    [
        ("local", 0, "local:0"),
        ("ssp", -1.0, "ssp:-1"),
        ("ssp", 0.5, "ssp:0.5"),
        ("bsp", 2, "bsp:2"),
    ],
)
def test_a_simulated_strategy_built_by_hand_gets_the_message_of_its_spec(
    kind: str, param: float, typed: str
) -> None:
    from gradsync.sim.config import SimStrategy

    with pytest.raises(UsageError) as shared:
        parse_strategy_spec(typed)
    with pytest.raises(UsageError) as sim:
        SimStrategy(kind=kind, param=param)
    assert str(sim.value) == str(shared.value)


def test_the_simulator_reads_every_simulated_spec_like_the_parser() -> None:
    from gradsync.sim.config import parse_sim_strategy

    for text in ("bsp", "async", "ssp:0", "ssp:inf", "local:8", "diloco:2"):
        assert parse_sim_strategy(text).spec == str(parse_strategy_spec(text))
    assert parse_sim_strategy("ssp:inf").param == math.inf


def _imports(path: Path, package: str) -> set[str]:
    """The modules ``path`` imports anywhere (lazily too), except under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {
        id(node)
        for top in ast.walk(tree)
        if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
        for node in ast.walk(top)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith(package)}


def test_the_simulator_modules_import_no_cycle() -> None:
    """``gradsync.sim.cli`` and ``gradsync.sim.commands`` used to import each other."""
    import gradsync.sim

    root = Path(gradsync.sim.__file__).parent
    modules = {f"gradsync.sim.{p.stem}": p for p in root.glob("*.py") if p.stem != "__init__"}
    graph = {name: _imports(path, "gradsync.sim.") & set(modules) for name, path in modules.items()}

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    cycles = sorted(name for name in graph if name in reachable(name))
    assert not cycles, {name: sorted(graph[name]) for name in cycles}
    assert "gradsync.sim.options" in graph["gradsync.sim.commands"]


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("diloco:16:outer_lr=1:outer_momentum=0", "diloco:16:outer_lr=1.0:outer_momentum=0.0"),
        ("diloco:16:outer_momentum=0.5", "diloco:16:outer_momentum=0.5"),
        (
            "diloco:4:2:1:outer_lr=1.0:outer_momentum=0",
            "diloco:4:2:1:outer_lr=1.0:outer_momentum=0.0",
        ),
        ("diloco:8:3:layers:outer_lr=0.5", "diloco:8:3:1:layers:outer_lr=0.5"),
        ("diloco:16:outer_lr=0.7:outer_momentum=0.9", "diloco:16"),  # the defaults are not kept
        ("diloco:4:1:0:0: outer_lr = 1 ", "diloco:4:outer_lr=1.0"),
    ],
)
def test_diloco_outer_optimizer_options_parse_to_one_canonical_spec(
    text: str, canonical: str
) -> None:
    spec = parse_strategy_spec(text)
    assert str(spec) == canonical
    assert parse_strategy_spec(str(spec)) == spec


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("diloco:16:lr=1", "lr= is not a diloco option; it takes outer_lr=X"),
        ("noloco:4:foo=1", "foo= is not a noloco option; it takes outer_lr=X"),  # was diloco
        ("diloco:16:outer_lr=0", "outer_lr=0 must be a number > 0"),
        ("diloco:16:outer_lr=inf", "outer_lr=inf must be a number > 0"),
        ("diloco:16:outer_lr=x", "outer_lr=x must be a number > 0"),
        ("diloco:16:outer_momentum=1", "outer_momentum=1 must be a number from 0 to below 1"),
        ("diloco:16:outer_lr=1:outer_lr=2", "outer_lr= is given twice"),
        ("local:4:outer_lr=1", "local"),
    ],
)
def test_bad_diloco_outer_optimizer_options_are_refused_naming_the_rule(
    text: str, why: str
) -> None:
    with pytest.raises(UsageError, match=re.escape(why)):
        parse_strategy_spec(text)


def test_the_outer_options_reach_the_strategy_built_from_a_spec() -> None:
    from gradsync.strategies import DiLoCo, parse_strategy

    built = parse_strategy("diloco:4:2:1:outer_lr=1:outer_momentum=0")
    assert isinstance(built, DiLoCo)
    assert (built.outer.outer_lr, built.outer.outer_momentum) == (1.0, 0.0)
    assert built.spec == "diloco:4:2:1:outer_lr=1.0:outer_momentum=0.0"
    by_hand = DiLoCo(4, outer_lr=1.0, outer_momentum=0.0, fragments=2)
    assert by_hand.spec == built.spec
    assert parse_strategy("diloco:16").outer == DiLoCo(16).outer  # type: ignore[attr-defined]
