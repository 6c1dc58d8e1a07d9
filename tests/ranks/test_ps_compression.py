"""Compressed parameter-server pushes: each worker encodes its gradient with a push codec, the
server decodes it (gradsync.compression.push); error feedback stays on the worker and resumes
from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import ps_compression_ranks as ranks
from tests.support import rank_device

pytestmark = pytest.mark.ranks

# float64 parameters: the updates are applied in a different order and grouping than in the
# reference (w0's half, then w1's half, instead of their mean), which costs a few ulps.
TOL = {"rtol": 1e-9, "atol": 1e-12}
#: codecs whose output jumps where an input crosses a bin edge (int8's scale steps, sign's
#: zero): on a GPU (GRADSYNC_RANK_DEVICE) the gradient's last bits differ from the CPU
#: reference's, a few elements change bins, and TOL no longer holds. tests/ranks/test_gpu_ranks.py
#: compares them with the CPU relative to the update instead.
ON_BIN_EDGES = ("int8", "sign")
ON_CPU = rank_device.not_on_device("int8 and sign flip bins on the device's rounding")


@pytest.fixture(scope="module")
def every_spec() -> list[dict[str, object]]:
    return run_ranks(ranks.every_spec, ranks.WORKERS + 1, timeout_s=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "spec", [pytest.param(s, marks=ON_CPU) if s in ON_BIN_EDGES else s for s in ranks.SPECS]
)
def test_compressed_pushes_follow_the_reference_trajectory(
    every_spec: list[dict[str, dict[str, object]]], spec: str
) -> None:
    w0, w1 = every_spec[0][spec], every_spec[1][spec]
    # both workers end with the server's final parameters
    assert torch.equal(w0["params"], w1["params"])  # type: ignore[arg-type]
    want = ranks.reference(spec)
    assert torch.allclose(w0["params"], want, **TOL), spec  # type: ignore[arg-type]
    # and the compressed run really is a different trajectory from the uncompressed one
    plain = every_spec[0]["none"]["params"]
    assert not torch.allclose(plain, want, **TOL)  # type: ignore[arg-type]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec", ranks.SPECS)
def test_compressed_pushes_put_the_codec_bytes_on_the_wire(
    every_spec: list[dict[str, dict[str, object]]], spec: str
) -> None:
    numel = every_spec[0]["none"]["params"].numel()  # type: ignore[union-attr]
    codec = ranks.codec(spec)
    plain = every_spec[0]["none"]["bytes"]
    sent = every_spec[0][spec]["bytes"]
    # The header: 8 bytes (the kind), then 8 (the lr of the optimizer's one param group).
    assert plain == [8 * numel + 16] * ranks.STEPS  # float64 gradient plus the header
    assert sent == [codec.payload_numel + 16] * ranks.STEPS  # the payload plus the header
    assert max(sent) < max(plain)  # type: ignore[type-var]


@pytest.mark.timeout(240)
def test_worker_residuals_resume_from_a_checkpoint(tmp_path: Path) -> None:
    results = run_ranks(ranks.save_then_resume, ranks.WORKERS + 1, str(tmp_path), timeout_s=200)
    for spec in ranks.EF_SPECS:
        if spec in ON_BIN_EDGES and rank_device.requested():
            continue  # see ON_BIN_EDGES; the other codecs still check the resume
        # the resumed run lands where the uninterrupted reference does only if every worker's
        # error-feedback residual (and PowerSGD's warm-start Q) came back with the checkpoint
        assert torch.allclose(results[0][spec]["params"], ranks.reference(spec), **TOL), spec
