"""Property-based tests over `gradsync run` flags and the spec parsers behind them.

The property: a user error exits with code 2 and one ``gradsync: error:`` line naming the bad
value (or argparse's usage message for a value of the wrong type), never a traceback; valid
input reaches the launcher with the values given. ``gradsync.runner.cli.main`` runs in-process with
the launcher stubbed, so no worker is ever started.
"""

from __future__ import annotations

import itertools
import math
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import gradsync.processes.launch
import gradsync.telemetry.cli
from gradsync.compression import VALID_FORMS, parse_compression
from gradsync.inject import MAX_FACTOR, SLOW_FORM, parse_slow
from gradsync.runner.cli import main
from gradsync.runner.config import MAX_LR
from gradsync.strategies import STRATEGY_FORMS, StrategySpec, parse_strategy_spec
from gradsync.workloads import physical_memory, step_bytes

pytestmark = pytest.mark.unit

# capsys and monkeypatch are function-scoped: every example resets capsys by reading it, and
# the stubs are the same for every example, so sharing them across examples is sound.
PROPERTY = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
DEFAULT_BATCH = 16  # RunConfig's default --batch-size, which --micro-batches must divide
# The largest --batch-size of run_cli's run (4 mlp workers) this machine's memory holds.
MAX_BATCH = (physical_memory() or 2**62) // (4 * step_bytes("mlp", 100_000, 1, 4))


class Launches:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def launch(self, entrypoint: Any, args: tuple[Any, ...] = (), **kwargs: Any) -> dict[int, Any]:
        self.calls.append({"config": args[0], **kwargs})
        return {0: {"report": None}}


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Launches]:
    stub = Launches()
    # cmd_run imports launch at call time, so patching the module attribute is what it sees.
    monkeypatch.setattr(gradsync.processes.launch, "launch", stub.launch)
    monkeypatch.setattr(
        gradsync.telemetry.cli,
        "analyze_run",
        lambda *a, **k: types.SimpleNamespace(format=lambda: "", records=[]),
    )
    monkeypatch.chdir(tmp_path)  # any default runs/<timestamp> lands in the test's directory
    yield stub


#: a fresh --out for every call: gradsync run refuses a directory that already holds a run
_RUNS = itertools.count()


def run_cli(capsys: pytest.CaptureFixture[str], launches: Launches, *flags: str) -> Outcome:
    capsys.readouterr()
    launches.calls.clear()
    out = f"--out=run-{next(_RUNS)}"
    argv = ["run", "--workload=mlp", out, "--no-progress", "--no-plots", *flags]
    try:
        code = main(argv)
        argparse_error = False
    except SystemExit as exc:  # argparse's own errors (a value of the wrong type)
        code = exc.code if isinstance(exc.code, int) else 1
        argparse_error = True
    out, err = capsys.readouterr()
    return Outcome(code, out, err, argparse_error, list(launches.calls))


class Outcome:
    def __init__(
        self, code: int, out: str, err: str, argparse_error: bool, calls: list[dict[str, Any]]
    ) -> None:
        self.code, self.out, self.err = code, out, err
        self.argparse_error, self.calls = argparse_error, calls

    def assert_launched(self, **config: Any) -> dict[str, Any]:
        assert self.code == 0, self.err
        assert "Traceback" not in self.err + self.out
        assert len(self.calls) == 1
        cfg: dict[str, Any] = self.calls[0]["config"]
        for key, value in config.items():
            assert cfg[key] == value or (
                isinstance(value, float) and math.isnan(value) and math.isnan(cfg[key])
            ), key
        return cfg

    def assert_user_error(self, *names: str) -> str:
        """Exit 2, no launch, no traceback; return the one error line, which holds ``names``."""
        assert self.code == 2, (self.code, self.err)
        assert not self.calls
        assert "Traceback" not in self.err + self.out
        if self.argparse_error:
            assert self.err.startswith("usage: gradsync run")
            lines = [ln for ln in self.err.splitlines() if ln.startswith("gradsync run: error: ")]
        else:
            lines = [ln for ln in self.err.splitlines() if "error" in ln]
            assert all(ln.startswith("gradsync: error: ") for ln in lines), self.err
        assert len(lines) == 1, self.err
        for name in names:
            assert name in lines[0], (name, lines[0])
        return lines[0]


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# -- integer flags ---------------------------------------------------------------------------

INT_FLAGS = {
    "--nproc": ("nproc", lambda v: 1 <= v <= 256),  # more is not a local job (MAX_LOCAL_PROCESSES)
    "--steps": ("steps", lambda v: v >= 1),
    "--batch-size": ("batch_size", lambda v: 1 <= v <= MAX_BATCH),  # --micro-batches 1: any
    "--micro-batches": ("micro_batches", lambda v: v >= 1 and DEFAULT_BATCH % v == 0),
    "--servers": ("servers", lambda v: v == 1),  # bsp (the default) runs no servers
}
# bounded: Python refuses to parse ints of more than 4300 digits (argparse would say so)
SMALL_OR_ANY_INT = st.one_of(st.integers(-3, 40), st.integers(-(10**30), 10**30))


def _at_boundaries(flags: Any, values: tuple[Any, ...]) -> Any:
    """Always try every flag at its boundary values, besides what hypothesis draws."""

    def decorate(test: Any) -> Any:
        for flag in flags:
            for value in values:
                test = example(flag=flag, value=value)(test)
        return test

    return decorate


@PROPERTY
@given(flag=st.sampled_from(sorted(INT_FLAGS)), value=SMALL_OR_ANY_INT)
@_at_boundaries(INT_FLAGS, (-1, 0, 1, 2))
@example(flag="--batch-size", value=MAX_BATCH)
@example(flag="--batch-size", value=MAX_BATCH + 1)
def test_int_flags(
    capsys: pytest.CaptureFixture[str], launches: Launches, flag: str, value: int
) -> None:
    field, valid = INT_FLAGS[flag]
    outcome = run_cli(capsys, launches, f"{flag}={value}")
    if valid(value):
        cfg = outcome.assert_launched(**{field: value})
        if flag == "--nproc":
            assert outcome.calls[0]["nproc"] == value  # bsp: no server ranks
        assert cfg["strategy"] == "bsp"
    else:
        outcome.assert_user_error(flag, str(value))


@PROPERTY
@given(flag=st.sampled_from(sorted(INT_FLAGS)), text=st.text().filter(lambda s: not _is_int(s)))
def test_int_flags_reject_non_integers(
    capsys: pytest.CaptureFixture[str], launches: Launches, flag: str, text: str
) -> None:
    outcome = run_cli(capsys, launches, f"{flag}={text}")
    outcome.assert_user_error(flag, "invalid int value", repr(text))


@PROPERTY
@given(batch=st.integers(1, 64), micro=st.integers(1, 64))
def test_micro_batches_must_divide_the_batch(
    capsys: pytest.CaptureFixture[str], launches: Launches, batch: int, micro: int
) -> None:
    outcome = run_cli(capsys, launches, f"--batch-size={batch}", f"--micro-batches={micro}")
    if batch % micro == 0:
        outcome.assert_launched(batch_size=batch, micro_batches=micro)
    else:
        outcome.assert_user_error(f"--batch-size {batch}", f"--micro-batches {micro}")


# -- float flags -----------------------------------------------------------------------------

FLOAT_FLAGS = {"--bucket-mb": "bucket_mb", "--lr": "lr"}
ANY_FLOAT = st.one_of(
    st.floats(), st.sampled_from([0.0, -0.0, 1e-300, 1e300, math.inf, -math.inf, math.nan])
)


@PROPERTY
@given(flag=st.sampled_from(sorted(FLOAT_FLAGS)), value=ANY_FLOAT)
@_at_boundaries(FLOAT_FLAGS, (0.0, -0.0, math.nan, 5e-324, math.inf))
@example(flag="--lr", value=MAX_LR)
@example(flag="--lr", value=math.nextafter(MAX_LR, math.inf))
def test_float_flags(
    capsys: pytest.CaptureFixture[str], launches: Launches, flag: str, value: float
) -> None:
    outcome = run_cli(capsys, launches, f"{flag}={value!r}")
    # nan, every value <= 0, --bucket-mb inf (it reached config.json as Infinity) and --lr
    # above MAX_LR (inf included) are refused
    if value > 0 and (value <= MAX_LR if flag == "--lr" else math.isfinite(value)):
        outcome.assert_launched(**{FLOAT_FLAGS[flag]: value})
    else:
        outcome.assert_user_error(flag, str(value))


@PROPERTY
@given(
    flag=st.sampled_from(sorted(FLOAT_FLAGS)),
    # --bucket-mb also takes 'auto' (tests/ranks/test_bucket_autotune_ranks.py)
    text=st.text().filter(lambda s: not _is_float(s) and s.strip().lower() != "auto"),
)
def test_float_flags_reject_non_numbers(
    capsys: pytest.CaptureFixture[str], launches: Launches, flag: str, text: str
) -> None:
    run_cli(capsys, launches, f"{flag}={text}").assert_user_error(
        flag, "invalid float value", repr(text)
    )


def test_bucket_mb_takes_auto_in_any_case(
    capsys: pytest.CaptureFixture[str], launches: Launches
) -> None:
    run_cli(capsys, launches, "--bucket-mb= Auto").assert_launched(bucket_mb="auto")


# -- spec flags ------------------------------------------------------------------------------


def _case_and_space(text: str) -> st.SearchStrategy[str]:
    """``text`` as a user might type it: any letter case, blanks around it."""
    blanks = st.sampled_from(["", " ", "\t", "  "])
    cased = st.lists(st.booleans(), min_size=len(text), max_size=len(text)).map(
        lambda upper: "".join(c.upper() if u else c for c, u in zip(text, upper, strict=True))
    )
    return st.tuples(blanks, cased, blanks).map("".join)


@st.composite
def valid_strategy(draw: st.DrawFn) -> tuple[str, StrategySpec]:
    """A spec as typed, with the parse an independent reading of the documented forms gives."""
    kind = draw(st.sampled_from(["bsp", "async", "local", "diloco", "ssp"]))
    if kind in ("bsp", "async"):
        return draw(_case_and_space(kind)), StrategySpec(kind=kind)
    if kind in ("local", "diloco"):
        h = draw(st.integers(1, 10**6))
        return draw(_case_and_space(f"{kind}:{h}")), StrategySpec(kind=kind, period=h)
    if draw(st.booleans()):
        return draw(_case_and_space("ssp:inf")), StrategySpec(kind="ssp", staleness=math.inf)
    s = draw(st.integers(0, 10**6))
    return draw(_case_and_space(f"ssp:{s}")), StrategySpec(kind="ssp", staleness=float(s))


@st.composite
def invalid_strategy(draw: st.DrawFn) -> str:
    """Text no documented form accepts: an unknown kind, a missing or bad argument."""
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return draw(
            st.text().filter(
                lambda s: (
                    s.strip().lower().partition(":")[0]
                    not in ("bsp", "async", "local", "diloco", "ssp")
                )
            )
        )
    if choice == 1:
        kind = draw(st.sampled_from(["bsp", "async"]))
        return f"{kind}:{draw(st.text().filter(str.strip))}"
    if choice == 2:
        kind = draw(st.sampled_from(["local", "diloco"]))
        return f"{kind}:{draw(st.one_of(st.integers(max_value=0), st.just(''), st.just('x')))}"
    bad = st.one_of(st.integers(max_value=-1), st.sampled_from(["", "-inf", "nan", "1.5"]))
    return f"ssp:{draw(bad)}"


@PROPERTY
@given(case=valid_strategy())
def test_strategy_spec_parses_documented_forms(case: tuple[str, StrategySpec]) -> None:
    text, expected = case
    parsed = parse_strategy_spec(text)
    assert parsed == expected
    assert parse_strategy_spec(str(parsed)) == parsed
    assert str(parsed) == text.strip().lower()


@PROPERTY
@given(text=invalid_strategy())
def test_strategy_spec_rejects_everything_else(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(STRATEGY_FORMS)):
        parse_strategy_spec(text)


@PROPERTY
@given(text=st.text())
def test_strategy_spec_any_text_round_trips_or_names_forms(text: str) -> None:
    try:
        parsed = parse_strategy_spec(text)
    except ValueError as exc:
        assert STRATEGY_FORMS in str(exc) and repr(text) in str(exc)
    else:
        assert parse_strategy_spec(str(parsed)) == parsed


@PROPERTY
@given(text=st.one_of(valid_strategy().map(lambda c: c[0]), invalid_strategy()))
def test_strategy_flag(capsys: pytest.CaptureFixture[str], launches: Launches, text: str) -> None:
    outcome = run_cli(capsys, launches, f"--strategy={text}")
    try:
        spec = parse_strategy_spec(text)
    except ValueError:
        outcome.assert_user_error(repr(text), "valid")
        return
    outcome.assert_launched(strategy=text)
    servers = 1 if spec.kind in ("ssp", "async") else 0
    assert outcome.calls[0]["nproc"] == 4 + servers  # parameter servers are extra ranks


@st.composite
def valid_compression(draw: st.DrawFn) -> tuple[str, str]:
    """A compression spec as typed, and the canonical spec its Compressor reports."""
    names = ["none", "fp16", "bf16", "int8", "sign", "topk", "randomk", "powersgd"]
    name = draw(st.sampled_from(names))
    if name in ("topk", "randomk"):
        fraction = draw(st.floats(min_value=0.0, max_value=1.0, exclude_min=True))
        return draw(_case_and_space(f"{name}:{fraction!r}")), f"{name}:{fraction!r}"
    if name == "powersgd":
        rank = draw(st.integers(1, 10**4))
        return draw(_case_and_space(f"powersgd:{rank}")), f"powersgd:{rank}"
    return draw(_case_and_space(name)), name


@st.composite
def invalid_compression(draw: st.DrawFn) -> str:
    choice = draw(st.integers(0, 3))
    if choice == 0:
        names = ("none", "fp16", "bf16", "int8", "sign", "topk", "randomk", "powersgd")
        return draw(
            st.text().filter(lambda s: s.strip().lower().partition(":")[0].strip() not in names)
        )
    if choice == 1:
        name = draw(st.sampled_from(["none", "fp16", "bf16", "int8", "sign"]))
        return f"{name}:{draw(st.text())}"
    if choice == 2:
        bad = st.one_of(
            st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True), st.just(math.nan)
        )
        return f"{draw(st.sampled_from(['topk', 'randomk']))}:{draw(bad)!r}"
    return f"powersgd:{draw(st.one_of(st.integers(max_value=0), st.just('2.5'), st.just('')))}"


@PROPERTY
@given(case=valid_compression())
def test_compression_spec_parses_documented_forms(case: tuple[str, str]) -> None:
    text, canonical = case
    compressor = parse_compression(text)
    assert compressor.spec == canonical
    assert parse_compression(compressor.spec).spec == canonical


@PROPERTY
@given(text=invalid_compression())
def test_compression_spec_rejects_everything_else(text: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_compression(text)
    assert VALID_FORMS in str(exc.value) and repr(text) in str(exc.value)


@PROPERTY
@given(text=st.one_of(valid_compression().map(lambda c: c[0]), invalid_compression()))
def test_compress_flag(capsys: pytest.CaptureFixture[str], launches: Launches, text: str) -> None:
    outcome = run_cli(capsys, launches, f"--compress={text}")
    try:
        parse_compression(text)
    except ValueError:
        outcome.assert_user_error(repr(text), "valid forms")
        return
    outcome.assert_launched(compression=text)


@PROPERTY
@given(
    strategy=st.sampled_from(["ssp:0", "ssp:3", "async"]),
    compression=valid_compression().filter(lambda c: c[1] != "none").map(lambda c: c[0]),
)
def test_compression_with_parameter_servers_launches(
    capsys: pytest.CaptureFixture[str], launches: Launches, strategy: str, compression: str
) -> None:
    # Pushes are encoded by gradsync.compression.push: every compressor works with servers.
    outcome = run_cli(capsys, launches, f"--strategy={strategy}", f"--compress={compression}")
    outcome.assert_launched(strategy=strategy, compression=compression)


# -- --slow ------------------------------------------------------------------------------------


@st.composite
def slowdown(draw: st.DrawFn, nproc: int = 4) -> tuple[str, tuple[int, float, int, int | None]]:
    rank = draw(st.integers(0, nproc - 1))
    factor = draw(st.floats(min_value=1.0, max_value=MAX_FACTOR))
    text = f"{rank}:{factor!r}"
    start, end = 0, None
    if draw(st.booleans()):
        start = draw(st.integers(0, 10**6))
        text += f"@{start}"
        if draw(st.booleans()):
            end = start + draw(st.integers(1, 1000))
            text += f"-{end}"
    return text, (rank, factor, start, end)


@PROPERTY
@given(parts=st.lists(slowdown(), min_size=1, max_size=4))
def test_slow_spec_parses_documented_forms(
    parts: list[tuple[str, tuple[int, float, int, int | None]]],
) -> None:
    spec = " , ".join(text for text, _ in parts)
    got = [(s.rank, s.factor, s.start, s.end) for s in parse_slow(spec)]
    assert got == [want for _, want in parts]


@st.composite
def invalid_slowdown(draw: st.DrawFn) -> str:
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return f"{draw(st.integers(max_value=-1))}:2"  # negative rank
    if choice == 1:  # a factor below 1 (a speed-up), above the cap, or not a number
        bad = st.one_of(
            st.floats(max_value=1.0, exclude_max=True),
            st.floats(min_value=MAX_FACTOR, exclude_min=True),
            st.just(math.nan),
        )
        return f"0:{draw(bad)!r}"
    if choice == 2:  # an end not after the start
        start = draw(st.integers(0, 100))
        return f"1:2@{start}-{draw(st.integers(max_value=start))}"
    return draw(st.text().filter(lambda s: ":" not in s and s.strip()))


@PROPERTY
@given(text=invalid_slowdown())
def test_slow_spec_rejects_everything_else(text: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_slow(text)
    assert SLOW_FORM in str(exc.value)


@PROPERTY
@given(
    text=st.one_of(
        slowdown(nproc=8).map(lambda c: c[0]),
        invalid_slowdown(),
        st.text(),
    ),
)
def test_slow_flag(capsys: pytest.CaptureFixture[str], launches: Launches, text: str) -> None:
    outcome = run_cli(capsys, launches, "--nproc=4", f"--slow={text}")
    try:
        ranks = [s.rank for s in parse_slow(text)]
    except ValueError:
        outcome.assert_user_error("--slow", "valid")
        return
    if any(r >= 4 for r in ranks):
        outcome.assert_user_error("--slow names rank", "--nproc 4")
    else:
        outcome.assert_launched(slow=text)


# -- values that once passed validation and failed only inside the workers ----------------------


@pytest.mark.parametrize(
    "flag",
    [
        "--timeout=inf",  # worker: OverflowError in timedelta(seconds=inf)
        "--timeout=1e300",  # worker: OverflowError, Python int too large to convert to C int
        "--slow=1:1e308",  # worker: time.sleep OverflowError, timestamp out of range
        "--slow=1:inf",  # accepted, then (inf - 1) * 0.0 = nan: silently never sleeps
        "--straggler-window=0",  # summarize_run: UsageError only after all steps ran
        "--straggler-threshold=nan",
        "--straggler-warmup=-1",
        "--params=100000000000",  # once: the launcher tried to allocate 400 GB to count them
        "--nproc=100000000",
    ],
)
def test_values_that_fail_later_are_refused_up_front(
    capsys: pytest.CaptureFixture[str], launches: Launches, flag: str
) -> None:
    run_cli(capsys, launches, "--nproc=2", flag).assert_user_error(flag.split("=")[0])
