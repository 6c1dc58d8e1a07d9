"""The codecs' compiled device kernels on a GPU (issue 44; skipped without one): their results
against the same functions run as torch ops on the CPU, and a compressed step that never waits
for the device, under CUDA's sync debug mode. e2e, not unit: torch.compile runs the compiler
(its workers, ptxas) as processes."""

from __future__ import annotations

import pytest
import torch

import gradsync as gs
from gradsync.compression import fused
from gradsync.compression._wire import derive_seed
from gradsync.workloads import make_workload
from tests.support.cuda_sync import one_nccl_rank, steps_that_never_wait

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _gradient(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen)
    x[::17] = 0.0
    return x


def _seed(device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    return fused.seed_words(derive_seed(9), torch.device(device))


_FUNCTIONS = (
    fused.int4_encode,
    fused.int4_decode,
    fused.sign_encode,
    fused.sign_decode,
    fused.int8_encode,
    fused.int8_decode,
    fused.randomk_gather,
    fused.randomk_scatter,
)


@pytest.mark.parametrize("n", (1000, 1_000_003))
def test_compiled_kernels_on_the_gpu_give_the_cpu_results(n: int) -> None:
    # Kernels of the test's own, not the codecs': theirs count the shapes they compile
    # (fused.MAX_SHAPES), which the steps' test below needs for its buckets. torch.compile's
    # own count, per function, takes these 2 sizes (4 compilations of an accumulate) and
    # that test's few within its 8.
    kernels = {fn.__name__: fused.Kernel(fn) for fn in _FUNCTIONS}
    x = _gradient(n)
    gpu = x.cuda()
    pairs = (
        (kernels["int4_encode"], kernels["int4_decode"], 128),
        (kernels["sign_encode"], kernels["sign_decode"], 64),
    )
    for kernel, decode, chunk in pairs:
        scale, packed = kernel.fn(x, chunk)
        got = kernel.run(gpu, chunk)
        assert got is not None, f"{kernel.fn.__name__} was not compiled"
        assert torch.equal(got[1].cpu(), packed), kernel.fn.__name__
        torch.testing.assert_close(got[0].cpu(), scale, rtol=1e-6, atol=0)
        on_gpu = decode.run(got[1], got[0], n, chunk, torch.float32)
        assert torch.equal(on_gpu.cpu(), decode.fn(packed, got[0].cpu(), n, chunk, torch.float32))
    scale, codes = fused.int8_encode(x, 1024, *_seed("cpu"))
    got = kernels["int8_encode"].run(gpu, 1024, *_seed(gpu.device))
    assert got is not None
    # max |x| / 127: the compiler may multiply by 1/127 where the CPU divides (its last bit).
    torch.testing.assert_close(got[0].cpu(), scale, rtol=2**-23, atol=0)
    # The integer noise is the same on both; x / s may round differently in its last bit,
    # which moves a code by one only where x / s + noise lands within that bit of a half.
    assert int((got[1].cpu().int() - codes.int()).abs().max()) <= 1
    assert float((got[1].cpu() != codes).double().mean()) < 1e-4
    codes_gpu, scale_gpu = got[1], got[0]
    decoded = kernels["int8_decode"].run(codes_gpu, scale_gpu, 1024, torch.float32)
    expected = fused.int8_decode(codes_gpu.cpu(), scale_gpu.cpu(), 1024, torch.float32)
    assert decoded is not None and torch.equal(decoded.cpu(), expected)
    k = max(1, n // 100)
    position, size = fused.strata(n, k, *_seed("cpu"))
    on_gpu_position, on_gpu_size = fused.strata(n, k, *_seed(gpu.device))
    assert torch.equal(on_gpu_position.cpu(), position)  # the same draw on either device
    values = fused.randomk_gather(x, position, size, torch.float32)
    on_gpu = kernels["randomk_gather"].run(gpu, on_gpu_position, on_gpu_size, torch.float32)
    assert on_gpu is not None and torch.equal(on_gpu.cpu(), values)
    scattered = kernels["randomk_scatter"].run(on_gpu, on_gpu_position, n)
    assert torch.equal(scattered.cpu(), fused.randomk_scatter(values, position, n))


#: the compressors with fused kernels (each with the kernel its hook's encode compiles), and
#: top-k, whose selection on a GPU is torch.topk
COMPRESSIONS = {
    "int8": fused.INT8_ENCODE,
    "int4": fused.INT4_ENCODE,
    "sign": fused.SIGN_ENCODE,
    "randomk:0.25": fused.RANDOMK_GATHER,
    "topk:0.1": None,
}
WARMUP, STEPS = 2, 8


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_a_compressed_step_never_waits_for_the_device(
    compression: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bsp with each codec on one NCCL rank: after the warm-up steps (which compile), no call
    in the step may synchronize with the device (CUDA's sync debug mode raises), and the
    codec's compiled kernel ran in each step."""
    kernel = COMPRESSIONS[compression]
    compiled_runs = [0]
    if kernel is not None:
        real_run = fused.Kernel.run

        def counted(self: fused.Kernel, *args: object) -> object:
            got = real_run(self, *args)
            compiled_runs[0] += self is kernel and got is not None
            return got

        monkeypatch.setattr(fused.Kernel, "run", counted)
    with one_nccl_rank():
        w = make_workload("mlp", seed=2, params=30000)
        model = w.build_model().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        sync = gs.Synchronizer(
            model, opt, compression=compression, telemetry_every=100, check_every=0
        )
        steps_that_never_wait(sync, w, model, STEPS, WARMUP)
        sync.close()
    if kernel is not None:  # the steps ran the compiled kernel, not the codec's own ops
        assert compiled_runs[0] >= STEPS, compiled_runs
