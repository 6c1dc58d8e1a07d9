"""The header of a packed checkpoint file (``gradsync.checkpoint.packing``), made without torch.

Both the training process (``Packed.header``) and the writer's process (``writer_child``) make
it: the JSON text of the state's tree took about 120 us of the training thread per snapshot,
and most snapshots are held and never written, so the writer's process makes it, only for a
snapshot it writes.

Layout: ``MAGIC``, the header's length (8 bytes, little-endian), the header: JSON
``{"version", "byteorder", "tree", "buffers"}``, each buffer's ``numel`` and ``offset`` (from
the end of the header, each a multiple of ``ALIGN``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ALIGN",
    "MAGIC",
    "PACKED_VERSION",
    "dumps",
    "file_start",
    "offsets",
]

MAGIC = b"gradsync-packed-state\n"
PACKED_VERSION = 1
ALIGN = 64  # each buffer starts at a multiple of this in the file


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def offsets(buffers: Sequence[tuple[int, int]]) -> list[int]:
    """Each buffer's offset after the header, from its (elements, bytes per element)."""
    found, at = [], 0
    for numel, itemsize in buffers:
        at = -(-at // ALIGN) * ALIGN
        found.append(at)
        at += numel * itemsize
    return found


def file_start(
    tree: Any, kept: Mapping[int, str], buffers: Sequence[tuple[int, int]]
) -> tuple[bytes, list[int]]:
    """The file's first bytes (magic, header length, header) for ``tree`` with the kept texts
    (``tree_json``) and buffers of (elements, bytes per element); and each buffer's offset.
    What both the training process (``Packed.header``) and the writer's process make."""
    at = offsets(buffers)
    entries = [{"numel": numel, "offset": o} for (numel, _), o in zip(buffers, at, strict=True)]
    text = (
        f'{{"version":{PACKED_VERSION},"byteorder":{dumps(sys.byteorder)},'
        f'"tree":{tree_json(tree, kept)},"buffers":{dumps(entries)}}}'
    ).encode()
    return MAGIC + len(text).to_bytes(8, "little") + text, at


def tree_json(tree: Any, kept: Mapping[int, str]) -> str:
    """``tree`` as JSON, where ``kept`` gives the JSON text of the values of some top-level
    entries (by their index in the root's pairs; such a value in ``tree`` is ignored): the
    model and optimizer state, most of the header, alike from one snapshot to the next and
    encoded once. Only ``Packed.header_parts`` keeps any: its tree's root is then one dict
    node, ``{"d" or "o": [pairs]}``."""
    if not kept:
        return dumps(tree)
    ((tag, pairs),) = tree["root"].items()
    items = [
        dumps(pair) if i not in kept else f"[{dumps(pair[0])},{kept[i]}]"
        for i, pair in enumerate(pairs)
    ]
    index = dumps({k: v for k, v in tree.items() if k != "root"})
    return f'{index[:-1]},"root":{{"{tag}":[{",".join(items)}]}}}}'
