"""Checkpoints every step: the packed snapshot (``gradsync.checkpoint.packing``) and the background
writer that writes and commits it (``gradsync.checkpoint.writer_thread``), two ranks'
writers sharing one directory in this process. The contract the thread shares with the writer
process is tests/support/background_writers.py's (the process keeps it in
tests/ranks/test_background_checkpoint_process.py)."""

from __future__ import annotations

import io
import json
import os
import re
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.checkpoint import CheckpointError, CheckpointStore, rng_state
from gradsync.checkpoint.packing import BufferPool, constant, pack, read_packed, unpack
from gradsync.checkpoint.store import MANIFEST, snapshot
from tests.support.background_writers import WriterContract, step_dirs

pytestmark = pytest.mark.unit


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _same(a: Any, b: Any, where: str = "state") -> None:
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), where


def test_a_packed_state_comes_back_with_every_type_and_value() -> None:
    model, opt = _trained()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": rng_state(),
        "misc": [1, 2.5, float("nan"), None, True, "s", b"raw", (3, "t"), {4, 5}, complex(1, 2)],
        "types": {"dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2])},
        "ordered": OrderedDict(b=torch.tensor(1, dtype=torch.int64), a=torch.zeros(0)),
        7: {"int key": torch.arange(6, dtype=torch.float64).view(2, 3).t()},  # non-contiguous
    }
    buffer = io.BytesIO()
    size, digest = pack(state).write_to(buffer)
    raw = buffer.getvalue()
    assert (size, digest) == (len(raw), f"{zlib.crc32(raw):08x}")
    back = unpack(read_packed(raw))
    _same(state, back)
    # Each tensor is its own, not a view of a shared buffer a later write could reach.
    back["model"]["0.weight"].add_(1)
    assert torch.equal(back["model"]["1.weight"], state["model"]["1.weight"])
    fresh_model, fresh_opt = _trained()
    fresh_model.load_state_dict(back["model"])
    fresh_opt.load_state_dict(back["optimizer"])


def test_a_snapshot_is_a_copy_taken_when_it_is_made() -> None:
    model, _ = _trained()
    extra = {"position": [1, 2]}
    packed = snapshot({"model": model.state_dict(), "extra": extra})
    with torch.no_grad():
        model[0].weight.add_(1)
    extra["position"].append(3)
    back = unpack(packed)
    assert not torch.equal(back["model"]["0.weight"], model[0].weight)
    assert back["extra"] == {"position": [1, 2]}


def test_a_constant_packs_as_the_tree_it_was_made_of_and_its_text_is_kept() -> None:
    tree = [{"lr": 0.5, "betas": (0.9, 0.99), "params": [0, 1]}, None, 3]
    kept = constant(tree)
    state = {"t": torch.ones(2), "groups": kept, "again": kept}
    packed = pack(state, BufferPool())
    back = unpack(packed)
    _same({"t": torch.ones(2), "groups": tree, "again": tree}, back)
    # listed among the kept encodings, whose text a writer makes (or sends) once
    _, listed, _ = packed.header_parts()
    assert [i for i, e in listed if e is kept] == [1, 2]
    buffer = io.BytesIO()
    packed.write_to(buffer)
    _same(unpack(read_packed(buffer.getvalue())), back)
    with pytest.raises(TypeError, match="no tensors"):
        constant({"t": torch.zeros(1)})


def test_subclasses_that_would_come_back_as_their_base_class_are_refused() -> None:
    from collections import defaultdict, namedtuple

    point = namedtuple("point", "x y")
    for bad, name in [(defaultdict(int), "defaultdict"), (point(1, 2), "point")]:
        with pytest.raises(CheckpointError, match=name):
            snapshot({"extra": {"x": bad}})


def test_a_crafted_packed_file_naming_another_torch_attribute_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(1, 0, 1, {"x": torch.ones(2)})
    store.commit(1, 1)
    path = tmp_path / "step-000001" / "rank-0.pt"
    packed = read_packed(path.read_bytes())
    packed.tree["root"]["d"][0][1] = {"y": "load"}  # torch.load is no dtype
    with open(path, "wb") as f:
        packed.write_to(f)
    # The checksums vouch for the crafted file, as they would for one written by an attacker.
    raw = path.read_bytes()
    manifest = json.loads((path.parent / MANIFEST).read_text())
    manifest["files"]["0"].update(size=len(raw), crc32=f"{zlib.crc32(raw):08x}")
    (path.parent / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not a torch dtype"):
        store.load(store.at(1), 0)


def _crafted(tmp_path: Path, pattern: str, replacement: str) -> CheckpointStore:
    """A committed checkpoint whose packed file's JSON header had ``pattern`` replaced (once),
    its ``.sum`` recomputed before the commit copied it into the manifest: the checksums vouch
    for the file, so only the header's validation can refuse it."""
    store = CheckpointStore(tmp_path)
    store.save(1, 0, 1, {"x": torch.ones(2), "best": float("inf"), "y": torch.zeros(3, 2)})
    path = tmp_path / "step-000001" / "rank-0.pt"
    raw = path.read_bytes()
    start = raw.index(b"{")
    end = start + int.from_bytes(raw[start - 8 : start], "little")
    text, count = re.subn(pattern, replacement, raw[start:end].decode(), count=1)
    assert count == 1, raw[start:end]
    head = text.encode()
    path.write_bytes(raw[: start - 8] + len(head).to_bytes(8, "little") + head + raw[end:])
    raw = path.read_bytes()
    summary = path.with_name(path.name + ".sum")
    meta = json.loads(summary.read_text())
    meta.update(size=len(raw), crc32=f"{zlib.crc32(raw):08x}")
    summary.write_text(json.dumps(meta))
    store.commit(1, 1)
    return store


@pytest.mark.parametrize(
    ("pattern", "replacement", "field"),
    [
        (r'"numel":8\b', '"numel":Infinity', "numel"),  # the tester's file
        (r'"numel":8\b', '"numel":NaN', "numel"),
        (r'"numel":8\b', '"numel":-1', "numel"),
        (r'"numel":8\b', '"numel":1e300', "numel"),
        (r'"numel":8\b', '"numel":2.0', "numel"),
        (r'"numel":8\b', '"numel":true', "numel"),
        (r'"numel":8\b', '"numel":99999999999999999999', "numel"),  # past the file's end
        (r'"offset":0\b', '"offset":-Infinity', "offset"),
        (r'"offset":0\b', '"offset":-1', "offset"),
        (r'"float32":0\}', '"float32":Infinity}', "index"),
        (r'"float32",0,\[2\]', '"float32",0,[Infinity]', "shape"),
        (r'"float32",0,\[2\]', '"float32",0,[-1]', "shape"),
        (r'"float32",2,\[3,2\]', '"float32",2,[3,2e300]', "shape"),
        (r'"float32",2,\[3,2\]', '"float32",2,[3,3]', "shape"),  # past its buffer's end
        (r'"float32",2,\[3,2\]', '"float32",NaN,[3,2]', "offset"),
        (r'\["best",Infinity\]', "[" * 100_000 + "]" * 100_000, "nests deeper"),
        (r'"float32",0,\[2\]', '"complex1024",0,[2]', "does not have"),  # no such buffer
    ],
)
def test_a_crafted_packed_header_number_is_refused_naming_the_field(
    tmp_path: Path, pattern: str, replacement: str, field: str
) -> None:
    store = _crafted(tmp_path, pattern, replacement)
    info = store.latest(1)
    assert info is not None  # the checksums match: the refusal is the header's validation
    with pytest.raises(CheckpointError, match=rf"rank-0\.pt: .*\b{field}\b"):
        store.load(info, 0)


def test_a_header_length_past_the_end_of_the_file_is_refused_naming_it(tmp_path: Path) -> None:
    _crafted(tmp_path, r'"numel":8\b', '"numel":8')
    path = tmp_path / "step-000001" / "rank-0.pt"
    raw = bytearray(path.read_bytes())
    start = raw.index(b"{")
    raw[start - 8 : start] = (len(raw) + 10**9).to_bytes(8, "little")
    with pytest.raises(ValueError, match="the header's length is .* not a whole number"):
        read_packed(bytes(raw))


def test_a_state_holding_infinity_still_loads(tmp_path: Path) -> None:
    # Why the header's parser cannot refuse Infinity: the state's own floats are in it.
    store = _crafted(tmp_path, r'"numel":8\b', '"numel":8')
    info = store.latest(1)
    assert info is not None and store.load(info, 0)["best"] == float("inf")


def test_prune_keeps_the_newest_durable_checkpoint_besides_the_newest_keep(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in range(1, 6):
        store.save(step, 0, 1, {"s": step})
        store.commit(step, 1, durable=step == 2)
    assert sorted(p.name for p in step_dirs(tmp_path)) == [
        "step-000002",
        "step-000004",
        "step-000005",
    ]
    assert [store.at(s).durable for s in (2, 4, 5)] == [True, False, False]


def test_only_durable_writes_and_commits_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store = CheckpointStore(tmp_path, keep=2)
    for rank in range(2):
        store.write(1, rank, 2, snapshot({"r": rank}), durable=False)
    store.commit(1, 2, durable=False)
    assert synced == []  # the background checkpoint between durable ones: page cache only
    for rank in range(2):
        store.write(2, rank, 2, snapshot({"r": rank}), durable=False)
    store.commit(2, 2)
    # the durable commit fsyncs every rank's file (whoever wrote it), the manifest, the dirs
    assert {"rank-0.pt", "rank-1.pt", "step-000002", tmp_path.name} <= set(synced)
    assert any(MANIFEST in name for name in synced)  # under its temporary name, then renamed


def test_the_last_commit_takes_the_newest_step_every_rank_wrote_up_to_rank_0_s_newest(
    tmp_path: Path,
) -> None:
    # What rank 0's writer commits as it ends (``CheckpointFiles.commit_newest``), whatever it
    # had given up: steps 2 and 3 complete, 4 without rank 1's file, 6 left complete from
    # before a rollback to step 4 (above the newest file rank 0 wrote since: never touched).
    store = CheckpointStore(tmp_path, keep=2)
    for step, ranks in [(1, 2), (2, 2), (3, 2), (4, 1), (6, 2)]:
        for rank in range(ranks):
            store.write(step, rank, 2, snapshot({"r": rank}), save_id="run", durable=False)
    store.commit(1, 2, save_id="run")
    info = store.commit_newest(2, newest=4, save_id="run")
    assert info is not None and info.step == 3
    assert store.committed(3, "run") and not store.committed(6, "run")
    assert not store.committed(2, "run")
    assert store.commit_newest(2, newest=4, save_id="run") is None  # 3 is committed already
    assert store.commit_newest(2, newest=6, save_id="other") is None  # no file of another run


class TestTheInlineWriter(WriterContract):
    """The contract of tests/support/background_writers.py, kept by the inline writer."""

    kind = "inline"
    gives_up_apart = False
