"""A checkpoint state as a few flat tensors and a JSON tree: a snapshot cheap to take and write.

``pack(state)`` copies every tensor of a nested state into one flat CPU buffer per dtype and
describes the rest as JSON; ``Packed.write_to`` writes a header and the buffers' raw bytes,
hashing them on the way; ``read_packed`` and ``unpack`` rebuild the state. Why not
``torch.save``: it pickles each tensor through a Python callback and writes each storage as a
zip record, about 15 us per tensor here (4 ms for a small transformer with AdamW), where here
the copy into the buffers is the only work at the step boundary. The file holds no pickle (its
layout: ``packed_header``; docs/checkpoints.md, "On-disk layout"), so a crafted file can build
nothing but tensors, numbers, strings and containers.
"""

from __future__ import annotations

import base64
import json
import operator
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from gradsync import compat
from gradsync.checkpoint import packed_header
from gradsync.checkpoint.files import Crc32, write_chunks

__all__ = [
    "MAGIC",
    "BufferPool",
    "Crc32",
    "Packed",
    "Share",
    "is_encoded",
    "is_packed_file",
    "pack",
    "read_packed",
    "skeleton",
    "unpack",
]

MAGIC = packed_header.MAGIC
#: ``Share`` encodings a ``BufferPool`` keeps: a state may hold a few shares (a model's and an
#: optimizer's), each alike from one snapshot to the next
SHARES_KEPT = 4


@dataclass(frozen=True, slots=True)
class Packed:
    """A snapshot: ``tree`` (JSON-ready, tensors replaced by references) and the buffers."""

    tree: Any
    buffers: list[torch.Tensor]
    #: hands the buffers back to the ``BufferPool`` they came from: call once they are written
    release: Callable[[], None] | None = field(default=None, compare=False)
    #: encodings of ``Share`` subtrees kept by the pool, whose JSON text is reused
    shares: tuple[_EncodedShare, ...] = field(default=(), compare=False)

    def write_to(self, f: IO[bytes]) -> tuple[int, str]:
        """Write the header and the buffers' bytes to ``f``; returns (size, crc32 hex)."""
        start, offsets = self.header()
        return write_chunks(f, start, [raw_bytes(b) for b in self.buffers], offsets)

    def header(self) -> tuple[bytes, list[int]]:
        """The file's first bytes (magic, header length, header: the tree and each buffer's
        dtype, length and offset), and each buffer's offset after them."""
        tree, kept, sizes = self.header_parts()
        texts = {}
        for i, share in kept:
            if share.json is None:
                share.json = _json(share.encoded)
            texts[i] = share.json
        return packed_header.file_start(tree, texts, sizes)

    def header_parts(self) -> tuple[Any, list[tuple[int, _EncodedShare]], list[tuple[int, int]]]:
        """What the header is made of (``packed_header.file_start``): the tree, with each
        top-level value that is a kept ``Share`` encoding (the model and optimizer state,
        most of the header) replaced by None and listed apart with its index, so that its
        text is made once and reused; and each buffer's elements and bytes per element."""
        sizes = [(b.numel(), b.element_size()) for b in self.buffers]
        root = self.tree["root"] if type(self.tree) is dict else None
        if not self.shares or type(root) is not dict or len(root) != 1:
            return self.tree, [], sizes
        ((tag, pairs),) = root.items()
        if tag not in ("d", "o") or type(pairs) is not list:
            return self.tree, [], sizes
        kept, plain = [], []
        # by the encoding's id: each is alive (held by ``shares``), so the same id is it
        by_id = {id(s.encoded): s for s in self.shares}
        for i, pair in enumerate(pairs):
            share = by_id.get(id(pair[1]))
            if share is None:
                plain.append(pair)
            else:
                kept.append((i, share))
                plain.append([pair[0], None])
        return {**self.tree, "root": {tag: plain}}, kept, sizes

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


@dataclass(frozen=True, slots=True)
class Share:
    """A subtree of which this rank packs only the tensors ``owner`` gives to ``rank`` (in
    ``checkpoint.replicas`` order); each other tensor is packed as an empty tensor of its dtype.
    With ``skeleton`` (``skeleton(tree)``, and ``tensors`` in its order), ``pack`` given a
    ``BufferPool`` reuses an earlier snapshot's encoding of a share with the same skeleton,
    owners and rank instead of walking the tree again (the model and optimizer state)."""

    tree: Any
    owner: Sequence[int]
    rank: int
    skeleton: tuple[Any, ...] | None = None
    tensors: Sequence[torch.Tensor] = ()


def skeleton(tree: Any) -> tuple[tuple[Any, ...], list[torch.Tensor]] | None:
    """What ``pack`` encodes of ``tree`` but the tensors' values, flattened (two trees with
    equal skeletons encode alike, types included: ``1``, ``1.0`` and ``True`` differ, and so
    do ``0.0`` and ``-0.0``), and the tensors in ``pack``'s order; None when ``tree`` holds
    something else than tensors, numbers, strings, None, dicts, lists and tuples (or a key
    other than a number, string or None). A lighter walk than the encoding it lets ``pack``
    skip."""
    parts: list[Any] = []
    tensors: list[torch.Tensor] = []
    try:
        _skeleton(tree, parts, tensors)
    except _Unlike:
        return None
    return tuple(parts), tensors


class _Unlike(Exception):
    """A node ``skeleton`` does not describe (``pack`` then walks that share every time)."""


def _skeleton(node: Any, parts: list[Any], tensors: list[torch.Tensor]) -> None:
    # Mirrors ``_encode``'s order (a dict's keys and values in turn). A float is told apart by
    # its ``repr``, which keeps -0.0 and nan apart where == does not. Tensors and plain values
    # inside containers are taken in the container's loop: a call per node was most of the
    # time of this walk, which runs at every snapshot.
    kind = type(node)
    if kind is dict or kind is OrderedDict:
        append = parts.append
        append((kind, len(node)))
        for key, value in node.items():
            key_kind = type(key)
            if key_kind is str or key_kind is int:
                value_kind = type(value)
                if value_kind is torch.Tensor or value_kind is torch.nn.Parameter:
                    # The commonest entry (a state dict's), key and tensor in one part: six
                    # items where any other entry's key part has two, so never mistaken.
                    tensors.append(value)
                    append((key_kind, key, value_kind, value.dtype, value.shape, value.layout))
                    continue
                append((key_kind, key))
            elif key_kind in _SCALAR_SET:
                _skeleton(key, parts, tensors)
            else:
                raise _Unlike
            _skeleton_child(value, parts, tensors)
    elif kind is list or kind is tuple:
        kinds = set(map(type, node))
        if len(kinds) == 1 and (int in kinds or str in kinds):  # alike in type: == is exact
            parts.append((kind, kinds.pop(), tuple(node)))
            return
        parts.append((kind, len(node)))
        for value in node:
            _skeleton_child(value, parts, tensors)
    else:
        _skeleton_child(node, parts, tensors)


def _skeleton_child(node: Any, parts: list[Any], tensors: list[torch.Tensor]) -> None:
    kind = type(node)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        tensors.append(node)
        parts.append((kind, node.dtype, node.shape, node.layout))
    elif kind is str or kind is int or kind is bool or node is None:
        parts.append((kind, node))
    elif kind is float:
        parts.append((kind, repr(node)))
    elif kind is dict or kind is OrderedDict or kind is list or kind is tuple:
        _skeleton(node, parts, tensors)
    else:
        raise _Unlike


class _PoolKey:
    """A group's key in a ``BufferPool`` (its dtype and every tensor's shape), its hash made
    once: the pool asks for it twice a snapshot (take, give), and hashing the shapes of a
    hundred-odd tensors each time cost more than the lookups."""

    __slots__ = ("_hash", "dtype", "shapes")

    def __init__(self, dtype: torch.dtype, shapes: tuple[torch.Size, ...]) -> None:
        self.dtype, self.shapes = dtype, shapes
        self._hash = hash((dtype, shapes))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return type(other) is _PoolKey and self.dtype == other.dtype and self.shapes == other.shapes


class BufferPool:
    """Buffers of earlier snapshots of the same layout, reused (a snapshot every step would
    otherwise allocate, and fault in, a fresh copy of the state each time), with their views
    per tensor so that one fused copy fills them. Thread-safe: a writer thread releases."""

    def __init__(
        self, size: int = 4, allocate: Callable[[torch.dtype, int], torch.Tensor] | None = None
    ) -> None:
        self.size = size
        #: makes a new buffer (dtype, elements): the background writer process's are shared
        #: memory, which that process reads (``gradsync.checkpoint.writer_process``)
        self.allocate = allocate
        self._free: dict[_PoolKey, list[tuple[torch.Tensor, list[torch.Tensor]]]] = {}
        self._lock = threading.Lock()
        self._keys: dict[torch.dtype, _PoolKey] = {}  # the newest key per dtype (``key``)
        #: the newest ``Share`` encodings (``SHARES_KEPT``) by key (skeleton, owners, rank,
        #: where it began)
        self.shares: dict[Any, _EncodedShare] = {}

    def key(self, dtype: torch.dtype, shapes: tuple[torch.Size, ...]) -> _PoolKey:
        """The key of a group of ``dtype`` tensors of ``shapes``: the last one made for that
        dtype while the shapes are equal (compared object by object first: a planned share's
        are the same objects every time), so its hash is not made again."""
        last = self._keys.get(dtype)
        if last is not None and last.shapes == shapes:
            return last
        made = self._keys[dtype] = _PoolKey(dtype, shapes)
        return made

    def take(self, key: _PoolKey) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        with self._lock:
            free = self._free.get(key)
            return free.pop() if free else None

    def give(self, key: _PoolKey, entry: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
        with self._lock:
            free = self._free.setdefault(key, [])
            if len(free) < self.size:
                free.append(entry)


class _Leaves:
    """Tensors met while walking the tree, grouped by dtype (one buffer each)."""

    def __init__(self, memo: dict[Any, _EncodedShare] | None = None) -> None:
        self.by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        self.sizes: dict[torch.dtype, int] = {}
        self.share: tuple[Sequence[int], int] | None = None  # inside a ``Share``: owner, rank
        self.shared = 0  # tensors of the ``Share`` met so far
        self.memo = memo  # a ``BufferPool``'s ``shares``: encodings to reuse and to keep
        self.reused: list[_EncodedShare] = []  # the encodings this walk reused or made
        self.copied: dict[torch.dtype, list[int]] = {}  # inside a ``Share``: see ``add``
        #: per dtype, the shapes of ``by_dtype``'s tensors (the pool's key, ``pack``)
        self.shapes: dict[torch.dtype, list[torch.Size]] = {}
        #: every tensor packed, to check they are all on the CPU (a pool is for those only)
        self.sources: list[torch.Tensor] = []

    def state(self) -> tuple[Any, ...]:
        """Where the walk stands: a reused encoding's offsets hold only from the same state."""
        return tuple((d, len(g), self.sizes.get(d, 0)) for d, g in self.by_dtype.items())

    def add(self, t: torch.Tensor) -> list[Any]:
        if self.share is not None:
            owner, rank = self.share
            i, self.shared = self.shared, self.shared + 1
            if i >= len(owner):
                raise ValueError(f"the shared tree holds more than the {len(owner)} tensors owned")
            # Per dtype, in the order met, the tensors this rank copies: what a reuse replays.
            copied = self.copied.setdefault(t.dtype, [])
            if owner[i] != rank:  # another rank writes it: an empty tensor of its dtype
                self.by_dtype.setdefault(t.dtype, [])
                return [_dtype_name(t.dtype), 0, [0]]
            copied.append(i)
        group = self.by_dtype.setdefault(t.dtype, [])
        offset = self.sizes.get(t.dtype, 0)
        group.append(t)
        shape = t.shape
        self.shapes.setdefault(t.dtype, []).append(shape)
        self.sources.append(t)
        self.sizes[t.dtype] = offset + t.numel()
        return [_dtype_name(t.dtype), offset, list(shape)]


def pack(state: Any, pool: BufferPool | None = None) -> Packed:
    """Copy ``state``'s tensors into per-dtype buffers (on the CPU) and describe the rest as
    JSON, so later changes to the caller's containers do not reach the snapshot. ``TypeError``
    for anything else (``store.snapshot`` then names the entry). With ``pool``, the buffers
    come from (and, through ``Packed.release``, go back to) it."""
    leaves = _Leaves(pool.shares if pool is not None else None)
    tree = _encode(state, leaves)
    order = list(leaves.by_dtype)
    groups = [leaves.by_dtype[dtype] for dtype in order]
    names = {_dtype_name(d): i for i, d in enumerate(order)}
    tree = {"index": names, "root": tree}
    # ``map`` over attribute getters: these loops run over every tensor at every snapshot.
    devices = () if all(map(_IS_CPU, leaves.sources)) else _devices(leaves.sources)
    if pool is None or devices is None:
        buffers = [
            torch.cat([t.detach().reshape(-1).cpu() for t in g]) if g else torch.empty(0, dtype=d)
            for d, g in zip(order, groups, strict=True)
        ]
        return Packed(tree=tree, buffers=buffers)
    # Pooled per dtype: a group whose shapes change every step (the step records not gathered
    # yet) takes a fresh buffer without keeping the model's from being reused.
    keys = [pool.key(d, tuple(leaves.shapes.get(d, ()))) for d in order]
    entries = []
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for key, group in zip(keys, groups, strict=True):
        entry = pool.take(key)
        if entry is None:
            numel = leaves.sizes.get(key.dtype, 0)
            make = pool.allocate
            buf = torch.empty(numel, dtype=key.dtype) if make is None else make(key.dtype, numel)
            if devices:  # a GPU's state: pinned once, so that every copy into it is DMA
                compat.pin_host_memory(buf)
            views = [
                buf[at : at + t.numel()].view(t.shape)
                for at, t in zip(_offsets(group), group, strict=True)
            ]
            entry = (buf, views)
        entries.append(entry)
        dst.extend(entry[1])
        src.extend(group)
    with torch.no_grad():  # a copy of values, never part of a graph (no detach per tensor)
        # From a GPU: every copy queued at once, then one wait for them all (a ``.cpu()`` per
        # tensor waited for each); the snapshot is complete when ``pack`` returns.
        compat.foreach_copy(dst, src, non_blocking=bool(devices))
    for device in devices:
        torch.cuda.current_stream(device).synchronize()

    def release() -> None:
        for key, entry in zip(keys, entries, strict=True):
            pool.give(key, entry)

    return Packed(
        tree=tree,
        buffers=[e[0] for e in entries],
        release=release,
        shares=tuple(leaves.reused),
    )


def _devices(sources: list[torch.Tensor]) -> tuple[torch.device, ...] | None:
    """The CUDA devices of a state whose tensors are on the CPU and CUDA devices only (what
    the pooled copy handles), or None for another device (it is copied by ``.cpu()``)."""
    devices = {t.device for t in sources if not t.is_cpu}
    if any(d.type != "cuda" for d in devices):
        return None
    return tuple(devices)


def _offsets(group: list[torch.Tensor]) -> list[int]:
    offsets, at = [], 0
    for t in group:
        offsets.append(at)
        at += t.numel()
    return offsets


def raw_bytes(buf: torch.Tensor) -> memoryview:
    """A buffer's memory as bytes, whatever its dtype (numpy has no bfloat16: a byte view)."""
    return memoryview(buf.view(torch.uint8).numpy().data) if buf.numel() else memoryview(b"")


_json = packed_header.dumps
_IS_CPU = operator.attrgetter("is_cpu")
_SHAPE = operator.attrgetter("shape")


def is_packed_file(path: Any) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def read_packed(data: bytes | bytearray) -> Packed:
    """A ``Packed`` from a file's bytes (``ValueError`` when they are not a well-formed one);
    the buffers are copies, so ``data`` may go."""
    if not data.startswith(MAGIC):
        raise ValueError("not a gradsync packed state (wrong magic)")
    body = len(MAGIC) + 8
    n = int.from_bytes(data[len(MAGIC) : body], "little")
    n = _whole(n, "the header's length", max(0, len(data) - body))
    header = _parse_header(bytes(data[body : body + n]))
    version = header.get("version") if isinstance(header, dict) else None
    if version != packed_header.PACKED_VERSION:
        raise ValueError(f"packed state version {version!r}; this gradsync reads 1")
    if header.get("byteorder") != sys.byteorder:
        raise ValueError(f"written on a {header.get('byteorder')}-endian machine")
    tree = header["tree"]
    entries = header["buffers"]
    payload = memoryview(data)[body + n :]
    names = _buffer_names(tree["index"], len(entries))
    buffers = [
        _read_buffer(name, entry, payload) for name, entry in zip(names, entries, strict=True)
    ]
    return Packed(tree=tree, buffers=buffers)


def _parse_header(text: bytes) -> Any:
    """The header's JSON, refused with the reason a damaged or crafted file gives."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("its header nests deeper than any state gradsync writes") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"its header is not JSON text ({exc})") from None


def _whole(value: Any, field: str, most: int) -> int:
    """A count or an offset from a file's header, checked: a crafted file can put any JSON
    value there (``Infinity``, ``NaN``, -1, 2.5, 1e300, ``true``), which ``int()`` or a slice
    would turn into an ``OverflowError`` or a silently wrong read rather than a refusal. (The
    header cannot refuse ``Infinity`` and ``NaN`` as it is parsed: the tree holds the state's
    floats, a best loss of ``inf`` among them.)"""
    if type(value) is not int or not 0 <= value <= most:
        raise ValueError(f"{field} is {_json(value)}, not a whole number from 0 to {most}")
    return value


def _buffer_names(index: dict[str, Any], count: int) -> list[str]:
    """The dtype names of the file's ``count`` buffers, in their order (the index gives each
    name its buffer's place)."""
    if type(index) is not dict:
        raise ValueError(f"the index of the buffers is {_json(index)}, not an object")
    places = {
        name: _whole(i, f"the index of buffer {name}", count - 1) for name, i in index.items()
    }
    if sorted(places.values()) != list(range(count)):
        raise ValueError(f"the index {_json(index)} does not name each of {count} buffers once")
    return sorted(places, key=places.__getitem__)


def _read_buffer(name: str, entry: dict[str, Any], payload: memoryview) -> torch.Tensor:
    """Buffer ``name``'s copy, from its ``numel`` and ``offset`` in the header."""
    dtype = _dtype(name)
    size = torch.empty(0, dtype=dtype).element_size()
    numel = _whole(entry["numel"], f"the numel of buffer {name}", len(payload) // size)
    lo = _whole(entry["offset"], f"the offset of buffer {name}", len(payload) - numel * size)
    if not numel:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(payload[lo : lo + numel * size]), dtype=dtype)


def unpack(packed: Packed, device: str | torch.device | None = None) -> Any:
    """The state ``pack`` saw (each tensor its own), its tensors on ``device`` (default: the
    CPU)."""
    if device is not None and torch.device(device).type != "cpu":
        packed = Packed(packed.tree, [b.to(device) for b in packed.buffers])
    tree = packed.tree
    buffers = packed.buffers
    by_name = {name: buffers[int(i)] for name, i in tree["index"].items()}
    for name, buf in by_name.items():
        if not isinstance(buf, torch.Tensor) or buf.dtype != _dtype(name) or buf.dim() != 1:
            raise ValueError(f"packed buffer {name!r} is not a flat {name} tensor")
    return _decode(tree["root"], by_name)


_SCALARS = (str, int, float, bool, type(None))
_SCALAR_SET = frozenset(_SCALARS)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)  # cached: called for every tensor of every snapshot
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _dtype(name: str) -> torch.dtype:
    found = getattr(torch, str(name), None)
    if not isinstance(found, torch.dtype):  # a crafted file naming some other torch attribute
        raise ValueError(f"{name!r} is not a torch dtype")
    return found


def _encode(obj: Any, leaves: _Leaves) -> Any:
    kind = type(obj)
    if kind in _SCALARS:
        return obj
    if kind is Share:
        if leaves.share is not None:
            raise TypeError("a Share inside a Share")
        return _encode_share(obj, leaves)
    if kind is _EncodedShare and obj.at == CONSTANT:  # ``constant``: encoded once
        leaves.reused.append(obj)
        return obj.encoded
    # Exact types, as torch.load(weights_only=True) knows them: a subclass (a defaultdict, a
    # namedtuple, a tensor subclass) would come back as its base class, silently.
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        if obj.layout != torch.strided or obj.is_quantized:
            raise TypeError(f"cannot pack a {obj.layout} tensor")
        return {"x": leaves.add(obj)}
    if kind is dict or kind is OrderedDict:
        pairs = [[_encode(k, leaves), _encode(v, leaves)] for k, v in obj.items()]
        return {"o" if kind is OrderedDict else "d": pairs}
    if kind is list:
        # A list of plain numbers (an RNG state: 625 ints) is copied as it is, not walked.
        if set(map(type, obj)) <= _SCALAR_SET:  # the check at C speed
            return {"l": list(obj)}
        return {"l": [_encode(v, leaves) for v in obj]}
    if kind is tuple:
        return {"t": [_encode(v, leaves) for v in obj]}
    if kind is set:
        return {"s": [_encode(v, leaves) for v in obj]}
    if kind is torch.Size:
        return {"z": list(obj)}
    if kind is torch.dtype:
        return {"y": _dtype_name(obj)}
    if kind is torch.device:
        return {"v": str(obj)}
    if kind in (bytes, bytearray):
        return {"b": base64.b64encode(obj).decode("ascii"), "mutable": kind is bytearray}
    if kind is complex:
        return {"c": [obj.real, obj.imag]}
    raise TypeError(f"cannot pack a {kind.__module__}.{kind.__qualname__}")


@dataclass(slots=True)
class _EncodedShare:
    """A ``Share``'s encoding, kept to be reused by the next snapshot of a like share."""

    encoded: Any
    #: per dtype, in the order first met: the indices (in ``Share.tensors``) of the tensors
    #: this rank copies, and their elements in all
    copied: list[tuple[torch.dtype, list[int], int]]
    #: where the walk stood when the share began (``_Leaves.state``): the offsets in
    #: ``encoded`` hold only from there
    at: tuple[Any, ...] = ()
    #: its JSON text, made by the first ``write_to`` that needs it (then reused)
    json: str | None = None


#: where a ``constant`` was encoded: anywhere (it holds no tensor, so no offset)
CONSTANT = ("constant",)


def is_encoded(obj: object) -> bool:
    """Whether ``obj`` is an encoding ``pack`` made (``constant``), not a caller's value."""
    return type(obj) is _EncodedShare


def constant(tree: Any) -> _EncodedShare:
    """``tree`` (no tensors in it) encoded once, to be put in later states in its place:
    packed as that encoding and kept like a ``Share``'s (``Packed.shares``), so that a writer
    sends its text once rather than with every snapshot. The caller must not change ``tree``'s
    values afterwards, and gives a new ``constant`` for new values."""
    leaves = _Leaves()
    encoded = _encode(tree, leaves)
    if leaves.by_dtype or leaves.reused:
        raise TypeError("a constant holds no tensors and no shares")
    return _EncodedShare(encoded, [], CONSTANT)


def _encode_share(share: Share, leaves: _Leaves) -> Any:
    key = None
    if share.skeleton is not None and leaves.memo is not None:
        key = (share.skeleton, tuple(share.owner), share.rank, leaves.state())
        hit = leaves.memo.get(key)
        if hit is not None:
            return _reuse(hit, share.tensors, leaves)
    at = leaves.state()
    sizes_before = dict(leaves.sizes)
    leaves.share, leaves.shared, leaves.copied = (share.owner, share.rank), 0, {}
    try:
        encoded = _encode(share.tree, leaves)
    finally:
        leaves.share = None
    if leaves.shared != len(share.owner):
        raise ValueError(f"the shared tree holds {leaves.shared} tensors, {len(share.owner)} owned")
    if key is not None and leaves.memo is not None and len(share.tensors) == leaves.shared:
        copied = [
            (d, indices, leaves.sizes.get(d, 0) - sizes_before.get(d, 0))
            for d, indices in leaves.copied.items()
        ]
        made = _EncodedShare(encoded, copied, at)
        leaves.memo[key] = made
        while len(leaves.memo) > SHARES_KEPT:  # the newest layouts (a state may hold several)
            del leaves.memo[next(iter(leaves.memo))]
        leaves.reused.append(made)
    return encoded


def _reuse(kept: _EncodedShare, tensors: Sequence[torch.Tensor], leaves: _Leaves) -> Any:
    """``kept``'s encoding again, with ``tensors`` (its share's, in its order) copied."""
    for dtype, indices, numel in kept.copied:
        copied = [tensors[i] for i in indices]
        leaves.by_dtype.setdefault(dtype, []).extend(copied)
        leaves.sizes[dtype] = leaves.sizes.get(dtype, 0) + numel
        leaves.shapes.setdefault(dtype, []).extend(map(_SHAPE, copied))
        leaves.sources.extend(copied)
    leaves.reused.append(kept)
    return kept.encoded


def _decode(node: Any, buffers: dict[str, torch.Tensor]) -> Any:
    if not isinstance(node, dict):
        return node
    ((tag, value), *rest) = node.items()
    if tag == "x":
        return _tensor(value, buffers)
    if tag in ("d", "o"):
        items = ((_decode(k, buffers), _decode(v, buffers)) for k, v in value)
        return OrderedDict(items) if tag == "o" else dict(items)
    if tag == "l":
        return [_decode(v, buffers) for v in value]
    if tag == "t":
        return tuple(_decode(v, buffers) for v in value)
    if tag == "s":
        return {_decode(v, buffers) for v in value}
    if tag == "z":
        return torch.Size(value)
    if tag == "y":
        return _dtype(value)
    if tag == "v":
        return torch.device(value)
    if tag == "b":
        raw = base64.b64decode(value)
        return bytearray(raw) if rest and rest[0][1] else raw
    if tag == "c":
        return complex(value[0], value[1])
    raise ValueError(f"unknown node {tag!r} in a packed state")


def _tensor(node: Any, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
    """A tensor's node, ``[dtype, offset, shape]``: its elements in its dtype's buffer, checked
    as ``read_packed`` checks the buffers (the numbers come from the file)."""
    dtype, offset, shape = node
    buffer = buffers.get(dtype)
    if buffer is None:
        raise ValueError(
            f"a tensor names the buffer {_json(dtype)}, which the file does not have (it has "
            f"{', '.join(map(repr, buffers)) or 'none'})"
        )
    where = f"a {dtype} tensor's"
    offset = _whole(offset, f"{where} offset", len(buffer))
    if type(shape) is not list:
        raise ValueError(f"{where} shape is {_json(shape)}, not a list")
    n = 1
    for dim in shape:  # a dimension may exceed the buffer where another is 0
        n *= _whole(dim, f"a dimension of {where} shape {_json(shape)}", sys.maxsize)
    if offset + n > len(buffer):
        raise ValueError(
            f"{where} shape {_json(shape)} at offset {offset} runs past the end of its buffer "
            f"({len(buffer)} elements)"
        )
    return buffer[offset : offset + n].view(shape).clone()
