"""CheckpointStore: atomic per-rank files, a manifest written last, keep-K, corruption fallback,
weights_only loading that refuses crafted files, and world-size changes."""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import re
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gradsync.checkpoint import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    CheckpointStore,
    CheckpointWarning,
    rng_state,
    safe_load,
    set_rng_state,
)
from gradsync.checkpoint.packing import Packed

pytestmark = pytest.mark.unit


def _state(rank: int, step: int) -> dict[str, Any]:
    """What the training loop checkpoints: model, optimizer, sync state, RNG, data position."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        # error-feedback residuals differ per rank; int keys as the compressors use
        "sync": {
            "step": step,
            "strategy": {"compressor": {"residuals": {0: _residual(rank)}}},
        },
        "rng": rng_state(),
        "data": {"position": 1000 * step + rank, "epoch": 1},
        "step": step,
    }


def _residual(rank: int) -> torch.Tensor:
    return torch.full((3,), float(rank))


def _save_all(store: CheckpointStore, step: int, world: int) -> None:
    for rank in range(world):
        store.save(step, rank, world, _state(rank, step))
    store.commit(step, world)


def _no_warnings(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        return fn(*args, **kwargs)


def test_round_trip_per_rank_state(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    assert store.last_save_seconds is None
    _save_all(store, 120, world=2)
    assert store.last_save_seconds is not None and store.last_save_seconds > 0
    assert store.last_commit_seconds is not None and store.last_save_bytes
    info = _no_warnings(store.latest, world_size=2)
    assert info is not None and info.step == 120 and info.world_size == 2
    for rank in range(2):
        want = _state(rank, 120)
        got = store.load(info, rank)
        for k, v in want["model"].items():
            assert torch.equal(got["model"][k], v)
        assert got["optimizer"]["state"][0]["exp_avg"].equal(
            want["optimizer"]["state"][0]["exp_avg"]
        )
        assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
        residual = got["sync"]["strategy"]["compressor"]["residuals"][0]
        assert torch.equal(residual, _residual(rank))
        assert got["data"] == {"position": 120_000 + rank, "epoch": 1} and got["step"] == 120
    assert store.last_load_seconds is not None


def test_on_disk_layout_and_manifest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _save_all(store, 120, world=2)
    d = tmp_path / "step-000120"
    names = sorted(p.name for p in d.iterdir())
    assert names == [MANIFEST, "rank-0.pt", "rank-0.pt.sum", "rank-1.pt", "rank-1.pt.sum"]
    manifest = json.loads((d / MANIFEST).read_text())
    assert manifest["version"] == FORMAT_VERSION and manifest["step"] == 120
    assert manifest["world_size"] == 2
    for rank in ("0", "1"):
        entry = manifest["files"][rank]
        data = (d / entry["name"]).read_bytes()
        assert entry["size"] == len(data)
        assert entry["crc32"] == f"{zlib.crc32(data):08x}" and "sha256" not in entry


def test_concurrent_ranks_then_commit(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda r: store.save(7, r, 4, {"r": torch.tensor(r)}), range(4)))
    store.commit(7, 4)
    info = _no_warnings(store.latest)
    assert info is not None and [int(store.load(info, r)["r"]) for r in range(4)] == [0, 1, 2, 3]


def test_failed_write_leaves_previous_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path)
    first = store.save(5, 0, 1, {"x": torch.ones(100)})
    before = first.read_bytes()

    def half_then_crash(self: object, f: Any) -> None:
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(Packed, "write_to", half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        store.save(5, 0, 1, {"x": torch.zeros(100)})
    assert first.read_bytes() == before
    assert not [p for p in first.parent.iterdir() if p.name.endswith(".tmp")]


def test_uncommitted_save_is_not_a_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _save_all(store, 10, world=2)
    store.save(20, 0, 2, _state(0, 20))  # rank 1 never saved, nobody committed
    with pytest.warns(CheckpointWarning, match=r"step-000020.*incomplete: no MANIFEST\.json"):
        info = store.latest(2)
    assert info is not None and info.step == 10


def test_many_skipped_checkpoints_are_said_in_a_few_lines(tmp_path: Path) -> None:
    """A hogwild run's ranks drift apart: a resume skipped over a hundred checkpoints one
    rank had not written, a line each. The newest three are said alone, the rest in one."""
    store = CheckpointStore(tmp_path, keep=20)
    _save_all(store, 10, world=2)
    for step in range(11, 19):  # rank 1 never saved these
        store.save(step, 0, 2, _state(0, step))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        info = store.latest(2)
    assert info is not None and info.step == 10
    said = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert [re.search(r"step-0000\d\d", line)[0] for line in said[:3]] == [  # type: ignore[index]
        "step-000018",
        "step-000017",
        "step-000016",
    ]
    assert len(said) == 4, said
    assert said[3].startswith("skipping 5 more checkpoint(s) in "), said[3]
    assert "(step-000011 to step-000015): incomplete: no MANIFEST.json" in said[3], said[3]


def test_commit_refuses_missing_rank(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(3, 0, 3, {"a": 1})
    store.save(3, 2, 3, {"a": 1})
    with pytest.raises(CheckpointError, match=r"rank\(s\) 1 of 3"):
        store.commit(3, 3)
    assert not (tmp_path / "step-000003" / MANIFEST).exists()


def test_a_commit_removes_the_files_of_ranks_beyond_its_world(tmp_path: Path) -> None:
    # a larger world's leftovers, the rank file and its .sum (until 2026-11-30 the .sum stayed)
    store = CheckpointStore(tmp_path)
    store.save(1, 2, 3, _state(2, 1))
    _save_all(store, 1, world=2)
    assert sorted(p.name for p in (tmp_path / "step-000001").iterdir()) == [
        MANIFEST,
        "rank-0.pt",
        "rank-0.pt.sum",
        "rank-1.pt",
        "rank-1.pt.sum",
    ]


def test_keep_last_k(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        _save_all(store, step, world=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000030", "step-000040"]
    store.save(50, 0, 2, {"a": 1})  # a save in progress, newer than every commit
    store.prune()
    assert (tmp_path / "step-000050").exists() and (tmp_path / "step-000030").exists()
    store = CheckpointStore(tmp_path, keep=1)
    store.prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000040", "step-000050"]


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (_corrupt, "rank-1.pt is corrupted"),
        (_truncate, "rank-1.pt is truncated"),
        (Path.unlink, "rank-1.pt is missing"),
    ],
)
def test_damaged_newest_falls_back_with_warning(tmp_path: Path, damage: Any, why: str) -> None:
    store = CheckpointStore(tmp_path)
    _save_all(store, 10, world=2)
    _save_all(store, 20, world=2)
    damage(tmp_path / "step-000020" / "rank-1.pt")
    with pytest.warns(CheckpointWarning, match=f"step-000020: {why}") as record:
        info = store.latest(2)
    assert len(record) == 1 and "falling back" in str(record[0].message)
    assert info is not None and info.step == 10
    assert store.load(info, 1)["step"] == 10


def test_damaged_manifest_falls_back(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _save_all(store, 10, world=1)
    _save_all(store, 20, world=1)
    (tmp_path / "step-000020" / MANIFEST).write_text('{"format": "gradsync-chec')
    with pytest.warns(CheckpointWarning, match=r"step-000020: MANIFEST\.json is unreadable"):
        info = store.latest()
    assert info is not None and info.step == 10


@pytest.mark.parametrize(
    ("pattern", "replacement", "why"),
    [
        (r'"size": ?\d+', '"size": Infinity', "is malformed"),  # json takes it; int() overflowed
        (r'"created": ?[\d.]+', '"created": 1' + "0" * 400, "is malformed"),  # so did float()
        (r'"world_size": ?\d+', '"world_size": -Infinity', "is malformed"),
        # a world no list of files covers: was a MemoryError building range(world_size)
        (r'"world_size": ?\d+', '"world_size": 10000000000000', "lists ranks"),
        (r'"created": ?[\d.]+', '"created": ' + "[" * 100_000 + "]" * 100_000, "is unreadable"),
    ],
)
def test_a_crafted_manifest_number_falls_back(
    tmp_path: Path, pattern: str, replacement: str, why: str
) -> None:
    store = CheckpointStore(tmp_path)
    _save_all(store, 10, world=1)
    _save_all(store, 20, world=1)
    m = tmp_path / "step-000020" / MANIFEST
    text, count = re.subn(pattern, replacement, m.read_text(), count=1)
    assert count == 1
    m.write_text(text)
    with pytest.warns(CheckpointWarning, match=rf"step-000020: MANIFEST\.json {why}"):
        info = store.latest()
    assert info is not None and info.step == 10


def test_manifest_cannot_point_outside(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _save_all(store, 10, world=1)
    m = tmp_path / "step-000010" / MANIFEST
    manifest = json.loads(m.read_text())
    manifest["files"]["0"]["name"] = "../../etc/passwd"
    m.write_text(json.dumps(manifest))
    with pytest.warns(CheckpointWarning, match="outside the checkpoint"):
        assert store.latest() is None


def test_newer_format_version_is_skipped(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _save_all(store, 10, world=1)
    m = tmp_path / "step-000010" / MANIFEST
    m.write_text(json.dumps(json.loads(m.read_text()) | {"version": 99}))
    with pytest.warns(CheckpointWarning, match="version 99"):
        assert store.latest() is None


def test_nothing_usable_gives_none(tmp_path: Path) -> None:
    assert _no_warnings(CheckpointStore(tmp_path / "absent").latest) is None
    store = CheckpointStore(tmp_path)
    _save_all(store, 10, world=1)
    _corrupt(tmp_path / "step-000010" / "rank-0.pt")
    with pytest.warns(CheckpointWarning, match="corrupted"):
        assert store.latest() is None


def test_load_rechecks_the_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _save_all(store, 10, world=1)
    info = _no_warnings(store.latest)
    assert info is not None
    _corrupt(info.file(0))  # damaged after latest() vouched for it
    with pytest.raises(CheckpointError, match="corrupted"):
        store.load(info, 0)


def test_resave_of_a_step_drops_its_old_manifest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _save_all(store, 10, world=1)
    _save_all(store, 20, world=1)
    store.save(20, 0, 1, _state(0, 21))  # a resumed run back at step 20, not yet committed
    with pytest.warns(CheckpointWarning, match="step-000020: incomplete"):
        info = store.latest()
    assert info is not None and info.step == 10


class _RunsCode:
    """Unpickling this calls exec: what a malicious checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def _plant(tmp_path: Path, step: int, writer: str) -> tuple[CheckpointStore, Path]:
    """A checkpoint whose manifest is valid (checksums match) but whose file runs code."""
    marker = tmp_path / "marker"
    store = CheckpointStore(tmp_path / "ckpt")
    d = store.step_dir(step)
    d.mkdir(parents=True)
    payload = {"model": {"w": torch.ones(2)}, "evil": _RunsCode(marker)}
    path = d / "rank-0.pt"
    with open(path, "wb") as f:
        if writer == "torch":
            torch.save(payload, f)
        else:
            pickle.dump(payload, f)
    data = path.read_bytes()
    files = {
        "0": {"name": path.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    }
    manifest = {"format": "gradsync-checkpoint", "version": FORMAT_VERSION, "step": step}
    manifest |= {"world_size": 1, "created": 0.0, "files": files}
    (d / MANIFEST).write_text(json.dumps(manifest))
    return store, marker


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("writer", ["torch", "pickle"])
def test_crafted_file_is_refused_without_running(tmp_path: Path, writer: str) -> None:
    store, marker = _plant(tmp_path, 5, writer)
    info = _no_warnings(store.latest)
    assert info is not None  # intact as far as checksums go: the refusal is weights_only's
    # control: an unrestricted load runs the payload, so the refusal below is what stops it
    if writer == "torch":
        torch.load(info.file(0), weights_only=False)
    else:
        pickle.loads(info.file(0).read_bytes())
    assert marker.read_text() == "pwned"
    marker.unlink()
    with pytest.raises(CheckpointError) as exc:
        store.load(info, 0)
    message = str(exc.value)
    assert "refusing to load" in message and "possible code execution" in message
    assert "rank-0.pt" in message and "exec" in message  # torch's reason names the global
    assert "add_safe_globals" not in message  # no advice to allowlist what tried to run
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="refusing to load"):
        safe_load(info.file(0))
    assert not marker.exists()


def test_save_refuses_state_weights_only_cannot_load(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    bad = {"rng": {"numpy": np.random.get_state()}}
    with pytest.raises(CheckpointError, match=r"state\['rng'\]\['numpy'\]\[1\].*numpy\.ndarray"):
        store.save(1, 0, 1, bad)
    assert not (tmp_path / "step-000001" / "rank-0.pt").exists()
    with pytest.raises(CheckpointError, match="defaultdict"):
        store.save(1, 0, 1, {"d": __import__("collections").defaultdict(list)})


def test_world_size_change_is_refused_unless_allowed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _save_all(store, 10, world=2)
    with pytest.raises(CheckpointError, match="written by 2 ranks and resuming with 3 is not"):
        store.latest(world_size=3)
    info = store.latest(world_size=3, allow_world_change=True)
    assert info is not None and info.world_size == 2
    with pytest.raises(CheckpointError, match="source_rank=0"):
        store.load(info, 2)
    seeded = store.load(info, 2, source_rank=0)
    assert torch.equal(seeded["sync"]["strategy"]["compressor"]["residuals"][0], torch.zeros(3))
    assert seeded["data"]["position"] == 10_000  # rank 0's: the caller re-shards it


def test_rng_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's generator
    np.random.standard_normal()  # and in numpy's legacy generator
    store = CheckpointStore(tmp_path)
    store.save(1, 0, 1, {"rng": rng_state()})
    store.commit(1, 1)

    def draw() -> tuple[Any, ...]:
        return (torch.rand(3), random.random(), random.gauss(0, 1), np.random.standard_normal(2))

    expected = draw()
    draw()  # move every generator on
    info = _no_warnings(store.latest)
    assert info is not None
    set_rng_state(store.load(info, 0)["rng"])
    got = draw()
    assert torch.equal(got[0], expected[0]) and got[1:3] == expected[1:3]
    assert np.array_equal(got[3], expected[3])


def test_rng_state_taken_every_step_follows_generators_that_move_or_stay() -> None:
    # rng_state() reuses its conversions while a state is unchanged: a state taken after the
    # generators moved (numpy past its 624-word block too) must still be the new one.
    random.seed(7)
    np.random.seed(8)
    for step in range(4):
        state = rng_state()
        if step % 2:  # some steps draw nothing: the same state, reused
            again = rng_state()
            assert torch.equal(again["python"]["state"], state["python"]["state"])
        expected = (random.random(), np.random.standard_normal(700))
        set_rng_state(state)
        got = (random.random(), np.random.standard_normal(700))
        assert got[0] == expected[0] and np.array_equal(got[1], expected[1]), step


def test_python_rng_state_of_older_checkpoints_as_a_list_still_restores() -> None:
    random.seed(5)
    state = rng_state()
    assert isinstance(state["python"]["state"], torch.Tensor)  # packed as one tensor now
    older = {"python": {**state["python"], "state": state["python"]["state"].tolist()}}
    expected = random.random()
    random.random()
    set_rng_state(older)
    assert random.random() == expected


def test_set_rng_state_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown RNG state keys"):
        set_rng_state({"torhc": torch.get_rng_state()})


def test_config_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=0)
    store = CheckpointStore(tmp_path)
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        store.save(1, 2, 2, {})
    with pytest.raises(ValueError, match="step"):
        store.save(-1, 0, 1, {})
    with pytest.raises(CheckpointError, match="must be a dict"):
        store.save(1, 0, 1, [torch.ones(1)])  # type: ignore[arg-type]


class _Shell:
    """Pickles as a call of os.system: what a crafted checkpoint would run on load."""

    def __reduce__(self) -> tuple:
        import os

        return (os.system, ("true",))


def test_a_refusal_names_the_blocked_global_and_never_suggests_disabling_weights_only(
    tmp_path: Path,
) -> None:
    path = tmp_path / "crafted.pt"
    torch.save({"model": _Shell()}, path)
    with pytest.raises(CheckpointError) as exc:
        safe_load(path)
    message = str(exc.value)
    assert "posix.system" in message or "nt.system" in message, message
    assert "weights_only" not in message, message
