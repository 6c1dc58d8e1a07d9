"""A GPU model's snapshot is copied straight into the pooled (and pinned) host buffers, with
non-blocking copies and one wait: complete when ``pack`` returns. The CUDA cases are skipped
where no GPU is visible; the CPU case runs everywhere."""

from __future__ import annotations

import pytest
import torch

from gradsync import compat
from gradsync.checkpoint.packing import BufferPool, pack, unpack

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

CUDA = torch.cuda.is_available()


def _state(device: str) -> dict[str, object]:
    return {
        "w": torch.arange(4096, dtype=torch.float32, device=device),
        "h": torch.ones(3, 5, dtype=torch.bfloat16, device=device),
        "step": 3,
    }


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_gpu_state_is_pooled_pinned_and_whole_when_pack_returns() -> None:
    state = _state("cuda")
    pool = BufferPool(2)
    packed = pack(state, pool)
    assert packed.release is not None  # pooled, as a CPU state's is
    assert all(b.is_cpu and b.is_pinned() for b in packed.buffers)
    state["w"].fill_(-1.0)  # the next step's update must not reach the snapshot
    back = unpack(packed)
    assert torch.equal(back["w"], torch.arange(4096, dtype=torch.float32))
    assert torch.equal(back["h"], torch.ones(3, 5, dtype=torch.bfloat16))
    first = [b.data_ptr() for b in packed.buffers]
    packed.release()
    again = pack(state, pool)
    assert [b.data_ptr() for b in again.buffers] == first  # the pinned buffers reused
    assert torch.equal(unpack(again)["w"], torch.full((4096,), -1.0))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_state_on_the_cpu_and_a_gpu_together_is_pooled() -> None:
    state = {"gpu": torch.arange(10.0, device="cuda"), "cpu": torch.arange(10.0) * 2}
    packed = pack(state, BufferPool(2))
    assert packed.release is not None
    back = unpack(packed)
    assert torch.equal(back["gpu"], torch.arange(10.0))
    assert torch.equal(back["cpu"], torch.arange(10.0) * 2)


def test_a_cpu_state_is_pooled_and_never_pinned() -> None:
    packed = pack(_state("cpu"), BufferPool(2))
    assert packed.release is not None
    assert not any(b.is_pinned() for b in packed.buffers if b.numel())
    if not CUDA:
        assert compat.pin_host_memory(torch.zeros(8)) is False  # no CUDA: nothing to pin
