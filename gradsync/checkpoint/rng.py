"""Random number generator state as plain values, so it survives ``torch.load(weights_only=True)``.

``random.getstate()`` and ``numpy.random.get_state()`` return tuples holding a numpy array and
nested tuples; a weights_only load refuses numpy arrays, so the states are stored as tensors,
lists and scalars and rebuilt into the library's own shapes on restore.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


class _Words:
    """The newest state words converted to a tensor, and what they were converted from: most
    training loops never draw from Python's or numpy's generator, so with a checkpoint every
    step their state is the same each time, and comparing it is cheaper than converting it
    again (the conversions were most of this function's 145 us per call here)."""

    def __init__(self) -> None:
        self.source: Any = None
        self.tensor: torch.Tensor | None = None

    def python(self, internal: tuple[int, ...]) -> torch.Tensor:
        if self.tensor is None or internal != self.source:
            # through numpy: 4x torch.tensor's speed on a tuple of ints
            self.source, self.tensor = internal, torch.from_numpy(np.array(internal, np.int64))
        return self.tensor

    def numpy(self, keys: np.ndarray) -> torch.Tensor:
        # Compared as bytes: np.array_equal's temporaries and dispatch took 50 us a save right
        # after a training step (cold caches), a bytes comparison a few.
        raw = keys.tobytes()
        if self.tensor is None or raw != self.source:
            # uint32 has no torch equivalent in every version: int64 holds it exactly.
            self.source = raw
            self.tensor = torch.from_numpy(keys.astype(np.int64))
        return self.tensor


_PYTHON_WORDS, _NUMPY_WORDS = _Words(), _Words()


def rng_state() -> dict[str, Any]:
    """The torch CPU, CUDA (when initialized), Python ``random`` and numpy global RNG states.

    The Python and numpy state tensors are shared between calls while those states do not
    change: treat them as read-only (a checkpoint copies them)."""
    version, internal, gauss_next = random.getstate()
    numpy_state: Any = np.random.get_state(legacy=True)
    kind, words, pos, has_gauss, cached = numpy_state
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # A tensor, not a list of 625 ints: a checkpoint every step walks and encodes this
        # state each time, and a list costs a Python object per word there.
        "python": {
            "version": int(version),
            "state": _PYTHON_WORDS.python(internal),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "kind": str(kind),
            "keys": _NUMPY_WORDS.numpy(np.asarray(words)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    # Asking for CUDA state initializes CUDA; a CPU-only (gloo) worker must not pay for that.
    # Initialized implies available; ``is_available`` alone took 9 us a save right after a step.
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (each generator present in ``state``)."""
    unknown = set(state) - {"torch", "python", "numpy", "cuda"}
    if unknown:
        raise ValueError(f"unknown RNG state keys {sorted(unknown)}; expected torch/python/numpy")
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        py = state["python"]
        words = py["state"]  # a tensor; a list in checkpoints written before it was one
        words = words.tolist() if isinstance(words, torch.Tensor) else words
        random.setstate((int(py["version"]), tuple(int(x) for x in words), py["gauss_next"]))
    if "numpy" in state:
        n = state["numpy"]
        keys = torch.as_tensor(n["keys"]).numpy().astype(np.uint32)
        np.random.set_state(
            (n["kind"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"]))
        )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
