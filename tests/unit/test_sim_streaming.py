"""Streaming DiLoCo priced by the simulator, and the two-level all-reduce through ``simulate``.

Expected figures are worked out by hand here (the timelines step by step in the comments), not
taken from ``gradsync.sim``, so a wrong schedule or formula there is caught. The simulator
prices the fragments the runtime's own rules cut (``gradsync.fragments``, no torch): checked
against the tensors the runtime's fragments hold; its schedule, written again, against the
runtime's.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gradsync.errors import UsageError
from gradsync.sim import (
    CommModel,
    ComputeModel,
    Hosts,
    SimStrategy,
    WhatIf,
    parse_sim_strategy,
    simulate,
)
from gradsync.sim.cli import add_parsers
from gradsync.sim.model import AlphaBeta, collective_time
from gradsync.sim.streaming import (
    Plan,
    fragment_shares,
    layer_bytes,
    layer_tensors,
    offsets,
    row_loads,
    timeline,
)
from gradsync.strategies import streaming as runtime

pytestmark = pytest.mark.unit


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    parser = argparse.ArgumentParser(prog="gradsync")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *argv, "--json"])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def run_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser(prog="gradsync")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def flat(c_ms: float, workers: int, steps: int) -> np.ndarray:
    return np.full((steps, workers), c_ms)


# -- the rules shared with the runtime -----------------------------------------------------------


def test_offsets_are_the_runtimes() -> None:
    for h in range(1, 17):
        for f in range(1, h + 1):
            assert offsets(h, f) == runtime.offsets(h, f), (h, f)


class _Shared(nn.Module):
    """Two layers sharing one weight (tied), between two that do not: the runtime counts a
    shared tensor in the first module that holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)
        self.c.weight = self.b.weight
        self.d = nn.Linear(32, 4)
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)


class _Odd(nn.Module):
    """Tensors the rows split takes whole: a scalar, a one-row matrix, a non-contiguous one
    (a transposed tensor kept as the parameter), and one of 3 rows (fewer than most F)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(40, 301)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.row = nn.Parameter(torch.zeros(1, 50))
        self.strided = nn.Parameter(torch.zeros(30, 20).t())
        self.few = nn.Parameter(torch.zeros(3, 7, dtype=torch.float64))


def _models() -> list[nn.Module]:
    from gradsync.workloads.charlm import TinyGPT

    mlp = nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 300), nn.Linear(300, 16))
    return [mlp, TinyGPT(vocab=50, context=16, dim=32, layers=2, heads=4), _Shared(), _Odd()]


IDS = ["mlp", "charlm", "shared", "odd"]


@pytest.mark.parametrize("model", _models(), ids=IDS)
def test_fragment_bytes_are_the_runtimes_strided_fragments(model: nn.Module) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = layer_bytes(model)
    total = sum(p.numel() * p.element_size() for p in params)
    assert sum(sizes) == total
    for f in range(1, len(sizes) + 1):
        groups = runtime.strided_fragments(model, params, f, f"diloco:64:{f}")
        want = [sum(params[i].numel() * params[i].element_size() for i in g) for g in groups]
        got = fragment_shares(sizes, f, "layers")
        np.testing.assert_allclose(np.multiply(got, total), want)
        # the layers' tensors give the same shares as their bytes under the layers split
        assert fragment_shares(layer_tensors(model), f, "layers") == pytest.approx(got)


def _runtime_bytes(fragments: list[list[torch.Tensor]]) -> list[int]:
    return [sum(t.numel() * t.element_size() for t in f) for f in fragments]


@pytest.mark.parametrize("model", _models(), ids=IDS)
def test_row_shares_are_the_runtimes_row_fragments(model: nn.Module) -> None:
    """The simulator's rows split gives each fragment the bytes the runtime's holds, to the
    byte, for every F the model can fill (as the streaming_sim benchmark compares them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    tensors = layer_tensors(model)
    total = sum(p.numel() * p.element_size() for p in params)
    assert [sum(b for _, b in layer) for layer in tensors] == layer_bytes(model)
    for f in range(1, 17):
        want = _runtime_bytes(runtime.row_fragments(params, f, f"diloco:64:{f}"))
        assert row_loads(tensors, f) == want, f
        np.testing.assert_allclose(np.multiply(fragment_shares(tensors, f), total), want)


def test_the_mlp_workloads_peak_is_a_third_by_rows_and_its_big_layer_by_layers() -> None:
    """The streaming_sim benchmark's model and specs, through ``streaming_rows`` (the side by
    side table): the rows split's peak is the runtime's largest fragment, about 1/3."""
    from gradsync.sim.side_by_side import streaming_rows
    from gradsync.workloads import make_workload

    model = make_workload("mlp", params=3_000_000).build_model()
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    comm = CommModel(link=AlphaBeta(alpha=0.0, beta=8e-9), nbytes=float(total))
    peaks = {}
    for spec in ("diloco:8:3:2", "diloco:8:3:2:layers"):
        _, row = streaming_rows(
            parse_sim_strategy(spec), flat(70.0, 2, 32), comm, layer_tensors(model)
        )
        peaks[spec] = row["peak_share"]
    by_rows = runtime.row_fragments(params, 3, "diloco:8:3:2")
    assert peaks["diloco:8:3:2"] == max(_runtime_bytes(by_rows)) / total
    assert peaks["diloco:8:3:2"] == pytest.approx(1 / 3, abs=1692 * 4 / total)  # one row
    assert peaks["diloco:8:3:2:layers"] == pytest.approx(0.954, abs=0.001)


def test_row_loads_are_the_runtimes_row_fragments_on_any_shapes() -> None:
    """On random tensor lists (rows 0 to 40: below F a tensor is taken whole; 0 rows, 0 bytes;
    some transposed, taken whole as one row), F from 1 to 9, over two layers: the simulator's
    bytes per fragment are those of the tensors and row views the runtime's fragments hold, it
    refuses where the runtime does, and the split keeps its promise: every element in one
    fragment once, and the fragments within one increment (a row, or a whole tensor) apart."""
    rng = np.random.default_rng(16)
    refused = 0
    for _ in range(300):
        count, f = int(rng.integers(2, 12)), int(rng.integers(1, 10))
        rows = [int(x) for x in rng.integers(0, 40, count)]
        rows[0] = max(rows[0], 1)  # no layer of nothing
        cols = [int(x) for x in rng.integers(1, 50, count)]
        params = [
            torch.zeros(c, r).t() if rng.random() < 0.2 else torch.zeros(r, c)
            for r, c in zip(rows, cols, strict=True)
        ]
        sizes = [
            (p.shape[0] if p.is_contiguous() else 1, p.numel() * p.element_size()) for p in params
        ]
        layers = [sizes[:1], sizes[1:]] if sum(n for _, n in sizes[1:]) else [sizes]
        try:
            held = runtime.row_fragments(params, f, f"diloco:64:{f}")
        except UsageError:
            refused += 1
            with pytest.raises(UsageError, match=f"F={f} fragments, but the model's trainable"):
                row_loads(layers, f)
            continue
        want = _runtime_bytes(held)
        assert row_loads(layers, f) == want, (sizes, f)
        pieces = [
            (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()) for h in held for t in h
        ]
        whole = [(p.untyped_storage().data_ptr(), p.numel()) for p in params if p.numel()]
        for ptr, n in whole:  # the pieces of each parameter tile it exactly
            spans = sorted((o, k) for q, o, k in pieces if q == ptr)
            assert spans[0][0] == 0 and sum(k for _, k in spans) == n
            assert all(a + k == b for (a, k), (b, _) in zip(spans, spans[1:], strict=False))
        step = max(n if r < f else n // r for r, n in sizes)
        assert max(want) - min(want) <= step, (sizes, f, want)
    assert 0 < refused < 300


def test_row_shares_from_bytes_or_tensors_and_refusals() -> None:
    assert fragment_shares(None, 4, "rows") == [0.25] * 4
    # Under rows, a layer given by its bytes alone is cut evenly: 1/F each, whatever the sizes.
    assert fragment_shares([1, 2, 3, 4, 5], 2) == pytest.approx([0.5, 0.5])
    assert fragment_shares([1, 98, 1], 3) == pytest.approx([1 / 3] * 3)
    # A layer's tensors as (rows, bytes): 10 rows of 8 bytes cut 4, 3, 3 (the extra row to
    # fragment 0, all empty), then a 2-row tensor (24 bytes) whole to the lightest, 1.
    assert row_loads([[(10, 80)], [(2, 24)]], 3) == [32, 48, 24]
    with pytest.raises(UsageError, match=r"F=3 fragments, but the model's trainable tensors fill"):
        fragment_shares([[(2, 8), (1, 4)]], 3)
    with pytest.raises(UsageError, match="split must be one of rows, layers, got 'strided'"):
        fragment_shares([1, 2], 2, "strided")


def test_fragment_shares_without_layers_and_refusals() -> None:
    assert fragment_shares(None, 4) == [0.25] * 4
    assert fragment_shares(None, 4, "layers") == [0.25] * 4
    # Layer i to fragment i % F: [1, 2, 3, 4, 5] over 2 -> (1 + 3 + 5, 2 + 4) of 15.
    assert fragment_shares([1, 2, 3, 4, 5], 2, "layers") == pytest.approx([9 / 15, 6 / 15])
    with pytest.raises(UsageError, match=r"F=4 fragments, but --layers lists only 3 layers"):
        fragment_shares([1, 2, 3], 4, "layers")
    for split in ("rows", "layers"):
        with pytest.raises(UsageError, match="sizes > 0"):
            fragment_shares([1, 0, 3], 2, split)


def test_streaming_specs_parse_to_the_canonical_form() -> None:
    s = parse_sim_strategy("diloco:8:2")  # TAU defaults to 1 where 1 < F < H
    assert (s.fragments, s.delay, s.alpha, s.streaming, s.spec) == (2, 1, 0.0, True, "diloco:8:2:1")
    assert parse_sim_strategy("diloco:8:4:1:0.5").spec == "diloco:8:4:1:0.5"
    plain = parse_sim_strategy("diloco:8:1:0:0")
    assert plain.spec == "diloco:8" and not plain.streaming
    assert parse_sim_strategy("diloco:8:2").split == "rows"
    layered = parse_sim_strategy("diloco:8:2:layers")
    assert (layered.split, layered.spec) == ("layers", "diloco:8:2:1:layers")
    assert parse_sim_strategy(layered.spec) == layered
    assert SimStrategy(kind="diloco", param=8, fragments=2, delay=1, split="layers") == layered
    # one fragment: the split changes nothing, and is not kept
    assert parse_sim_strategy("diloco:8:1:0:0:layers") == plain
    assert SimStrategy(kind="diloco", param=8, split="layers") == plain
    with pytest.raises(UsageError, match="SPLIT=strided must be rows or layers"):
        SimStrategy(kind="diloco", param=8, fragments=2, delay=1, split="strided")
    with pytest.raises(UsageError, match="streaming DiLoCo's"):
        SimStrategy(kind="local", param=8, split="layers")
    with pytest.raises(UsageError, match="streaming DiLoCo's"):
        SimStrategy(kind="local", param=8, fragments=2)
    with pytest.raises(UsageError, match="TAU=4 must be"):
        SimStrategy(kind="diloco", param=8, fragments=2, delay=4)


def test_eager_specs_parse_to_the_canonical_form_and_refuse_a_delay() -> None:
    eager = parse_sim_strategy("diloco:8:2:eager")
    assert (eager.fragments, eager.delay, eager.eager, eager.streaming) == (2, 0, True, True)
    assert eager.spec == "diloco:8:2:eager" and parse_sim_strategy(eager.spec) == eager
    assert parse_sim_strategy("diloco:8:eager").spec == "diloco:8:1:eager"
    layered = parse_sim_strategy("diloco:8:2:layers:eager")
    assert layered.spec == "diloco:8:2:eager:layers" and parse_sim_strategy(layered.spec) == layered
    with pytest.raises(UsageError, match="eager takes no delay or alpha"):
        SimStrategy(kind="diloco", param=8, fragments=2, delay=1, eager=True)
    with pytest.raises(UsageError, match="streaming DiLoCo's"):
        SimStrategy(kind="local", param=8, eager=True)


# -- the timeline, by hand -----------------------------------------------------------------------


def test_two_fragments_one_step_of_delay_by_hand() -> None:
    # 2 workers at 10 ms a step; plain diloco:4's exchange 40 ms, so a half model's is 20 ms.
    # offsets(4, 2) = [2, 0]: fragment 0 starts after steps 1, 5, 9, fragment 1 after 3, 7, 11.
    # t1 ends 20, f0 runs 20-40; t2 ends 30, waits to 40; t3 40-50, f1 50-70; t4 ends 60, waits
    # to 70; ... t10 ends 150, waits to 160; t11 160-170, f1 170-190 (due after the end): the
    # end waits for it, then exchanges both fragments, 40 ms: 230.
    res = simulate("diloco:4:2:1", flat(10.0, 2, 12), CommModel(comm_ms=40.0))
    assert res.wall_ms == pytest.approx(230.0)
    want = np.zeros(12)
    want[[2, 4, 6, 8, 10]] = 10.0  # 20 ms exchange, 10 ms of it behind the next step
    want[11] = 60.0
    np.testing.assert_allclose(res.comm_ms, want)
    np.testing.assert_allclose(res.idle_ms, 0.0)
    np.testing.assert_allclose(res.period_step_ms(), [50 / 4, 60 / 4, 120 / 4])
    np.testing.assert_array_equal(res.staleness[:, 0], [0, 1, 2, 0, 1, 0, 1, 0, 1, 0, 1, 0])
    plain = simulate("diloco:4", flat(10.0, 2, 12), CommModel(comm_ms=40.0))
    assert np.median(plain.period_step_ms()) == pytest.approx(20.0)  # (4 x 10 + 40) / 4
    assert np.median(res.period_step_ms()) == pytest.approx(15.0)


def test_eager_waits_for_an_exchange_a_period_after_it_started_by_hand() -> None:
    # As above but a half model's exchange takes 30 ms, more than TAU=1's one 10 ms step.
    # Eager: a fragment's exchange is waited for where its next one starts, 4 steps later.
    # f0 after t1 (20): 20-50; f1 after t3 (40), the link free at 50: 50-80; f0 after t5
    # (60): its last (50) done, 80-110; f1 after t7 (80): 110-140; f0 after t9 (100) waits
    # for its last to 110 (10 ms), then 140-170; f1 after t11 (130) waits to 140, 170-200
    # (past the end); the end waits for both (200), then one exchange of both fragments, 60:
    # 260, against 310 with TAU=1, which waits 20 ms at every second step.
    eager = simulate("diloco:4:2:eager", flat(10.0, 2, 12), CommModel(comm_ms=60.0))
    assert eager.wall_ms == pytest.approx(260.0)
    want = np.zeros(12)
    want[9] = 10.0
    want[11] = 130.0
    np.testing.assert_allclose(eager.comm_ms, want)
    delayed = simulate("diloco:4:2:1", flat(10.0, 2, 12), CommModel(comm_ms=60.0))
    assert delayed.wall_ms == pytest.approx(310.0)


def test_a_fast_worker_waits_for_the_exchange_not_for_the_slow_worker() -> None:
    # w0 10 ms, w1 30 ms a step; a fragment's exchange 10 ms. f0 starts when the slowest has
    # finished step 1 (60) and ends at 70: w0 (step 2 done at 30) waits 40 ms, idle; w1 (step 2
    # done at 90) does not wait. f1 starts after step 3 (w1 at 120), 120-130; the end waits
    # for it and exchanges both fragments, 20 ms: 150, 30 ms no one could hide at step 3.
    c = np.array([[10.0, 30.0]] * 4)
    res = simulate("diloco:4:2:1", c, CommModel(comm_ms=20.0))
    assert res.wall_ms == pytest.approx(150.0)
    np.testing.assert_allclose(res.comm_ms, [0, 0, 0, 30])
    np.testing.assert_allclose(res.idle_ms, [[0, 0], [0, 0], [40, 0], [40, 0]])


def test_the_end_waits_for_the_exchange_in_flight_and_no_more_with_one_fragment() -> None:
    # diloco:8:1:2, 9 steps: the exchange started after step 7 (when w1, 30 ms a step, is done
    # at 240; 240-245) is due after step 9, past the end; the end waits for it and, one
    # fragment replaced by its global copy, exchanges nothing more. w0 (10 ms a step) finished
    # step 8 at 90: it waits for the exchange until 245, then for w1 until 270.
    c = np.array([[10.0, 30.0]] * 9)
    res = simulate("diloco:8:1:2", c, CommModel(comm_ms=5.0))
    assert res.wall_ms == pytest.approx(270.0)
    np.testing.assert_allclose(res.comm_ms, 0.0)
    np.testing.assert_allclose(res.idle_ms[-1], [180.0, 0.0])
    np.testing.assert_allclose(res.idle_ms[:-1], 0.0)
    # under keep that merge leaves each replica's own local steps in it, so the end exchanges
    # every fragment once more (DiLoCo.finalize), after both workers are done: 270 + 5
    kept = simulate("diloco:8:1:2:keep", c, CommModel(comm_ms=5.0))
    assert kept.wall_ms == pytest.approx(275.0)


def test_keep_specs_parse_to_the_canonical_form() -> None:
    kept = parse_sim_strategy("diloco:8:2:1:keep")
    assert (kept.fragments, kept.delay, kept.alpha, kept.keep) == (2, 1, 0.0, True)
    assert kept.spec == "diloco:8:2:1:keep" and parse_sim_strategy(kept.spec) == kept
    assert SimStrategy(kind="diloco", param=8, fragments=2, delay=1, keep=True) == kept
    with pytest.raises(UsageError, match="keep needs TAU >= 1"):
        SimStrategy(kind="diloco", param=8, fragments=2, delay=0, keep=True)
    # refused as the parser refuses them, though the label alone would not show it
    for kwargs in ({}, {"fragments": 2, "delay": 1, "alpha": 0.5}, {"fragments": 2, "eager": True}):
        with pytest.raises(UsageError, match="keep takes ALPHA's place and needs TAU >= 1"):
            SimStrategy(kind="diloco", param=8, keep=True, **kwargs)
    with pytest.raises(UsageError, match="streaming DiLoCo's"):
        SimStrategy(kind="local", param=8, keep=True)


def test_fragments_without_delay_pay_a_latency_each() -> None:
    # TAU 0: every exchange is waited for at once; F exchanges of S/F cost what one of S does
    # on the bandwidth, plus F - 1 more latencies: 2(n-1) alpha each for a ring.
    n, h, alpha = 4, 4, 1e-3
    comm = CommModel(link=AlphaBeta(alpha=alpha, beta=1e-9), nbytes=8e6)
    c = flat(10.0, n, 40)
    plain = np.median(simulate(f"diloco:{h}", c, comm).period_step_ms())
    two = np.median(simulate(f"diloco:{h}:2:0", c, comm).period_step_ms())
    assert two - plain == pytest.approx(1000 * 2 * (n - 1) * alpha / h)


def test_one_fragment_without_delay_is_plain_diloco() -> None:
    # The timeline, run as plain DiLoCo (F 1, TAU 0), against the simulator's plain diloco:H,
    # a different code path (whole rounds behind a barrier), jitter, straggler, short last round.
    c = ComputeModel(
        workers=5, steps=43, base_ms=(20.0, 22.0, 31.0), jitter_ms=4.0, stragglers=((1, 1.7),)
    ).draw()
    plain = simulate("diloco:8", c, CommModel(comm_ms=35.0))
    tl = timeline(c, Plan(period=8, delay=0, costs=(35.0,), merge_replaces=True))
    assert tl.resume[-1].max() == pytest.approx(plain.wall_ms)
    assert plain.step_ms is not None
    ends = np.minimum(np.arange(7, 43 + 7, 8), 42)
    np.testing.assert_allclose(tl.resume.max(axis=1)[ends], np.cumsum(plain.step_ms)[ends])


@pytest.mark.parametrize(
    "spec", ["diloco:8:4", "diloco:8:2:3", "diloco:8:3:2:0.5", "diloco:6:1:5", "diloco:8:2:eager"]
)
def test_every_worker_accounts_for_the_wall_clock(spec: str) -> None:
    c = ComputeModel(
        workers=6, steps=50, base_ms=(15.0, 18.0), jitter_ms=5.0, stragglers=((4, 2.0),), seed=7
    ).draw()
    res = simulate(spec, c, CommModel(comm_ms=60.0))
    np.testing.assert_allclose(
        res.compute_ms.sum(axis=0) + res.idle_ms.sum(axis=0) + res.comm_ms.sum(), res.wall_ms
    )
    assert res.idle_ms.min() >= -1e-9 and res.comm_ms.min() >= 0
    # The periods' times add up to the wall-clock (H steps each, a short last one).
    lengths = np.diff(np.minimum(np.arange(-1, 50 + res.period - 1, res.period), 49))
    assert float((res.period_step_ms() * lengths).sum()) == pytest.approx(res.wall_ms)


def test_compression_shrinks_each_exchange() -> None:
    # 7.5x fewer bytes: a 40 ms fragment becomes 5.33 ms, under one 10 ms step, so nothing is
    # left but compute, and at the end the fragment started after the last step (5.33 ms)
    # and the final exchange of every fragment (80 / 7.5 ms).
    c = flat(10.0, 2, 16)
    res = simulate("diloco:8:2:1", c, CommModel(comm_ms=80.0, ratio=7.5))
    assert res.wall_ms == pytest.approx(160.0 + 40.0 / 7.5 + 80.0 / 7.5)
    np.testing.assert_allclose(res.comm_ms[:-1], 0.0)
    alpha_beta = CommModel(link=AlphaBeta(alpha=0.0, beta=8e-9), nbytes=12e6, ratio=4.0)
    assert alpha_beta.exchange_ms(2) == pytest.approx(1000 * 12e6 / 4 * 8e-9)
    with pytest.raises(UsageError, match="zero:1's collectives are not compressed"):
        simulate("zero:1", c, CommModel(comm_ms=80.0, ratio=2.0))


def test_per_step_comm_and_from_are_refused_for_streaming() -> None:
    c = flat(10.0, 2, 8)
    with pytest.raises(UsageError, match="per-step comm times are not modelled for diloco:8:2:1"):
        simulate("diloco:8:2", c, CommModel(comm_ms=0.0), comm_steps=np.zeros(8))
    with pytest.raises(UsageError, match="simulate it without --from"):
        WhatIf(strategy="diloco:8:2")


# -- gradsync simulate, streaming --------------------------------------------------------------

MLP_LAYERS = "109980,2864556,27088"  # mlp at 3M parameters: 65h, h^2 + h, 16h + 16, h 1692


def test_cli_shows_streaming_beside_plain(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--strategy", "diloco:8:4", "--workers", "2", "--compute", "10", "--steps", "32"]
    argv += ["--message-mb", "8", "--link-gbps", "1", "--alpha-us", "0"]
    doc = run_json(argv, capsys)
    plain, streaming = doc["beside_plain"]
    assert plain["strategy"] == "diloco:8" and streaming["strategy"] == "diloco:8:4:1"
    # 8 MiB among 2 ranks at 1 Gbit/s: 2 (1/2) S beta = 67.1 ms; a quarter of it 16.8 ms.
    full_ms = 1000 * 8 * 2**20 * 8e-9
    assert plain["peak_exchange_ms"] == pytest.approx(full_ms)
    assert streaming["peak_exchange_ms"] == pytest.approx(full_ms / 4)
    assert (plain["peak_mb"], streaming["peak_mb"]) == pytest.approx((8.0, 2.0))
    # Plain: (8 x 10 + 67.1) / 8; streaming: 16.8 ms hides behind one 10 ms step but 6.8.
    assert plain["median_step_ms"] == pytest.approx((80 + full_ms) / 8)
    assert streaming["median_step_ms"] == pytest.approx((80 + 4 * (full_ms / 4 - 10)) / 8)
    assert streaming["speedup_vs_plain"] > 1
    text = run_text(argv, capsys)
    assert "beside plain DiLoCo" in text and "diloco:8:4:1" in text


def test_cli_layers_and_compression_set_the_peak(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workers", "2", "--compute", "30", "--steps", "16"]
    argv += ["--message-mb", "11.45", "--layers", MLP_LAYERS, "--compression-ratio", "7.5"]
    # The rows split cuts every layer in three: 1/3 of the bytes each, whatever the layers.
    _, rows = run_json(["--strategy", "diloco:8:3:2", *argv], capsys)["beside_plain"]
    assert rows["strategy"] == "diloco:8:3:2"
    assert rows["fragment_shares"] == pytest.approx([1 / 3] * 3)
    assert rows["peak_mb"] == pytest.approx(11.45 / 3 / 7.5)
    # The layers split: one layer per fragment, the peak the middle layer's.
    doc = run_json(["--strategy", "diloco:8:3:2:layers", *argv], capsys)
    plain, streaming = doc["beside_plain"]
    assert streaming["strategy"] == "diloco:8:3:2:layers"
    share = 2864556 / (109980 + 2864556 + 27088)
    assert streaming["peak_share"] == pytest.approx(share)
    assert streaming["peak_mb"] == pytest.approx(11.45 * share / 7.5)
    assert plain["peak_mb"] == pytest.approx(11.45 / 7.5)
    total = 109980 + 2864556 + 27088
    assert streaming["fragment_shares"] == pytest.approx([109980 / total, share, 27088 / total])


def test_cli_layers_set_each_fragments_exchange(capsys: pytest.CaptureFixture[str]) -> None:
    # Layers 1, 6, 1 over 2 fragments: 2/8 and 6/8 of a 40 ms exchange, 10 and 30 ms, each
    # behind one 15 ms step: 0 and 15 ms left per period of 4 x 15, so (60 + 15) / 4 a step.
    # Without --layers both are 20 ms, 5 ms left each: (60 + 10) / 4.
    argv = ["--strategy", "diloco:4:2:1:layers", "--workers", "2", "--compute", "15"]
    argv += ["--steps", "16", "--comm-ms", "40"]
    _, by_layers = run_json([*argv, "--layers", "1,6,1"], capsys)["beside_plain"]
    _, even = run_json(argv, capsys)["beside_plain"]
    argv[1] = "diloco:4:2:1"  # the rows split: even with --layers too
    _, by_rows = run_json([*argv, "--layers", "1,6,1"], capsys)["beside_plain"]
    assert by_rows["median_step_ms"] == pytest.approx(70 / 4)
    assert by_layers["median_step_ms"] == pytest.approx(75 / 4)
    assert even["median_step_ms"] == pytest.approx(70 / 4)
    assert (by_layers["peak_exchange_ms"], even["peak_exchange_ms"]) == pytest.approx((30, 20))
    assert by_layers["peak_mb"] is None  # a fixed --comm-ms knows no bytes


def test_cli_refusals_for_streaming(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match="--layers sizes the fragments.*bsp has none"):
        run_json(["--layers", "1,2"], capsys)
    with pytest.raises(UsageError, match="lists only 3 layers; use F <= 3"):
        run_json(["--strategy", "diloco:8:4:layers", "--layers", MLP_LAYERS], capsys)
    # the rows split cuts the layers: no such bound
    run_json(["--strategy", "diloco:8:4", "--layers", MLP_LAYERS], capsys)
    with pytest.raises(UsageError, match="--from's prediction"):
        run_json(["--from", "nowhere", "--layers", "1,2"], capsys)


# -- the two-level all-reduce through simulate ----------------------------------------------------

S = 8 * 2**20
INTER = AlphaBeta(alpha=100e-6, beta=8e-9)  # --link-gbps 1 --alpha-us 100
INTRA = AlphaBeta(alpha=20e-6, beta=0.5e-9)  # --intra-gbps 16 --intra-alpha-us 20
HOSTS = ["--workers", "4", "--hosts", "2", "--message-mb", "8", "--link-gbps", "1"]
HOSTS += ["--alpha-us", "100", "--intra-gbps", "16", "--intra-alpha-us", "20"]


def _by_hand(nbytes_inter: float = S) -> tuple[float, float]:
    """(hierarchical, flat) ms of one all-reduce of S over 2 hosts x 2 ranks, written out."""
    # Reduce and broadcast over 2 ranks, ring: (1 + 1) alpha + 2 (1/2) S beta each; the two
    # leaders' ring all-reduce: 2 alpha + S beta.
    edge = 2 * INTRA.alpha + S * INTRA.beta
    hier = 2 * edge + 2 * INTER.alpha + nbytes_inter * INTER.beta
    # A ring over 4 ranks, paced by the inter-host link: 6 alpha + 1.5 S beta.
    ring = 6 * INTER.alpha + 1.5 * (S * nbytes_inter / S) * INTER.beta
    return 1000 * hier, 1000 * ring


@pytest.mark.parametrize(("strategy", "period"), [("bsp", 1), ("local:4", 4), ("diloco:8", 8)])
def test_cli_hierarchical_beside_flat(
    strategy: str, period: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*HOSTS, "--strategy", strategy, "--compute", "30", "--steps", "16"]
    doc = run_json([*argv, "--allreduce", "hierarchical"], capsys)
    ring, hier = doc["allreduce_beside"]
    want_hier, want_ring = _by_hand()
    assert (ring["allreduce"], hier["allreduce"]) == ("ring", "hierarchical")
    assert hier["allreduce_ms"] == pytest.approx(want_hier)
    assert ring["allreduce_ms"] == pytest.approx(want_ring)
    # One exchange per period of constant 30 ms steps.
    assert hier["median_step_ms"] == pytest.approx(30 + want_hier / period)
    assert ring["median_step_ms"] == pytest.approx(30 + want_ring / period)
    assert hier["speedup_vs_ring"] == pytest.approx(ring["median_step_ms"] / hier["median_step_ms"])


def test_cli_hierarchical_zero1_gathers_flat(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*HOSTS, "--strategy", "zero:1", "--compute", "30", "--steps", "4"]
    doc = run_json([*argv, "--allreduce", "hierarchical"], capsys)
    ring, hier = doc["allreduce_beside"]
    gather = 1000 * collective_time("allgather", 4, S, INTER.alpha, INTER.beta)
    assert (
        hier["allgather_ms"] == pytest.approx(gather)
        and ring["allgather_ms"] == hier["allgather_ms"]
    )
    want_hier, _ = _by_hand()
    assert hier["median_step_ms"] == pytest.approx(30 + want_hier + gather)
    assert [r["strategy"] for r in doc["beside_bsp"]] == ["bsp", "zero:1"]


def test_hierarchical_compresses_across_hosts_only() -> None:
    hosts = Hosts(hosts=2, intra=INTRA, allreduce="hierarchical")
    comm = CommModel(link=INTER, nbytes=S, ratio=4.0, hosts=hosts)
    want_hier, _ = _by_hand(S / 4)
    assert comm.exchange_ms(4) == pytest.approx(want_hier)
    ring = CommModel(link=INTER, nbytes=S, ratio=4.0, hosts=Hosts(hosts=2, intra=INTRA))
    assert ring.exchange_ms(4) == pytest.approx(_by_hand(S / 4)[1])


def test_hosts_flat_collectives_are_paced_by_the_slower_link() -> None:
    comm = CommModel(link=INTER, nbytes=S, hosts=Hosts(hosts=2, intra=INTRA))
    for op in ("reducescatter", "allgather"):
        want = 1000 * collective_time(op, 4, S, INTER.alpha, INTER.beta)
        assert comm.collective_ms(op, 4) == pytest.approx(want)
    one_host = CommModel(link=INTER, nbytes=S, hosts=Hosts(hosts=1, intra=INTRA))
    assert one_host.exchange_ms(4) == pytest.approx(
        1000 * collective_time("allreduce", 4, S, INTRA.alpha, INTRA.beta)
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "ssp:2", "--allreduce", "hierarchical"], "carries the exchanges of bsp"),
        (["--strategy", "zero:2", "--allreduce", "hierarchical"], "Use --allreduce ring with"),
        (["--strategy", "hogwild"], "hogwild shares one copy"),
        (["--workers", "6"], "6 workers do not split evenly over --hosts 4"),
    ],
)
def test_cli_hosts_refusals(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--hosts", "4", "--workers", "8", "--message-mb", "4"]
    with pytest.raises(UsageError, match=message):
        run_json([*base, *argv], capsys)


def test_cli_hosts_flags_need_hosts_and_a_link(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match="--allreduce hierarchical describe.* give --hosts H"):
        run_json(["--allreduce", "hierarchical", "--message-mb", "4"], capsys)
    with pytest.raises(UsageError, match="--intra-gbps describe"):
        run_json(["--intra-gbps", "10", "--message-mb", "4"], capsys)
    with pytest.raises(UsageError, match="--hosts needs the alpha-beta model"):
        run_json(["--hosts", "2", "--comm-ms", "5"], capsys)
    with pytest.raises(UsageError, match="--from's prediction"):
        run_json(["--from", "nowhere", "--hosts", "2"], capsys)
    with pytest.raises(UsageError, match="--allreduce must be one of ring, hierarchical"):
        Hosts(hosts=2, intra=INTRA, allreduce="tree")


def test_cli_allreduce_choice_is_checked_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run_json(["--allreduce", "star"], capsys)
    assert "choose from 'ring', 'hierarchical'" in capsys.readouterr().err


def test_sweep_takes_streaming_and_hosts(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    argv = [*HOSTS[2:], "--sweep-workers", "4,8", "--strategies", "diloco:8,diloco:8:4"]
    doc = run_json([*argv, "--allreduce", "hierarchical", "--plot-dir", str(tmp_path)], capsys)
    eff = doc["workers_sweep"]["efficiency"]
    assert eff["diloco:8:4:1"][0] > eff["diloco:8"][0]
