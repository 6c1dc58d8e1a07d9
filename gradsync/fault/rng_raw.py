"""Whether Python's or numpy's global generator moved since its state was last read, told from
the bytes that hold its state, read in place.

Why: a checkpoint every step reads both states every step, and most training loops never draw
from either. ``random.getstate()`` builds a tuple of 625 ints, and numpy's
``get_state(legacy=True)`` copies its 624 key words one Python call at a time: together about
70 us of a 630 us snapshot right after a training step (2 ranks of charlm). Reading the
bytes in place and comparing them with the last read's takes a few microseconds, and when they
are equal the state is the one read then.

No API exposes these bytes, so where they lie is found, not assumed (CPython only):
- Python: a ``random.Random`` object holds its 624 state words and the index into them in its
  own memory. ``_probe_python`` sets a known state in a fresh object and looks for the words
  there; ``gauss_next`` is an ordinary attribute, read as such.
- numpy: the legacy ``RandomState`` holds the MT19937 words and position where its bit
  generator's public ``ctypes.state_address`` points, and the cached Gaussian (``has_gauss``,
  ``gauss``) in its own memory: ``_probe_numpy`` sets a known Gaussian in a fresh object and
  looks for it.

The bytes stand for the whole state only because every full read checks them against the
values it returned (``Raw.agrees``): one disagreement and the in-place read is off for good,
and every state is read in full, as before.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["NumpyRaw", "PythonRaw"]

_WORDS = 624  # MT19937's state words, in both generators
_CPYTHON = sys.implementation.name == "cpython"  # id() is the object's address


def _find(haystack: bytes, needle: bytes) -> int | None:
    """The one offset of ``needle`` in ``haystack``; None where it is absent or not unique."""
    at = haystack.find(needle)
    if at < 0 or haystack.find(needle, at + 1) >= 0:
        return None
    return at


def _probe_python() -> int | None:
    """The offset, from a ``random.Random``'s address, of its index then its state words."""
    probe = random.Random()
    probe.seed(20261126)
    _, internal, _ = probe.getstate()
    words = struct.pack(f"{_WORDS}I", *internal[:_WORDS])
    # the object's own bytes: sys.getsizeof would count the collector's header before it too
    size = type(probe).__basicsize__
    at = _find(ctypes.string_at(id(probe), size), words)
    if at is None or at < 4:
        return None
    index = struct.unpack("i", ctypes.string_at(id(probe) + at - 4, 4))[0]
    return at - 4 if index == internal[_WORDS] else None


def _probe_numpy() -> int | None:
    """The offset, from a legacy ``RandomState``'s address, of its ``has_gauss`` (an int, then
    padding, then the ``gauss`` double)."""
    probe = np.random.RandomState(np.random.MT19937(7))
    legacy: Any = probe.get_state(legacy=True)
    name, key, pos, _, _ = legacy
    found = []
    for has_gauss, gauss in ((1, 1.2345678901234567e-300), (0, -9.876543210987654e-299)):
        probe.set_state((name, key, pos, has_gauss, gauss))
        size = type(probe).__basicsize__
        at = _find(ctypes.string_at(id(probe), size), struct.pack("d", gauss))
        if at is None or at < 8:
            return None
        if struct.unpack("i", ctypes.string_at(id(probe) + at - 8, 4))[0] != has_gauss:
            return None
        found.append(at - 8)
    return found[0] if found[0] == found[1] else None


class _Raw:
    """One generator's in-place reader: ``read()`` gives its state's bytes (None where they
    cannot be read), ``agrees`` checks them against a full read's values."""

    def __init__(self) -> None:
        self.offset: int | None = None
        self.probed = False
        self.off = not _CPYTHON

    def _offset(self) -> int | None:
        if not self.probed:
            self.probed = True
            try:
                self.offset = self._probe()
            except Exception:  # noqa: BLE001 - any surprise: read in full, as before
                self.offset = None
        return self.offset

    def _probe(self) -> int | None:
        raise NotImplementedError

    def _read_at(self, offset: int) -> bytes | None:
        raise NotImplementedError

    def read(self) -> bytes | None:
        """The state's bytes now; None where they cannot be read (read in full then)."""
        offset = None if self.off else self._offset()
        return None if offset is None else self._read_at(offset)

    def disagree(self) -> None:
        self.off = True


class PythonRaw(_Raw):
    """``random``'s global generator (the object behind ``random.getstate``)."""

    def _probe(self) -> int | None:
        return _probe_python()

    def __init__(self) -> None:
        super().__init__()
        self._words = _View()

    def _read_at(self, offset: int) -> bytes | None:
        inst = getattr(random.getstate, "__self__", None)
        if type(inst) is not random.Random:
            return None
        return self._words.read(inst, lambda: id(inst) + offset, 4 + 4 * _WORDS)

    @staticmethod
    def agrees(raw: bytes, internal: tuple[int, ...]) -> bool:
        """Whether ``raw`` (read just before ``getstate()``) holds ``internal``'s words."""
        return raw == struct.pack(f"i{_WORDS}I", internal[_WORDS], *internal[:_WORDS])


class NumpyRaw(_Raw):
    """numpy's global legacy ``RandomState`` (the object behind ``np.random.get_state``)."""

    def _probe(self) -> int | None:
        return _probe_numpy()

    def __init__(self) -> None:
        super().__init__()
        self._words, self._gauss = _View(), _View()

    def _read_at(self, offset: int) -> bytes | None:
        # The object ``np.random.get_state`` reads (the full read's), not ``mtrand._rand``
        # by name: either may be replaced.
        state = getattr(np.random.get_state, "__self__", None)
        bitgen = getattr(state, "_bit_generator", None)
        if type(state) is not np.random.RandomState:
            return None
        if type(bitgen) is not np.random.MT19937:
            return None
        # ``ctypes.state_address`` is public; building ``bitgen.ctypes`` costs more than the
        # read it is for, so it is asked once per bit generator.
        words = self._words.read(bitgen, lambda: int(bitgen.ctypes.state_address), 4 * _WORDS + 4)
        return words + self._gauss.read(state, lambda: id(state) + offset, 16)

    @staticmethod
    def agrees(raw: bytes, keys: Any, pos: int, has_gauss: int, gauss: float) -> bool:
        """Whether ``raw`` (read just before ``get_state``) holds these values."""
        expected = np.asarray(keys, dtype=np.uint32).tobytes() + struct.pack("i", pos)
        size = len(expected)
        return (
            raw[:size] == expected
            and raw[size : size + 4] == struct.pack("i", has_gauss)
            and raw[size + 8 : size + 16] == struct.pack("d", gauss)
        )


class _View:
    """Bytes at a fixed place of one object, read through a ctypes array made once for that
    object (a one-slot cache: one global generator at a time). ``ctypes.string_at``, a
    foreign-function call, took about 19 us a read right after a training step (its code out
    of the caches), the array's ``raw`` a fraction of that."""

    def __init__(self) -> None:
        self._owner: Any = None  # held: another object made at its address would read
        self._array: Any = None

    def read(self, owner: Any, address: Callable[[], int], size: int) -> bytes:
        """``size`` bytes at ``address()`` (asked only when ``owner`` is not the last one's)."""
        if self._owner is not owner:
            self._owner, self._array = owner, (ctypes.c_char * size).from_address(address())
        return self._array.raw  # type: ignore[no-any-return]
