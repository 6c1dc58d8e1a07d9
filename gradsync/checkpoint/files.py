"""The checkpoint directory's files, without torch: write, commit, prune.

::

    DIR/step-000120/rank-0.pt        rank 0's packed state (``gradsync.checkpoint.packing``)
    DIR/step-000120/rank-0.pt.sum    size and crc32 of rank-0.pt, written by rank 0's save
    DIR/step-000120/MANIFEST.json    written last, by rank 0's commit: marks the step complete

``CheckpointFiles`` is the part of ``CheckpointStore`` (``gradsync.checkpoint.store``) that
writes. Why a module of its own: the writer process (``writer_child``) runs it without
importing torch (about 1 s of CPU and 280 MB per process here).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gradsync.checkpoint.writer_locks import others_alive
from gradsync.errors import CheckpointError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointError",
    "CheckpointFiles",
    "CheckpointInfo",
    "Crc32",
    "FileEntry",
    "write_chunks",
    "write_failure",
]

FORMAT = "gradsync-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_SUFFIX = ".tmp"
_RANK_FILE = re.compile(r"^rank-(\d+)\.pt(\.sum)?$")
_TMP_NUMBERS = itertools.count()


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


class CheckpointFiles:
    """The files of checkpoints under ``directory``, keeping the newest ``keep`` complete
    ones: what writing needs (``CheckpointStore`` adds finding and loading checkpoints)."""

    def __init__(self, directory: str | Path, *, keep: int = 2) -> None:
        self.directory = Path(directory)
        self.keep = _check_int("keep", keep, 1)
        #: whether each step this store committed is durable (``prune`` reads no manifest)
        self._durable: dict[int, bool] = {}
        self.last_save_seconds: float | None = None
        self.last_save_bytes: int | None = None
        self.last_commit_seconds: float | None = None
        self.last_load_seconds: float | None = None

    def step_dir(self, step: int) -> Path:
        return self.directory / f"step-{step:06d}"

    def _step_dir_str(self, step: int) -> str:
        return f"{os.fspath(self.directory)}/step-{step:06d}"

    # -- writing ------------------------------------------------------------------------------

    def write_file(
        self,
        step: int,
        rank: int,
        world_size: int,
        write: Callable[[IO[bytes]], tuple[int, str]],
        *,
        save_id: str = "",
        durable: bool = True,
    ) -> Path:
        """Write this rank's file of ``step`` atomically through ``write`` (which writes the
        bytes and returns their size and crc32 hex), with its size and crc32 beside it;
        ``save_id`` names the save every rank's file belongs to, so a commit never pairs this
        file with another run's (see ``missing``). ``durable=False`` skips the fsyncs: the file
        is as atomic, but may not survive a crash of the machine until a durable ``commit`` of
        its step fsyncs it."""
        start = time.perf_counter()
        _check_int("step", step, 0)
        _check_int("world_size", world_size, 1)
        if _check_int("rank", rank, 0) >= world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        # Paths as strings here and in the commit: with a checkpoint every step, pathlib's
        # joins and conversions were about a third of the writer's CPU time.
        step_dir = self._step_dir_str(step)
        os.makedirs(step_dir, exist_ok=True)
        # A manifest left by an earlier save of this step (the run resumed from an older
        # checkpoint and came back here) would vouch for files that are about to be replaced.
        _unlink(f"{step_dir}/{MANIFEST}")
        target = f"{step_dir}/{_rank_file(rank)}"
        written: list[tuple[int, str]] = []
        # Always a new file renamed into place, never one written in place: a hard link a user
        # kept of an older checkpoint's file must go on holding that checkpoint.
        _atomic_write(target, lambda f: written.append(write(f)), sync=durable)
        size, digest = written[0]
        meta = {"size": size, "crc32": digest, "save_id": save_id, "step": step}
        summary = json.dumps(meta).encode()
        # No fsync of its own: commit copies it into the manifest, which is fsynced; the rank
        # file's rename is made durable by the directory's fsync.
        _atomic_write(target + ".sum", lambda f: f.write(summary), sync=False)
        if durable:
            _fsync_dir(step_dir)
        self.last_save_bytes = size
        self.last_save_seconds = time.perf_counter() - start
        return Path(target)

    def missing(self, step: int, world_size: int, save_id: str = "") -> list[int]:
        """Ranks whose file of ``step`` for ``save_id`` is not written yet (a file left by
        another run or attempt, with another ``save_id``, counts as missing)."""
        where = self._step_dir_str(step)
        return [r for r in range(world_size) if _summary(where, r, step, save_id) is None]

    def committed(self, step: int, save_id: str = "") -> bool:
        """Whether ``step``'s manifest is written, by the commit of ``save_id``."""
        data = _manifest(self.step_dir(step))
        return data is not None and data.get("save_id", "") == save_id

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
        unless ``prune=False``. ``durable`` (the default) fsyncs every rank's file, the
        manifest and the directories first, so the checkpoint survives a crash of the machine
        (docs/checkpoints.md, "Durability")."""
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
        where = self._step_dir_str(step)
        files = self._written_files(where, step, world_size, save_id, known)
        if isinstance(files, list):
            return files
        # Leftovers from an earlier, larger world or a crashed write would sit next to the
        # checkpoint looking like part of it.
        for name in os.listdir(where):
            m = _RANK_FILE.match(name)
            if (m and int(m.group(1)) >= world_size) or name.endswith(_TMP_SUFFIX):
                _unlink(f"{where}/{name}")
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
        _atomic_write(f"{where}/{MANIFEST}", lambda f: f.write(data), sync=durable)
        self._durable[step] = durable
        if durable:
            _fsync_dir(step_dir)
            _fsync_dir(self.directory)
        self.last_commit_seconds = time.perf_counter() - start
        if prune:
            self.prune(newest=step, save_id=save_id)
        return CheckpointInfo(
            step=step,
            world_size=world_size,
            path=step_dir,
            files=files,
            created=created,
            durable=durable,
        )

    def commit_newest(
        self, world_size: int, *, newest: int, save_id: str = "", durable: bool = False
    ) -> CheckpointInfo | None:
        """Commit the newest step at or below ``newest`` whose every rank's file of ``save_id``
        is written (read from the directory: a peer whose writer was stopped writes its files
        only as it ends), unless it or a newer one is committed already; ``None`` when there is
        none. What a committer does last, once its peers' writers have ended; ``newest``: the
        newest step it wrote its own file of (a directory above it predates a rollback)."""
        for step, _path in self._step_dirs():
            if step > newest:
                continue
            if self.committed(step, save_id):
                return None
            try:
                info = self.try_commit(step, world_size, save_id=save_id, durable=durable)
            except (CheckpointError, OSError):  # a damaged file: an older step may be whole
                continue
            if not isinstance(info, list):
                return info
        return None

    def _written_files(
        self,
        step_dir: str,
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
            name = _rank_file(rank)
            path = f"{step_dir}/{name}"
            meta = _summary(step_dir, rank, step, save_id)
            try:
                actual = os.stat(path).st_size if meta is not None else -1
            except OSError:
                meta = None
            if meta is None:
                missing.append(rank)
                continue
            if actual != meta["size"]:
                raise CheckpointError(
                    f"cannot commit step {os.path.basename(step_dir)}: {path} is {actual} "
                    f"bytes but its save wrote {meta['size']}"
                )
            files[rank] = FileEntry(
                name=name,
                size=actual,
                crc32=str(meta.get("crc32", "")),
                sha256=str(meta.get("sha256", "")),
            )
        return missing if missing else files

    def prune(self, *, newest: int | None = None, save_id: str = "") -> list[Path]:
        """Keep the newest ``keep`` complete checkpoints at or below step ``newest`` (default:
        the newest complete one); delete older checkpoints and older incomplete directories.

        Directories above ``newest`` are never touched: a save in progress, or a damaged
        checkpoint from before a resume. An incomplete one between the kept checkpoints (from
        stopped writers of an earlier attempt) goes too, unless a writer of another attempt
        than ``save_id`` is alive (``writer_locks``) or it holds anything but rank files: no
        older step is committed later (commits go oldest first; docs/checkpoints.md, "Keep-K").
        Returns the directories removed."""
        dirs = self._step_dirs()
        complete = [
            s
            for s, p in dirs
            if (newest is None or s <= newest) and os.path.exists(f"{os.fspath(p)}/{MANIFEST}")
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
        stale = {
            s
            for s, p in dirs
            if oldest_kept < s < complete[0] and _abandoned_files(p, s) is not None
        }
        if stale and others_alive(self.directory, save_id):
            stale.clear()
        removed = []
        for step, path in dirs:
            if step < oldest_kept or step in stale or (step in complete and step not in kept):
                self._durable.pop(step, None)
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

    def remove_abandoned(self, *, above: int, world_size: int, own_save_id: str) -> list[Path]:
        """Remove the step directories above ``above`` (the step being resumed from) that
        writers of earlier attempts left and no commit can complete; call it only once they
        have all ended (``writer_locks``). Kept: a directory with a manifest, a file of
        ``own_save_id``, every rank's file of one attempt (the newest state), or anything but
        rank files (``_abandoned_files``). Returns the directories removed. Why: every later
        ``latest()`` warned about them again (docs/checkpoints.md, "Keep-K")."""
        removed = []
        for step, path in self._step_dirs():
            if step <= above:
                break
            ranks = _abandoned_files(path, step)
            if ranks is None or own_save_id in ranks:
                continue
            if any(held.issuperset(range(world_size)) for held in ranks.values()):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        return removed

    # -- reading ------------------------------------------------------------------------------

    def _step_dirs(self) -> list[tuple[int, Path]]:
        """(step, directory) pairs, newest first."""
        found = []
        try:
            # scandir: whether an entry is a directory comes with the listing (no stat each)
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    m = _STEP_DIR.match(entry.name)
                    if m and entry.is_dir():
                        found.append((int(m.group(1)), self.directory / entry.name))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(found, reverse=True)


def _abandoned_files(path: Path, step: int) -> dict[str, set[int]] | None:
    """The ranks with a file of ``step`` in ``path``, by the ``save_id`` their ``.sum`` names;
    None where ``path`` must be kept whatever they are: it has a manifest, or an entry that is
    not a rank file, its ``.sum`` or a temporary file of gradsync's writes (``_atomic_write``),
    or a ``.sum`` that cannot be read."""
    ranks: dict[str, set[int]] = {}
    try:
        names = os.listdir(path)
    except OSError:
        return None
    for name in names:
        if name == MANIFEST:
            return None
        found = _RANK_FILE.match(name)
        if (found and not found.group(2)) or (name[:1] == "." and name.endswith(_TMP_SUFFIX)):
            continue
        if found is None:
            return None
        try:
            meta = json.loads((path / name).read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict) or meta.get("step", step) != step:
            return None
        ranks.setdefault(str(meta.get("save_id", "")), set()).add(int(found.group(1)))
    return ranks


def _atomic_write(
    path: str | Path,
    write: Callable[[IO[bytes]], object],
    *,
    sync: bool = True,
) -> None:
    """Write through a temporary name in the same directory, fsync (unless ``sync=False``), then
    rename over ``path``: a reader sees the old file or the whole new one, never a part."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    # Unique among live writers (the process id) and within this one (the counter).
    tmp = os.path.join(head, f".{name}.{os.getpid()}.{next(_TMP_NUMBERS)}{_TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _summary(step_dir: str, rank: int, step: int, save_id: str) -> dict[str, Any] | None:
    """Rank ``rank``'s ``.sum`` in ``step_dir``, where it is of ``step`` and ``save_id`` (a
    file left by another run or attempt, or a stray file of another step, has none)."""
    try:
        with open(f"{step_dir}/{_rank_file(rank)}.sum", "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if type(meta) is not dict or meta.get("save_id", "") != save_id:
        return None
    return meta if meta.get("step", step) == step else None


def _manifest(step_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((step_dir / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None
    return data if type(data) is dict else None


def _is_durable(step_dir: Path) -> bool:
    data = _manifest(step_dir)
    return data is not None and bool(data.get("durable", True))


def _fsync_file(path: Path) -> None:
    """Make a file written (by any process on this machine) durable: fsync flushes the file's
    pages whoever wrote them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str | Path) -> None:
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


class Crc32:
    """CRC-32 with ``hashlib``'s ``update`` / ``hexdigest``: the checksum of checkpoint files,
    2.5x faster than the sha256 they carried before (docs/checkpoints.md, "Checksums"). It
    detects every burst error up to 32 bits and any other corruption but one in 2**32."""

    name = "crc32"

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def write_chunks(
    f: IO[bytes], start: bytes, raws: Iterable[memoryview], offsets: Iterable[int]
) -> tuple[int, str]:
    """Write ``start`` (a packed file's magic and header), then each raw buffer at its offset
    (zeros fill the gaps of the alignment); returns (size, crc32 hex) of what was written."""
    digest = Crc32()
    f.write(start)
    digest.update(start)
    size, at = len(start), 0
    for raw, offset in zip(raws, offsets, strict=True):
        if offset > at:
            gap = bytes(offset - at)
            f.write(gap)
            digest.update(gap)
            size += len(gap)
        f.write(raw)
        digest.update(raw)
        size += len(raw)
        at = offset + len(raw)
    return size, digest.hexdigest()


def write_failure(rank: int, directory: Path, exc: BaseException) -> CheckpointError:
    """What a background writer (thread or process) reports for ``exc``: itself when it is a
    ``CheckpointError`` already, else one naming the rank, the directory and the cause."""
    if isinstance(exc, CheckpointError):
        return exc
    error = CheckpointError(
        f"rank {rank}: writing a checkpoint to {directory} failed: {type(exc).__name__}: {exc}"
    )
    error.__cause__ = exc
    return error
