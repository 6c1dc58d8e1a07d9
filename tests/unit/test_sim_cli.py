"""``gradsync simulate`` and ``gradsync bench allreduce`` through their argparse handlers (the
bench on two ranks: tests/e2e/test_sim_cli_e2e.py)."""

from __future__ import annotations

import json
import random
import typing
from pathlib import Path

import pytest

from gradsync.errors import UsageError
from gradsync.flags import option_of
from gradsync.sim.options import SimulateOptions
from gradsync.telemetry.records import StepRecord, fill_idle, write_records
from tests.support.sim_cli import run_cli, run_json

pytestmark = pytest.mark.unit


def test_bsp_table_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(
        ["simulate", "--compute", "20,22,21,38", "--comm-ms", "6", "--steps", "3"], capsys
    )
    assert doc["wall_ms"] == pytest.approx(3 * (38 + 6))
    assert doc["barrier_idle_ms"] == pytest.approx(3 * 44 - 25.25 * 3 - 18)
    assert doc["per_step"][0]["wait_ms"] == [18.0, 16.0, 17.0, 0.0]
    assert doc["compute_split"][3] == pytest.approx(38 / 101)
    text = run_cli(
        ["simulate", "--compute", "20,22,21,38", "--comm-ms", "6", "--steps", "3"], capsys
    )
    assert "superstep" in text and "barrier idle injected" in text and "132.00 ms" in text


def test_same_seed_same_output(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "simulate",
        "--compute",
        "20",
        "--workers",
        "5",
        "--jitter",
        "3",
        "--seed",
        "9",
        "--strategy",
        "ssp:2",
    ]
    first, second = run_json(argv, capsys), run_json(argv, capsys)
    assert first == second
    assert first["staleness"]["max"] <= 2
    other = run_json([*argv[:-3], "10", "--strategy", "ssp:2"], capsys)
    assert other["wall_ms"] != first["wall_ms"]


def test_overlap_report(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(["simulate", "--compute", "200", "--comm-ms", "60", "--overlap"], capsys)
    o = doc["overlap"]
    assert o["naive_step_ms"] == 260.0
    assert o["comm_share"] == pytest.approx(60 / 260)
    assert o["best_overlapped_step_ms"] == pytest.approx(200.0)
    assert doc["bsp_overlap"]["wall_ms"] < doc["bsp"]["wall_ms"]
    text = run_cli(["simulate", "--compute", "200", "--comm-ms", "60", "--overlap"], capsys)
    assert "best-case overlapped" in text and "23.1%" in text


def test_sweeps_write_tables_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(
        [
            "simulate",
            "--compute",
            "20",
            "--jitter",
            "4",
            "--steps",
            "50",
            "--message-mb",
            "50",
            "--link-gbps",
            "100",
            "--sweep-staleness",
            "0,1,4,inf",
            "--sweep-workers",
            "4,16,64",
            "--strategies",
            "bsp,async",
            "--plot-dir",
            str(tmp_path),
        ],
        capsys,
    )
    rows = doc["staleness_sweep"]
    assert [r["S"] for r in rows] == ["0", "1", "4", "inf"]
    assert rows[0]["wall_ms"] >= rows[-1]["wall_ms"]
    eff = doc["workers_sweep"]["efficiency"]
    assert set(eff) == {"bsp", "async"} and len(eff["bsp"]) == 3
    assert eff["bsp"][0] > eff["bsp"][-1]  # all-reduce cost grows with the world
    for name in ("sim_staleness.png", "sim_scaling.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--strategy", "gossip"], "valid"),
        (["--compute", "20,30", "--workers", "3"], "one value per worker"),
        (["--straggler", "7"], "RANK:FACTOR|A:B"),
        (["--comm-ms", "5", "--message-mb", "10"], "cannot be combined"),
        (["--alpha-us", "5"], "--message-mb"),
        (["--sweep-staleness", "0,x"], "inf"),
        (["--workers", "0"], "--workers must be at least 1, got 0"),
        (["--workers", "-3", "--sweep-workers", "4"], "--workers must be at least 1"),
        (["--jitter", "nan"], "--jitter must be a finite number"),
        (["--jitter", "inf"], "--jitter must be a finite number"),
        (["--comm-ms", "nan"], "--comm-ms must be a finite number"),
        (["--message-mb", "nan"], "--message-mb must be a finite number"),
        (["--message-mb", "1", "--link-gbps", "inf"], "--link-gbps must be a finite number"),
        (["--straggler", "1:nan"], "straggler factor must be a finite number"),
        (["--straggler", "x:2"], "integer rank"),
        (["--straggler", "nan:2"], "integer rank"),
        (["--transient", "0.1:inf"], "transient factor must be a finite number"),
        # finite but far out: they printed nan, inf or 300-digit figures with exit 0
        (["--jitter", "1e308"], r"--jitter must be a finite number from 0 to 3600000 ms \(an"),
        (["--transient", "1:1e308"], "transient factor .* at most 1000, got 1e\\+308"),
        (["--straggler", "0:1001"], "straggler factor .* at most 1000, got 1001"),
        (["--compute", "1e308"], "--compute needs finite times from 0 to 3600000 ms"),
        (["--compute", "0"], "--compute needs a time > 0 ms for at least one worker"),
        (["--comm-ms", "1e308"], "--comm-ms must be a finite number from 0 to 3600000 ms"),
        (["--message-mb", "1", "--link-gbps", "1e-300"], "--link-gbps must be .* from 0.001 to"),
        (["--message-mb", "1", "--alpha-us", "1e308"], "--alpha-us must be .* from 0 to 1e\\+06"),
        (["--message-mb", "1e308"], "--message-mb must be a finite number from 0 to 1e\\+06 MiB"),
        (["--message-mb", "-1"], "--message-mb must be a finite number from 0"),
        (["--hosts", "2", "--message-mb", "1", "--intra-gbps", "1e-300"], "--intra-gbps must"),
        # flags the mode given would have silently ignored
        (["--strategies", "bsp,async"], "--strategies 'bsp,async' lists the strategies of --sw"),
        (["--sweep-workers", "2,4", "--from", "runs/x"], "--from predicts the one run runs/x"),
        (["--strategy", "ssp:2", "--sweep-staleness", "0,1"], "--strategy ssp:2 is for one sim"),
        (["--sweep-workers", "2,4", "--strategies", ""], "--strategies '' names no strategy"),
        (["--sweep-workers", "2", "--strategies", "bsp,,async"], "'bsp,,async' has an empty it"),
        (["--from", "runs/x", "--warmup", "-1"], "--warmup must be >= 0"),
        (["--table-steps", "-1"], "--table-steps must be >= 0, got -1"),
        (["--from", "runs/x", "--hosts", "2"], "^--hosts apply to a simulation"),
        (
            ["--from", "runs/x", "--layers", "1,2", "--allreduce", "hierarchical"],
            "^--layers, --allreduce hierarchical apply to a simulation",
        ),
    ],
)
def test_bad_input_is_a_usage_error(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(UsageError, match=match):
        run_cli(["simulate", *argv], capsys)


FLOAT_FIELDS = [
    name
    for name, hint in typing.get_type_hints(SimulateOptions).items()
    if hint in (float, float | None)
]


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_every_float_flag_refuses_nan_and_inf(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse's type=float takes them; SimulateOptions refuses them, naming the option."""
    option = option_of(SimulateOptions, name)
    for value in ("nan", "inf", "-inf"):
        with pytest.raises(UsageError, match=f"^{option} must be a finite number, got"):
            run_cli(["simulate", f"{option}={value}"], capsys)


def test_the_float_flags_are_the_ones_that_were_checked_by_hand() -> None:
    assert sorted(FLOAT_FIELDS) == sorted(
        ["jitter", "comm_ms", "message_mb", "alpha_us", "link_gbps", "backward_frac"]
        + ["compression_ratio", "intra_gbps", "intra_alpha_us", "gate_store_rate", "gate_rtt_ms"]
        + ["failure_rate", "step_s", "restart_s", "stall_s", "heal_s"]
    )


def _fake_run(path: Path, slow_rank: int | None, steps: int = 40) -> Path:
    """A 4-rank BSP run: 20 ms compute (40 ms on the straggler), 5 ms of comm."""
    rng = random.Random(0)
    records = []
    for step in range(steps):
        for rank in range(4):
            compute = 0.020 * (2 if rank == slow_rank else 1) + rng.uniform(-0.001, 0.001)
            records.append(
                StepRecord(
                    rank=rank,
                    step=step,
                    time=float(step),
                    compute=compute,
                    sync=0.0,
                    idle=0.0,
                    comm=0.0,
                    samples=16,
                    bytes=400_000,
                )
            )
    records = fill_idle(records)
    for r in records:
        r.sync = r.idle + 0.005
        r.comm = 0.005
    path.mkdir()
    write_records(path / "metrics.jsonl", records, append=False)
    (path / "config.json").write_text(
        json.dumps({"nproc": 4, "strategy": "bsp", "bucket_mb": 25.0})
    )
    return path


def test_from_run_predicts_and_answers_what_if(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _fake_run(tmp_path / "slow", slow_rank=2)
    doc = run_json(["simulate", "--from", str(run)], capsys)
    assert doc["slowest_rank"] == 2
    assert doc["predicted"]["median_step_ms"] == pytest.approx(
        doc["measured"]["median_step_ms"], rel=0.05
    )
    assert doc["predicted"]["barrier_tax"] == pytest.approx(doc["measured"]["barrier_tax"], rel=0.1)
    fixed = run_json(["simulate", "--from", str(run), "--remove-straggler"], capsys)
    assert fixed["what_if"]["median_step_ms"] == pytest.approx(26.0, abs=1.5)
    # A fitted link replaces the run's comm: with 1 GB/s, 400 KB cost 1.5 x 0.4 ms on 4 ranks.
    cal = tmp_path / "cal.json"
    cal.write_text(
        json.dumps(
            {
                "kind": "gradsync.allreduce_calibration",
                "alpha_s": 0.0,
                "beta_s_per_byte": 1e-9,
                "algorithm": "ring",
            }
        )
    )
    linked = run_json(
        ["simulate", "--from", str(run), "--calibration", str(cal), "--compression-ratio", "4"],
        capsys,
    )
    assert linked["predicted"]["comm_ms"] == pytest.approx(1.5 * 0.4)
    assert linked["what_if"]["comm_ms"] == pytest.approx(1.5 * 0.1)


def test_from_run_rejects_what_is_not_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An empty folder and a missing one: a usage error naming the folder and what it needs.
    for folder in (tmp_path, tmp_path / "missing"):
        with pytest.raises(UsageError, match="metrics.jsonl") as info:
            run_cli(["simulate", "--from", str(folder)], capsys)
        assert str(folder) in str(info.value) and "config.json" in str(info.value)
    # Through the gradsync command: exit 2 and one line on stderr, no traceback.
    from gradsync.runner.cli import main

    assert main(["simulate", "--from", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradsync: error: --from ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    bad = tmp_path / "cal.json"
    bad.write_text("{}")
    run = _fake_run(tmp_path / "run", slow_rank=None)
    with pytest.raises(UsageError, match="calibration"):
        run_cli(["simulate", "--from", str(run), "--calibration", str(bad)], capsys)


def test_ssp0_what_if_equals_the_as_run_bsp_prediction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # ssp:0 is BSP, so its what-if must not move the step: the same statistic for both.
    run = _fake_run(tmp_path / "slow", slow_rank=2)
    doc = run_json(["simulate", "--from", str(run), "--strategy", "ssp:0"], capsys)
    assert doc["what_if"]["median_step_ms"] == pytest.approx(
        doc["predicted"]["median_step_ms"], rel=1e-9
    )
    assert doc["what_if"]["barrier_tax"] == pytest.approx(doc["predicted"]["barrier_tax"])
    assert "median" in doc["step_statistic"]
    text = run_cli(["simulate", "--from", str(run), "--strategy", "ssp:0"], capsys)
    assert "(+0.0% vs as run)" in text and "for every strategy" in text


def test_injected_idle_uses_the_base_mean_not_the_realised_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # With jitter the realised compute differs from the base; the definition subtracts the
    # mean *base* compute x steps (25.25 x 4) and the comm x steps (6 x 4) from wall-clock.
    argv = ["simulate", "--compute", "20,22,21,38", "--comm-ms", "6", "--steps", "4"]
    argv += ["--jitter", "3", "--seed", "5"]
    doc = run_json(argv, capsys)
    rng = random.Random(5)
    base = [20.0, 22.0, 21.0, 38.0]
    compute = [[b + rng.uniform(-3, 3) for b in base] for _ in range(4)]
    wall = sum(max(row) + 6 for row in compute)
    for row, expected in zip(doc["per_step"], compute, strict=True):
        assert row["compute_ms"] == pytest.approx(expected)
    assert doc["wall_ms"] == pytest.approx(wall)
    assert doc["barrier_idle_ms"] == pytest.approx(wall - 25.25 * 4 - 6 * 4)
    realised_mean = sum(map(sum, compute)) / 16
    assert abs(realised_mean - 25.25) > 0.1  # so the two definitions give different numbers
    assert doc["barrier_idle_ms"] != pytest.approx(wall - realised_mean * 4 - 6 * 4)


def test_a_fit_with_no_bandwidth_is_a_warning_not_an_infinite_link() -> None:
    from gradsync.sim.bench import describe_fit
    from gradsync.sim.model import Fit

    good = Fit(alpha=1e-4, beta=1e-9, op="allreduce", algorithm="ring", n=2, max_rel_error=0.1)
    line, warnings = describe_fit(good)
    assert "8.00 Gbit/s link" in line and warnings == []
    flat = Fit(alpha=-1e-6, beta=-1e-12, op="allreduce", algorithm="ring", n=2, max_rel_error=1)
    line, warnings = describe_fit(flat)
    assert "inf" not in line and "not resolved" in line
    assert len(warnings) == 2
    assert "beta" in warnings[0] and "--repeats" in warnings[0] and "--sizes" in warnings[0]
    assert "alpha" in warnings[1]


@pytest.mark.parametrize(("sizes", "bad"), [("0", "0"), ("4096,6,0", "6, 0"), ("-8", "-8")])
def test_bench_sizes_must_be_positive_multiples_of_4(
    sizes: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0 bytes is a multiple of 4 too: the refusal says positive multiples, naming the sizes
    it refuses (it said "multiples of 4 (float32), got (0,)")."""
    from gradsync.runner.cli import main

    assert main(["bench", "allreduce", f"--sizes={sizes}"]) == 2
    assert capsys.readouterr().err == (
        "gradsync: error: --sizes must be positive multiples of 4 bytes (float32 values), "
        f"got {bad}\n"
    )


def test_a_free_link_shows_no_negative_barrier_idle(capsys: pytest.CaptureFixture[str]) -> None:
    """--message-mb 0: the sums' rounding left -2e-13 ms, printed as -0.00 ms."""
    out = run_cli(["simulate", "--message-mb", "0"], capsys)
    assert "barrier idle injected   0.00 ms" in out and "-0.00" not in out


def test_from_a_directory_of_runs_or_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A replica-groups run's directory points to its group-K/; a file is said to be one (an
    empty one said "has 0 steps")."""
    top = tmp_path / "rg"
    for name in ("group-0", "group-1"):
        (top / name).mkdir(parents=True)
        (top / name / "metrics.jsonl").write_text("")
    with pytest.raises(UsageError, match="its sub-directories are runs, each with its own: give"):
        run_cli(["simulate", "--from", str(top)], capsys)
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(UsageError, match=f"^--from {afile}: is a file, not a directory"):
        run_cli(["simulate", "--from", str(afile)], capsys)


def test_from_run_measures_the_barrier_tax_as_gradsync_report_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tester saw gradsync report say 35.6% and simulate --from "measured 36.5%" for one
    run: the same sum (idle over compute + sync), but over the steps after --warmup 2 only.
    The measured figure is RunReport's over the steps modelled, and where it differs from the
    report's (over every step) the output says both, and why."""
    from gradsync.sim.calibrate import load_profile
    from gradsync.telemetry.cli import analyze_run
    from gradsync.telemetry.records import read_records
    from gradsync.telemetry.report import RunReport

    run = _fake_run(tmp_path / "slow", slow_rank=2)
    records = read_records(run)
    for r in records:  # the first two steps are balanced: no idle, a lower tax than the rest
        if r.step < 2:
            r.compute, r.idle, r.sync = 0.030, 0.0, 0.005
    write_records(run / "metrics.jsonl", records, append=False)
    shown = analyze_run(run, plots=False).report.barrier_tax  # gradsync report's
    assert shown == RunReport.from_records(records).barrier_tax
    after = RunReport.from_records([r for r in records if r.step >= 2]).barrier_tax
    assert f"{after:.1%}" != f"{shown:.1%}"
    profile = load_profile(run, warmup=2)
    assert profile.measured_barrier_tax == pytest.approx(after, rel=1e-12)
    assert profile.report_barrier_tax == pytest.approx(shown, rel=1e-12)
    assert load_profile(run, warmup=0).measured_barrier_tax == pytest.approx(shown, rel=1e-12)
    doc = run_json(["simulate", "--from", str(run)], capsys)
    assert doc["measured"]["report_barrier_tax"] == pytest.approx(shown)
    text = run_cli(["simulate", "--from", str(run)], capsys)
    assert (
        f"(measured over the 38 steps modelled, 2-39: after --warmup 2; gradsync report counts "
        f"all 40: {shown:.1%})" in text
    ), text
    text = run_cli(["simulate", "--from", str(run), "--warmup", "0"], capsys)
    assert "gradsync report counts" not in text and f"{shown:.1%}" in text
