"""The replicas' model and optimizer state written as one share per rank and joined on load."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from gradsync.checkpoint import replicas
from gradsync.checkpoint.packing import BufferPool, pack, unpack

pytestmark = pytest.mark.unit


def _trained_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            type(a) is type(b)
            and list(a) == list(b)  # type: ignore[call-overload]
            and all(_equal(a[k], b[k]) for k in a)  # type: ignore[index]
        )
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)  # type: ignore[arg-type]
            and all(_equal(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[call-overload]
        )
    return bool(a == b)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shares_written_and_read_back_join_to_the_whole_state(world: int) -> None:
    state = _trained_state()
    owner = replicas.owners(state, world)
    # Through the checkpoint file's own format, as save and load see them.
    shares = [unpack(pack(replicas.share(state, r, owner))) for r in range(world)]
    assert _equal(replicas.join(shares, owner), state)


def test_each_rank_writes_only_its_share_and_the_shares_are_balanced() -> None:
    state = _trained_state()
    total = pack(state).nbytes
    owner = replicas.owners(state, 3)
    written = [pack(replicas.share(state, r, owner)).nbytes for r in range(3)]
    assert sum(written) == total  # every byte once
    largest = max(t.numel() * t.element_size() for t in replicas._tensors(state))
    assert max(written) - min(written) <= largest
    assert replicas.owners(_trained_state(), 3) == owner  # every replica computes the same


def test_small_tensors_are_spread_by_their_count_too() -> None:
    # Two large tensors of unequal size, then many small ones (AdamW's steps, biases). By bytes
    # alone the rank with the smaller large tensor took every small one (1 tensor against 41),
    # though each tensor costs a copy of its own.
    state = {
        "big": torch.zeros(16384),
        "less": torch.zeros(12288),
        "steps": [torch.tensor(1.0) for _ in range(30)],
        "biases": [torch.zeros(64) for _ in range(10)],
    }
    owner = replicas.owners(state, 2)
    counts = [owner.count(r) for r in range(2)]
    assert abs(counts[0] - counts[1]) <= 6, counts
    costs = replicas._costs(replicas._tensors(state))
    loads = [sum(c for c, o in zip(costs, owner, strict=True) if o == r) for r in range(2)]
    assert abs(loads[0] - loads[1]) <= max(costs)


def test_containers_keep_their_types() -> None:
    state = {"m": OrderedDict(w=torch.ones(2)), "t": (torch.zeros(3), 5), "l": [torch.ones(1)]}
    owner = replicas.owners(state, 2)
    shares = [unpack(pack(replicas.share(state, r, owner))) for r in range(2)]
    joined = replicas.join(shares, owner)
    assert type(joined["m"]) is OrderedDict and type(joined["t"]) is tuple
    assert _equal(joined, state)


@pytest.mark.parametrize("pooled", [False, True])
def test_a_rank_that_owns_no_tensor_of_a_dtype_packs_its_placeholders(pooled: bool) -> None:
    state = {"w": torch.ones(4), "n": torch.arange(3), "b": torch.zeros(2, dtype=torch.float64)}
    owner = replicas.owners(state, 3)
    pool = BufferPool() if pooled else None
    shares = [unpack(pack(replicas.share(state, r, owner), pool)) for r in range(3)]
    assert sorted(owner) == [0, 1, 2]  # one tensor (one dtype) each
    assert _equal(replicas.join(shares, owner), state)


def test_pooled_buffers_are_reused_only_once_released() -> None:
    pool = BufferPool()
    state = {"w": torch.ones(4)}
    first = pack(state, pool)
    state["w"].add_(1)
    second = pack(state, pool)  # the first is not released: a buffer of its own
    assert first.buffers[0].data_ptr() != second.buffers[0].data_ptr()
    assert torch.equal(unpack(first)["w"], torch.ones(4))
    assert first.release is not None
    first.release()
    third = pack(state, pool)
    assert third.buffers[0].data_ptr() == first.buffers[0].data_ptr()
    assert torch.equal(unpack(third)["w"], torch.full((4,), 2.0))


def test_shares_of_another_model_are_refused() -> None:
    state = _trained_state()
    owner = replicas.owners(state, 2)
    other = {"model": {"w": torch.ones(2)}, "optimizer": {}}
    mine = unpack(pack(replicas.share(state, 0, owner)))
    with pytest.raises(ValueError, match="holds 1 tensors"):
        replicas.join([mine, other], owner)
    with pytest.raises(ValueError, match="names rank 1, only 1 shares"):
        replicas.join([mine], owner)
    with pytest.raises(ValueError, match="holds 1 tensors, 3 owned"):
        pack(replicas.share(other, 0, [0, 1, 0]))
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        replicas.owners(state, 0)


def _file_bytes(packed: object) -> bytes:
    import io

    f = io.BytesIO()
    packed.write_to(f)  # type: ignore[attr-defined]
    return f.getvalue()


def _read(data: bytes) -> object:
    from gradsync.checkpoint.packing import read_packed

    return unpack(read_packed(data))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_share_encoded_once_is_reused_and_writes_the_same_file(world: int) -> None:
    # A checkpoint every step reuses the share's encoding (and its JSON text) while the model
    # and optimizer keep their layout: the file must be byte for byte the one a fresh walk
    # writes, with the values of the moment it was taken.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    pool = BufferPool()
    for step in range(3):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        whole = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        for rank in range(world):
            shared = replicas.share_of(whole, rank, world)
            assert list(shared.owner) == replicas.owners(whole, world)
            cached = pack({"replicated": shared, "step": step}, pool)
            plain = pack({"replicated": replicas.share(whole, rank, shared.owner), "step": step})
            assert _file_bytes(cached) == _file_bytes(plain)
            assert cached.release is not None
            cached.release()
        reused = pool.shares and next(iter(pool.shares.values()))
        assert reused and reused.json is not None  # kept, its text made once
    shares = [
        _read(_file_bytes(pack({"r": replicas.share_of(whole, r, world)}, pool)))
        for r in range(world)
    ]
    joined = replicas.join([s["r"] for s in shares], replicas.owners(whole, world))  # type: ignore[index]
    assert _equal(joined, whole)


@pytest.mark.parametrize(
    "change",
    [
        "lr",  # a scheduler's new learning rate
        "lr_int",  # 1.0 becomes 1: equal values, another JSON
        "negative_zero",  # 0.0 becomes -0.0: == cannot tell them apart
        "bool",  # 1 becomes True
        "new_tensor_shape",  # a parameter replaced by one of another shape
        "new_tensor_dtype",  # or of another dtype
        "tensor_to_number",  # an entry that held a tensor now holds a number
        "new_key",
    ],
)
def test_a_share_that_changed_is_encoded_again(change: str) -> None:
    def state(lr: object = 1.0, wd: object = 0.0, flag: object = 1, extra: bool = False) -> dict:
        tree: dict[str, object] = {
            "w": torch.ones(3),
            "groups": [{"lr": lr, "weight_decay": wd, "flag": flag, "params": [0, 1]}],
        }
        if extra:
            tree["m"] = torch.zeros(2)
        return tree

    pool = BufferPool()
    before = state()
    pack({"r": replicas.share_of(before, 0, 1)}, pool)
    after = {
        "lr": state(lr=0.5),
        "lr_int": state(lr=1),
        "negative_zero": state(wd=-0.0),
        "bool": state(flag=True),
        "new_tensor_shape": {**state(), "w": torch.ones(4)},
        "new_tensor_dtype": {**state(), "w": torch.ones(3, dtype=torch.float64)},
        "tensor_to_number": {**state(), "w": 1.0},
        "new_key": state(extra=True),
    }[change]
    got = _read(_file_bytes(pack({"r": replicas.share_of(after, 0, 1)}, pool)))["r"]  # type: ignore[index]
    want = _read(_file_bytes(pack({"r": replicas.share(after, 0, replicas.owners(after, 1))})))
    assert _equal(got, want["r"])  # type: ignore[index]
    for key, value in after["groups"][0].items():  # type: ignore[index]
        assert type(got["groups"][0][key]) is type(value)  # type: ignore[index]
        assert str(got["groups"][0][key]) == str(value)  # type: ignore[index]


def test_a_share_after_other_tensors_of_its_dtype_is_not_reused_at_other_offsets() -> None:
    # The kept encoding holds offsets into the dtype's buffer: it is reused only from where it
    # was made (here, once before a tensor of the same dtype, once after one).
    pool = BufferPool()
    tree = {"w": torch.arange(4.0)}
    first = pack({"r": replicas.share_of(tree, 0, 1), "x": torch.ones(2)}, pool)
    second = pack({"x": torch.full((2,), 7.0), "r": replicas.share_of(tree, 0, 1)}, pool)
    for packed in (first, second):
        data = _read(_file_bytes(packed))
        assert torch.equal(data["r"]["w"], torch.arange(4.0))  # type: ignore[index]
    assert torch.equal(_read(_file_bytes(second))["x"], torch.full((2,), 7.0))  # type: ignore[index]


def test_a_whole_share_writes_the_file_its_plain_tree_writes_and_keeps_its_encoding() -> None:
    # A state only this rank holds (a parameter-server worker's model, a server's shard),
    # saved every step: packed through ``whole`` it must be byte for byte the plain tree's
    # file, its encoding made once and reused beside another share in the same state.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    pool = BufferPool()
    kept = []
    for step in range(3):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        sd, osd = model.state_dict(), opt.state_dict()
        plain = pack({"model": sd, "optimizer": {**osd}, "step": step})
        shared = {"model": replicas.whole(sd, 1), "optimizer": {**osd}, "step": step}
        shared["optimizer"]["state"] = replicas.whole(osd["state"], 1)
        cached = pack(shared, pool)
        assert _file_bytes(cached) == _file_bytes(plain)
        assert len(cached.shares) == 2
        kept.append(cached.shares)
        assert cached.release is not None
        cached.release()
    assert all(a is b for a, b in zip(kept[1], kept[2], strict=True))  # reused, both
    assert _equal(_read(_file_bytes(cached))["model"], model.state_dict())  # type: ignore[index]
