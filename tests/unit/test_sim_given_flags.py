"""``gradsync simulate`` and ``bench allreduce``: a flag given is used or refused, never ignored
(a tester's findings: an explicit ``--strategy bsp`` read as not given; ``--compute`` and
``--jitter`` ignored with ``--from``; ``--gate-rtt-ms -1`` and ``--gate-store-rate`` with a
strategy that has no gate accepted; empty list items dropped or read as "not given")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gradsync.errors import UsageError
from gradsync.telemetry.records import StepRecord, write_records
from tests.support.sim_cli import run_cli, run_json

pytestmark = pytest.mark.unit


def _local_run(path: Path, steps: int = 24) -> Path:
    """A 2-rank local:4 run: 10 ms steps, every 4th one all-reduces 1 MB in 4 ms."""
    records = []
    for step in range(steps):
        exchange = (step + 1) % 4 == 0
        for rank in range(2):
            records.append(
                StepRecord(
                    rank=rank,
                    step=step,
                    time=0.02 * step,
                    compute=0.010,
                    sync=0.004 if exchange else 0.0,
                    idle=0.0,
                    comm=0.004 if exchange else 0.0,
                    samples=8,
                    bytes=1_000_000 if exchange else 0,
                )
            )
    path.mkdir()
    write_records(path / "metrics.jsonl", records, append=False)
    (path / "config.json").write_text(json.dumps({"nproc": 2, "strategy": "local:4"}))
    return path


def test_an_explicit_strategy_bsp_is_a_what_if_of_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = str(_local_run(tmp_path / "run"))
    text = run_cli(["simulate", "--from", run, "--strategy", "bsp"], capsys)
    assert "what if (strategy=bsp):" in text
    doc = run_json(["simulate", "--from", run, "--strategy", "bsp"], capsys)
    assert doc["what_if"]["change"] == "strategy=bsp"
    # bsp pays the 4 ms exchange every step, local:4 once a round
    assert doc["what_if"]["median_step_ms"] == pytest.approx(14.0)
    assert doc["predicted"]["median_step_ms"] == pytest.approx(11.0)
    # not given: the run as it was, no what-if
    assert "what_if" not in run_json(["simulate", "--from", run], capsys)


@pytest.mark.parametrize("sweep", [["--sweep-workers", "4,8"], ["--sweep-staleness", "0,1"]])
def test_an_explicit_strategy_bsp_is_refused_with_a_sweep(
    sweep: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(UsageError, match="--strategy bsp is for one simulation"):
        run_cli(["simulate", *sweep, "--strategy", "bsp"], capsys)


def test_without_strategy_one_simulation_is_bsp(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(["simulate", "--compute", "20", "--comm-ms", "5", "--steps", "3"], capsys)
    given = run_json(
        ["simulate", "--compute", "20", "--comm-ms", "5", "--steps", "3", "--strategy", "bsp"],
        capsys,
    )
    assert doc == given and doc["wall_ms"] == pytest.approx(75.0)


REFUSED: dict[str, tuple[list[str], str]] = {
    "--compute with --from": (["--compute", "50"], r"^--compute 50 apply to a simulation"),
    "--jitter with --from": (["--jitter", "3"], r"^--jitter 3.0 apply to a simulation"),
    "--steps and --overlap with --from": (["--steps", "5", "--overlap"], "--steps 5, --overlap"),
    "--message-mb with --from": (["--message-mb", "1"], "the bytes from the run's telemetry"),
    "--gate-store-rate with --from": (["--gate-store-rate", "1000"], "--gate-store-rate 1000.0"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_simulations_flags_are_refused_with_from(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, match = REFUSED[case]
    run = str(_local_run(tmp_path / "run"))
    with pytest.raises(UsageError, match=match) as info:
        run_cli(["simulate", "--from", run, *argv], capsys)
    assert "--from takes --workers, --strategy" in str(info.value)  # the valid choices


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        # a range checked whether or not the flag is used
        (["--gate-rtt-ms", "-1"], r"--gate-rtt-ms must be a finite number of ms >= 0, got -1"),
        (["--gate-rtt-ms", "-1", "--gate-store-rate", "100"], "--gate-rtt-ms must be .* >= 0"),
        (["--gate-store-rate", "0"], "--gate-store-rate must be .* > 0, got 0"),
        (["--gate-rtt-ms", "0.5"], "--gate-rtt-ms 0.5 is the step gate's .* --gate-store-rate"),
        # a gate on a strategy without one
        (["--gate-store-rate", "1000", "--strategy", "local:4"], "--strategy local:4 has none"),
        (["--gate-store-rate", "1000", "--strategy", "ssp:2"], "--strategy ssp:2 has none"),
        (["--gate-store-rate", "9", "--sweep-staleness", "0,1"], "--sweep-staleness .* has none"),
        (
            ["--gate-store-rate", "9", "--sweep-workers", "4", "--strategies", "async,local:2"],
            "--strategies async,local:2 has none",
        ),
        # empty items: dropped, or the whole flag read as not given
        (["--compute", "20,,20"], r"--compute '20,,20' has an empty item: .* e\.g\. 20,22"),
        (["--compute", ","], "--compute needs at least one number, got ','"),
        (["--sweep-staleness", ""], r"--sweep-staleness '' names nothing: .* e\.g\. 0,1,2"),
        (["--sweep-staleness", "0,,1"], "--sweep-staleness '0,,1' has an empty item"),
        (["--sweep-workers", ""], r"--sweep-workers '' names nothing: .* e\.g\. 8,16"),
        (["--sweep-workers", "4,"], "--sweep-workers '4,' has an empty item"),
    ],
)
def test_bad_or_unused_values_are_refused(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(UsageError, match=match):
        run_cli(["simulate", *argv], capsys)


def test_the_gate_is_priced_where_it_applies(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--compute", "20", "--comm-ms", "5", "--steps", "3"]
    text = run_cli([*argv, "--gate-store-rate", "1000", "--gate-rtt-ms", "0.5"], capsys)
    # 2*4/(1000 - 4 heartbeats a second) s + one round trip, 0.5 ms
    assert "step gate" in text and "8.53 ms after the ranks arrive" in text
    doc = run_json([*argv, "--sweep-workers", "2", "--gate-store-rate", "1000"], capsys)
    assert "workers_sweep" in doc  # bsp among the default --strategies


@pytest.mark.parametrize(
    ("sizes", "what"), [("", "names no size"), ("4K,,8K", "has an empty item")]
)
def test_bench_allreduce_refuses_empty_sizes(
    sizes: str, what: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--sizes ''`` ran the whole default set (and started processes)."""

    def no_bench(*_: Any) -> Any:
        raise AssertionError("the bench ran")

    monkeypatch.setattr("gradsync.sim.bench.run_bench", no_bench)
    with pytest.raises(UsageError, match=rf"--sizes '{sizes}' {what}: .* \(e\.g\. 4K,64K,1M\)"):
        run_cli(["bench", "allreduce", "--sizes", sizes], capsys)


def test_a_refusal_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradsync.runner.cli import main

    monkeypatch.setattr("gradsync.sim.bench.run_bench", lambda *_: pytest.fail("the bench ran"))
    run = str(_local_run(tmp_path / "run"))
    for argv in (
        ["simulate", "--from", run, "--compute", "50"],
        ["simulate", "--compute", "20,,20"],
        ["simulate", "--sweep-staleness", "0,1", "--strategy", "bsp"],
        ["bench", "allreduce", "--sizes", ""],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("gradsync: error: ") and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
