"""Finding, verifying and loading checkpoints: ``CheckpointStore`` adds them to the writing,
committing and pruning of ``CheckpointFiles`` (``gradsync.checkpoint.files``, torch-free, which
draws the directory's layout).

Protocol (the store does no collectives; the caller decides when every rank has written)::

    store.save(step, rank, world_size, state)      # every rank
    barrier()                                      # or: poll until not store.missing(...)
    if rank == 0: store.commit(step, world_size)   # writes the manifest, prunes to ``keep``

On resume every rank calls ``latest(world_size)`` (the same answer on a shared filesystem: it
only reads) and ``load(info, rank)``. See docs/checkpoints.md.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from gradsync.checkpoint.files import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    CheckpointFiles,
    CheckpointInfo,
    Crc32,
    FileEntry,
)
from gradsync.checkpoint.packing import (
    BufferPool,
    Packed,
    Share,
    is_encoded,
    is_packed_file,
    pack,
    read_packed,
    unpack,
)

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

_CHUNK = 1 << 20


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (incomplete, truncated, corrupted) in favour of an older one."""


class _Invalid(Exception):
    """Why a checkpoint directory is unusable: becomes a CheckpointWarning, then a fallback."""


class _Skipped:
    """The checkpoints ``latest`` skips, said as warnings: each of the first ``SAID_ALONE``
    with its reason, the rest in one line (a hogwild run's ranks drift apart by over a hundred
    steps, and its resume printed a line for every checkpoint one rank had not written)."""

    SAID_ALONE = 3

    def __init__(self) -> None:
        self.more: list[tuple[Path, str]] = []
        self.said = 0

    def add(self, path: Path, why: str) -> None:
        if self.said < self.SAID_ALONE:
            self.said += 1
            _warn_skipped(f"skipping checkpoint {path}: {why}")
        else:
            self.more.append((path, why))

    def say(self) -> None:
        if not self.more:
            return
        (newest, why), oldest = self.more[0], self.more[-1][0]
        others = len({w for _, w in self.more}) - 1
        reasons = why if not others else f"{why}, and {others} other reason(s)"
        span = newest.name if len(self.more) == 1 else f"{oldest.name} to {newest.name}"
        _warn_skipped(
            f"skipping {len(self.more)} more checkpoint(s) in {newest.parent} ({span}): {reasons}"
        )
        self.more = []


def _warn_skipped(text: str) -> None:
    warnings.warn(f"{text}; falling back to an earlier checkpoint", CheckpointWarning, stacklevel=4)


class CheckpointStore(CheckpointFiles):
    """Checkpoints under ``directory``, keeping the newest ``keep`` complete ones: writing
    (``CheckpointFiles``), and finding and loading them. ``last_save_seconds`` and the like
    time this process's latest call of each (``None`` before the first)."""

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
        """Write a ``snapshot()`` of this rank's state for ``step`` (``write_file``)."""
        return self.write_file(
            step, rank, world_size, packed.write_to, save_id=save_id, durable=durable
        )

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
        skipped = _Skipped()
        for step, path in self._step_dirs():
            try:
                info = _read_manifest(path, step)
                _verify(info, checksums=verify)
            except _Invalid as why:
                skipped.add(path, str(why))
                continue
            skipped.say()
            if world_size is not None and world_size != info.world_size and not allow_world_change:
                raise CheckpointError(
                    f"checkpoint {path} was written by {info.world_size} ranks and resuming with "
                    f"{world_size} is not supported for this strategy (per-rank state cannot be "
                    f"re-sharded); resume with {info.world_size} ranks, or, when every rank holds "
                    "identical state (BSP), pass allow_world_change=True and seed every rank "
                    "with load(info, rank, source_rank=0)"
                )
            return info
        skipped.say()
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
    # RecursionError: json's parser, of a crafted nesting too deep
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
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
    # OverflowError: int() of a size of Infinity (json's parser takes it), float() of a huge int
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise _Invalid(f"{MANIFEST} is malformed ({type(e).__name__}: {e})") from None
    # compared without building range(world_size): a crafted world of 1e10 ranks was a
    # MemoryError (a tester's), where the manifest's own list of files is the bound
    if len(files) != world_size or sorted(files) != list(range(len(files))):
        ranks = sorted(files) if len(files) <= 16 else f"{len(files)} ranks"
        raise _Invalid(f"{MANIFEST} lists ranks {ranks} for a world of {world_size}")
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
    if checksums and _hash_file(path, algorithm) != expected:
        raise _Invalid(f"{entry.name} is corrupted: its {algorithm} does not match the manifest")


def _hash_file(path: Path, algorithm: str) -> str:
    h: Crc32 | Any = Crc32() if algorithm == "crc32" else hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype, torch.device)


def _check_weights_only_safe(obj: object, where: str) -> None:
    """Raise ``CheckpointError`` naming the first object a weights_only load would refuse.

    Exact type checks on purpose: subclasses (a namedtuple, a defaultdict, a tensor subclass)
    pickle as their own class, which the weights_only unpickler does not know.
    """
    kind = type(obj)
    if kind in (torch.Tensor, torch.nn.Parameter) or kind is torch.Size or kind in _LEAVES:
        return
    if isinstance(obj, Share):  # gradsync's wrapper of the model's and optimizer's state
        _check_weights_only_safe(obj.tree, where)
        return
    if is_encoded(obj):  # a constant gradsync encoded itself (it holds plain values)
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
        "of them (see gradsync.checkpoint.rng_state for RNG states)"
    )
