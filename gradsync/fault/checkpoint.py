"""Atomic, verified checkpoints: one file per rank per step, a manifest written last.

::

    DIR/step-000120/rank-0.pt        torch.save of rank 0's state
    DIR/step-000120/rank-0.pt.sum    size and crc32 of rank-0.pt, written by rank 0's save
    DIR/step-000120/MANIFEST.json    written last, by rank 0's commit: marks the step complete

Protocol (the store does no collectives; the caller decides when every rank has written)::

    store.save(step, rank, world_size, state)      # every rank
    barrier()                                      # or: poll until not store.missing(...)
    if rank == 0: store.commit(step, world_size)   # writes the manifest, prunes to ``keep``

Each file holds the state packed (``gradsync.fault.packing``): a snapshot is one copy of the
tensors, and ``CheckpointWriter`` (``gradsync.fault.background``) writes and commits it off the
training thread, so a checkpoint can be taken every step.

On resume every rank calls ``latest(world_size)`` (same answer on a shared filesystem: it only
reads) and ``load(info, rank)``, which reads with ``torch.load(weights_only=True)``.
See docs/checkpoints.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from gradsync.fault.packing import (
    BufferPool,
    Crc32,
    Packed,
    is_packed_file,
    pack,
    read_packed,
    unpack,
)
from gradsync.fault.recycle import SpareFiles

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "CheckpointWarning",
    "FileEntry",
    "safe_load",
    "snapshot",
]

FORMAT = "gradsync-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_SUFFIX = ".tmp"
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or loaded; the message says which and why."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (incomplete, truncated, corrupted) in favour of an older one."""


class _Invalid(Exception):
    """Why a checkpoint directory is unusable: becomes a CheckpointWarning, then a fallback."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FileEntry:
    """One rank's file as the manifest records it: its checksum is ``crc32`` (files written
    since gradsync switched to it, see ``packing.Crc32``) or ``sha256`` (files before)."""

    name: str
    size: int
    sha256: str = ""
    crc32: str = ""

    def as_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": self.name, "size": self.size}
        entry.update({k: v for k, v in (("crc32", self.crc32), ("sha256", self.sha256)) if v})
        return entry


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    """A complete checkpoint, as its manifest describes it."""

    step: int
    world_size: int
    path: Path
    files: Mapping[int, FileEntry] = field(default_factory=dict)
    created: float = 0.0
    #: whether its files, manifest and directory entries were fsynced (see ``commit``)
    durable: bool = True

    def file(self, rank: int) -> Path:
        return self.path / self.files[rank].name


def _rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class CheckpointStore:
    """Checkpoints under ``directory``, keeping the newest ``keep`` complete ones.

    ``last_save_seconds``, ``last_commit_seconds`` and ``last_load_seconds`` time this process's
    most recent call of each (``None`` before the first), for reliability reports.
    """

    def __init__(self, directory: str | Path, *, keep: int = 2, recycle: bool = False) -> None:
        self.directory = Path(directory)
        self.keep = _check_int("keep", keep, 1)
        #: with ``recycle``, pruned checkpoints' files are overwritten by later saves instead
        #: of deleted and created anew (``fault.recycle``: what a checkpoint every step costs)
        self.spares = SpareFiles(self.directory) if recycle else None
        #: whether each step this store committed is durable (``prune`` reads no manifest)
        self._durable: dict[int, bool] = {}
        self.last_save_seconds: float | None = None
        self.last_save_bytes: int | None = None
        self.last_commit_seconds: float | None = None
        self.last_load_seconds: float | None = None

    def step_dir(self, step: int) -> Path:
        return self.directory / f"step-{step:06d}"

    # -- writing ------------------------------------------------------------------------------

    def save(self, step: int, rank: int, world_size: int, state: dict[str, Any]) -> Path:
        """Write this rank's ``state`` for ``step`` atomically; return the file's path.

        Raises ``CheckpointError`` before writing anything if ``state`` holds an object that
        ``torch.load(weights_only=True)`` would refuse: better to fail at save than at resume.
        """
        return self.write(step, rank, world_size, snapshot(state))

    def write(
        self,
        step: int,
        rank: int,
        world_size: int,
        packed: Packed,
        *,
        save_id: str = "",
        durable: bool = True,
    ) -> Path:
        """Write a ``snapshot()`` of this rank's state for ``step``, atomically, with its size
        and crc32 beside it; ``save_id`` names the save every rank's file belongs to, so a
        commit never pairs this file with another run's (see ``missing``). ``durable=False``
        skips the fsyncs: the file is as atomic, but may not survive a crash of the machine
        until a durable ``commit`` of its step fsyncs it."""
        start = time.perf_counter()
        _check_int("step", step, 0)
        _check_int("world_size", world_size, 1)
        if _check_int("rank", rank, 0) >= world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        step_dir = self.step_dir(step)
        spares = self.spares
        if spares is None or step_dir.exists() or not spares.claim_dir(step_dir):
            step_dir.mkdir(parents=True, exist_ok=True)
        # A manifest left by an earlier save of this step (the run resumed from an older
        # checkpoint and came back here) would vouch for files that are about to be replaced.
        (step_dir / MANIFEST).unlink(missing_ok=True)
        target = step_dir / _rank_file(rank)
        written: list[tuple[int, str]] = []
        _atomic_write(
            target, lambda f: written.append(packed.write_to(f)), sync=durable, spares=spares
        )
        size, digest = written[0]
        meta = {"size": size, "crc32": digest, "save_id": save_id, "step": step}
        summary = json.dumps(meta).encode()
        # No fsync of its own: commit copies it into the manifest, which is fsynced; the rank
        # file's rename is made durable by the directory's fsync.
        _atomic_write(
            target.with_name(target.name + ".sum"),
            lambda f: f.write(summary),
            sync=False,
            spares=spares,
        )
        if durable:
            _fsync_dir(step_dir)
        self.last_save_bytes = size
        self.last_save_seconds = time.perf_counter() - start
        return target

    def missing(self, step: int, world_size: int, save_id: str = "") -> list[int]:
        """Ranks whose file of ``step`` for ``save_id`` is not written yet (a file left by
        another run or attempt, with another ``save_id``, counts as missing)."""
        step_dir = self.step_dir(step)
        absent = []
        for rank in range(world_size):
            summary = step_dir / (_rank_file(rank) + ".sum")
            try:
                meta = json.loads(summary.read_bytes())
            except (OSError, ValueError):
                absent.append(rank)
                continue
            if meta.get("save_id", "") != save_id or meta.get("step", step) != step:
                absent.append(rank)
        return absent

    def committed(self, step: int, save_id: str = "") -> bool:
        """Whether ``step``'s manifest is written, by the commit of ``save_id``."""
        try:
            data = json.loads((self.step_dir(step) / MANIFEST).read_bytes())
        except (OSError, ValueError):
            return False
        return isinstance(data, dict) and data.get("save_id", "") == save_id

    def commit(
        self,
        step: int,
        world_size: int,
        *,
        prune: bool = True,
        save_id: str = "",
        durable: bool = True,
    ) -> CheckpointInfo:
        """Mark ``step`` complete by writing its manifest (rank 0, once every rank's file of
        ``save_id`` is written: ``missing()`` is empty), then prune to ``keep`` checkpoints
        unless ``prune=False``.

        ``durable`` (the default) fsyncs every rank's file, the manifest and the directories
        first, so the checkpoint survives a crash of the machine, not only of the processes.
        Without it the checkpoint is as atomic and checksummed, and ``prune`` keeps the newest
        durable checkpoint as well, for a crash that leaves the newer ones torn (their
        checksums then fail and ``latest`` falls back to it)."""
        info = self.try_commit(step, world_size, prune=prune, save_id=save_id, durable=durable)
        if isinstance(info, list):
            raise CheckpointError(
                f"cannot commit step {step}: no complete file from rank(s) "
                f"{', '.join(map(str, info))} of {world_size} in {self.step_dir(step)}; call "
                "commit on rank 0 only after every rank's save has returned (a barrier)"
            )
        return info

    def try_commit(
        self,
        step: int,
        world_size: int,
        *,
        prune: bool = True,
        save_id: str = "",
        durable: bool = True,
        known: dict[int, FileEntry] | None = None,
    ) -> CheckpointInfo | list[int]:
        """``commit``, or the ranks whose file of ``save_id`` is missing (nothing written):
        what a committer polling for its peers' files calls, reading each ``.sum`` once.
        ``known`` carries the files found by earlier calls for the same step, which are not
        read again (and gains those found now)."""
        start = time.perf_counter()
        _check_int("step", step, 0)
        _check_int("world_size", world_size, 1)
        step_dir = self.step_dir(step)
        files = self._written_files(step_dir, step, world_size, save_id, known)
        if isinstance(files, list):
            return files
        # Leftovers from an earlier, larger world or a crashed write would sit next to the
        # checkpoint looking like part of it.
        for extra in step_dir.iterdir():
            m = re.match(r"^rank-(\d+)\.pt(\.sum)?$", extra.name)
            if (m and int(m.group(1)) >= world_size) or extra.name.endswith(_TMP_SUFFIX):
                extra.unlink(missing_ok=True)
        if durable:
            for entry in files.values():
                _fsync_file(step_dir / entry.name)
        created = time.time()
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "created": created,
            "save_id": save_id,
            "durable": durable,
            "files": {str(r): e.as_json() for r, e in files.items()},
        }
        # Compact: the pretty-printing encoder is pure Python, written once per step.
        data = (json.dumps(manifest, separators=(",", ":")) + "\n").encode()
        _atomic_write(step_dir / MANIFEST, lambda f: f.write(data), sync=durable)
        self._durable[step] = durable
        if durable:
            _fsync_dir(step_dir)
            _fsync_dir(self.directory)
        self.last_commit_seconds = time.perf_counter() - start
        if prune:
            self.prune(newest=step)
        return CheckpointInfo(
            step=step,
            world_size=world_size,
            path=step_dir,
            files=files,
            created=created,
            durable=durable,
        )

    def _written_files(
        self,
        step_dir: Path,
        step: int,
        world_size: int,
        save_id: str,
        known: dict[int, FileEntry] | None = None,
    ) -> dict[int, FileEntry] | list[int]:
        """Each rank's file of ``save_id`` as its ``.sum`` describes it, or the ranks missing;
        the ranks in ``known`` are taken from it, and those found are added to it."""
        files: dict[int, FileEntry] = known if known is not None else {}
        missing = []
        for rank in range(world_size):
            if rank in files:
                continue
            path = step_dir / _rank_file(rank)
            try:
                meta = json.loads((step_dir / (path.name + ".sum")).read_bytes())
                actual = path.stat().st_size
            except (OSError, ValueError):
                missing.append(rank)
                continue
            if (
                not isinstance(meta, dict)
                or meta.get("save_id", "") != save_id
                or meta.get("step", step) != step  # a recycled or stray file of another step
            ):
                missing.append(rank)
                continue
            if actual != meta["size"]:
                raise CheckpointError(
                    f"cannot commit step {step_dir.name}: {path} is {actual} bytes but its save "
                    f"wrote {meta['size']}"
                )
            files[rank] = FileEntry(
                name=path.name,
                size=actual,
                crc32=str(meta.get("crc32", "")),
                sha256=str(meta.get("sha256", "")),
            )
        return missing if missing else files

    def prune(self, *, newest: int | None = None) -> list[Path]:
        """Keep the newest ``keep`` complete checkpoints at or below step ``newest`` (default:
        the newest complete one); delete older checkpoints and older incomplete directories.

        Directories above ``newest`` are never touched: they are a save in progress, or a
        damaged checkpoint from before a resume, which the next save of that step replaces.
        Returns the directories removed.
        """
        dirs = self._step_dirs()
        complete = [
            s for s, p in dirs if (p / MANIFEST).exists() and (newest is None or s <= newest)
        ]
        if not complete:  # nothing committed yet: anything here may be a save in progress
            return []
        kept = set(complete[: self.keep])
        by_step = dict(dirs)
        for step in complete:  # newest first: the newest durable one stays too
            durable = self._durable.get(step)
            if durable if durable is not None else _is_durable(by_step[step]):
                kept.add(step)
                break
        oldest_kept = min(kept)
        removed = []
        for step, path in dirs:
            if step < oldest_kept or (step in complete and step not in kept):
                self._durable.pop(step, None)
                if self.spares is not None:
                    self.spares.keep(path, MANIFEST)
                else:
                    shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

    # -- reading ------------------------------------------------------------------------------

    def latest(
        self,
        world_size: int | None = None,
        *,
        allow_world_change: bool = False,
        verify: bool = True,
    ) -> CheckpointInfo | None:
        """The newest complete, intact checkpoint, or ``None`` when there is none.

        A newer directory that is incomplete, truncated or corrupted is skipped with a
        ``CheckpointWarning`` naming it and why. ``verify=False`` checks sizes but not
        checksums (faster for large checkpoints; ``load`` still verifies the file it reads).
        When ``world_size`` differs from the checkpoint's, raises ``CheckpointError`` unless
        ``allow_world_change`` (then seed ranks with ``load(info, rank, source_rank=0)``).
        """
        for step, path in self._step_dirs():
            try:
                info = _read_manifest(path, step)
                _verify(info, checksums=verify)
            except _Invalid as why:
                warnings.warn(
                    f"skipping checkpoint {path}: {why}; falling back to an earlier checkpoint",
                    CheckpointWarning,
                    stacklevel=2,
                )
                continue
            if world_size is not None and world_size != info.world_size and not allow_world_change:
                raise CheckpointError(
                    f"checkpoint {path} was written by {info.world_size} ranks and resuming with "
                    f"{world_size} is not supported for this strategy (per-rank state cannot be "
                    f"re-sharded); resume with {info.world_size} ranks, or, when every rank holds "
                    "identical state (BSP), pass allow_world_change=True and seed every rank "
                    "with load(info, rank, source_rank=0)"
                )
            return info
        return None

    def at(self, step: int) -> CheckpointInfo:
        """The committed checkpoint of ``step`` (manifest read, sizes checked), for ranks that
        were told which step to resume from; ``CheckpointError`` if it is not usable."""
        path = self.step_dir(step)
        try:
            info = _read_manifest(path, step)
            _verify(info, checksums=False)
        except _Invalid as why:
            raise CheckpointError(f"checkpoint {path}: {why}") from None
        return info

    def load(
        self,
        info: CheckpointInfo,
        rank: int,
        *,
        source_rank: int | None = None,
        map_location: str | torch.device | None = "cpu",
    ) -> dict[str, Any]:
        """Read the state ``rank`` saved (or ``source_rank``'s, to seed a rank of a different
        world from one replica) with ``torch.load(weights_only=True)``.

        Raises ``CheckpointError`` when the file no longer matches its manifest, is unreadable,
        or holds objects other than tensors and plain containers: such a file is refused
        without running anything in it.
        """
        start = time.perf_counter()
        src = rank if source_rank is None else source_rank
        if src not in info.files:
            ranks = f"0..{info.world_size - 1}"
            raise CheckpointError(
                f"checkpoint {info.path} holds ranks {ranks}, not rank {src}"
                + (
                    "; to seed a new rank from one replica (BSP only) pass source_rank=0"
                    if source_rank is None
                    else ""
                )
            )
        entry = info.files[src]
        path = info.path / entry.name
        try:
            _check_entry(path, entry, checksums=True)
        except _Invalid as why:
            raise CheckpointError(f"cannot load {path}: {why}") from None
        state = _read_state(path, map_location)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
        self.last_load_seconds = time.perf_counter() - start
        return state

    def _step_dirs(self) -> list[tuple[int, Path]]:
        """(step, directory) pairs, newest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found, reverse=True)


def snapshot(state: dict[str, Any], *, pool: BufferPool | None = None) -> Packed:
    """A copy of ``state`` for ``CheckpointStore.write``, taken now (training may change the
    tensors afterwards), into buffers from ``pool`` if given (see ``Packed.release``).
    ``CheckpointError`` names an entry ``torch.load(weights_only=True)`` would refuse, before
    anything is written."""
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint state must be a dict, got {type(state).__name__}")
    try:
        return pack(state, pool)
    except TypeError as e:
        # The walk that names where the offending object sits runs only on this error path:
        # a snapshot is taken every step, so its own walk is the only one.
        _check_weights_only_safe(state, "state")
        raise CheckpointError(f"cannot checkpoint state: {e}") from None


def _read_state(path: Path, map_location: str | torch.device | None) -> Any:
    """A rank file's state: gradsync's packed format, or (files from before it) a plain state
    through ``safe_load``."""
    if not is_packed_file(path):
        return safe_load(path, map_location=map_location)
    try:
        return unpack(read_packed(path.read_bytes()), map_location)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None


def safe_load(path: str | Path, *, map_location: str | torch.device | None = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``, with refusals and damage as ``CheckpointError``."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refusing to load {path}: it contains objects that are not plain tensors/containers "
            f"(possible code execution); it was not run. torch says: {_torch_reason(e)}"
        ) from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {_torch_reason(e)}") from None


def _torch_reason(e: BaseException) -> str:
    """The informative line of torch's multi-paragraph load error: the one naming what was
    blocked ("unsupported GLOBAL posix.system"). torch's other paragraphs advise loading with
    weights_only=False or allowlisting the global, which is no advice for a file that tried to
    run code, so they are never passed on."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if "unsupported" in ln.lower() or "weightsunpickler error" in ln.lower():
            return ln.split(" Please use", 1)[0]
    safe = [ln for ln in lines if "weights_only" not in ln]
    return safe[0] if safe else type(e).__name__


def _read_manifest(path: Path, step: int) -> CheckpointInfo:
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise _Invalid(f"incomplete: no {MANIFEST} (the save did not finish)")
    try:
        data = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _Invalid(f"{MANIFEST} is unreadable ({e})") from None
    try:
        if data["format"] != FORMAT or data["version"] != FORMAT_VERSION:
            raise _Invalid(
                f"{MANIFEST} is format {data['format']!r} version {data['version']}; this gradsync "
                f"reads {FORMAT!r} version {FORMAT_VERSION}"
            )
        if data["step"] != step:
            raise _Invalid(f"{MANIFEST} says step {data['step']} but the directory is {path.name}")
        world_size = int(data["world_size"])
        files = {
            int(r): FileEntry(
                name=str(e["name"]),
                size=int(e["size"]),
                crc32=str(e.get("crc32", "")),
                sha256=str(e.get("sha256", "")),
            )
            for r, e in data["files"].items()
        }
        if any(not (e.crc32 or e.sha256) for e in files.values()):
            raise _Invalid(f"{MANIFEST} gives a file no checksum (crc32 or sha256)")
        created = float(data.get("created", 0.0))
        durable = bool(data.get("durable", True))  # manifests before the flag were all fsynced
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _Invalid(f"{MANIFEST} is malformed ({type(e).__name__}: {e})") from None
    if sorted(files) != list(range(world_size)):
        raise _Invalid(f"{MANIFEST} lists ranks {sorted(files)} for a world of {world_size}")
    return CheckpointInfo(
        step=step,
        world_size=world_size,
        path=path,
        files=files,
        created=created,
        durable=durable,
    )


def _verify(info: CheckpointInfo, *, checksums: bool) -> None:
    for entry in info.files.values():
        _check_entry(info.path / entry.name, entry, checksums=checksums)


def _check_entry(path: Path, entry: FileEntry, *, checksums: bool) -> None:
    if "/" in entry.name or "\\" in entry.name or entry.name in ("", ".", ".."):
        raise _Invalid(f"{MANIFEST} names a file outside the checkpoint: {entry.name!r}")
    if not path.is_file():
        raise _Invalid(f"{entry.name} is missing")
    size = path.stat().st_size
    if size != entry.size:
        raise _Invalid(
            f"{entry.name} is truncated or damaged: {size} bytes, the manifest says {entry.size}"
        )
    algorithm, expected = ("crc32", entry.crc32) if entry.crc32 else ("sha256", entry.sha256)
    if checksums and _hash_file(path, algorithm)[1] != expected:
        raise _Invalid(f"{entry.name} is corrupted: its {algorithm} does not match the manifest")


def _hash_file(path: Path, algorithm: str = "crc32") -> tuple[int, str]:
    h: Crc32 | Any = Crc32() if algorithm == "crc32" else hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _atomic_write(
    path: Path,
    write: Callable[[IO[bytes]], object],
    *,
    sync: bool = True,
    spares: SpareFiles | None = None,
) -> None:
    """Write through a temporary name in the same directory, fsync (unless ``sync=False``), then
    rename over ``path``: a reader sees the old file or the whole new one, never a part. With
    ``spares``, the temporary file is the file at ``path`` when there is one (a recycled
    directory's), overwritten in place and cut to what was written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}")
    reused = spares is not None and spares.claim(path, tmp)
    try:
        with open(tmp, "r+b" if reused else "wb") as f:
            write(f)
            if reused:
                f.truncate()  # at the position written to: the old file's tail goes
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _is_durable(step_dir: Path) -> bool:
    try:
        data = json.loads((step_dir / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and bool(data.get("durable", True))


def _fsync_file(path: Path) -> None:
    """Make a file written (by any process on this machine) durable: fsync flushes the file's
    pages whoever wrote them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry is; some filesystems (and Windows)
    # cannot fsync a directory, where the rename is still atomic, just not yet durable.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype, torch.device)


def _check_weights_only_safe(obj: object, where: str) -> None:
    """Raise ``CheckpointError`` naming the first object a weights_only load would refuse.

    Exact type checks on purpose: subclasses (a namedtuple, a defaultdict, a tensor subclass)
    pickle as their own class, which the weights_only unpickler does not know.
    """
    kind = type(obj)
    if kind in (torch.Tensor, torch.nn.Parameter) or kind is torch.Size or kind in _LEAVES:
        return
    if kind in (dict, OrderedDict) and isinstance(obj, dict):
        for key, value in obj.items():
            _check_weights_only_safe(key, f"{where} key {key!r}")
            _check_weights_only_safe(value, f"{where}[{key!r}]")
        return
    if kind in (list, tuple, set) and isinstance(obj, (list, tuple, set)):
        for i, value in enumerate(obj):
            _check_weights_only_safe(value, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"cannot checkpoint {where}: a {kind.__module__}.{kind.__qualname__} would be refused by "
        "torch.load(weights_only=True); store tensors, numbers, strings and dicts/lists/tuples "
        "of them (see gradsync.fault.rng_state for RNG states)"
    )
