"""``rng_state()`` skips the full reads of Python's and numpy's generators while their state
bytes, read in place, are unchanged (``gradsync.fault.rng_raw``), and equals the full read
every time."""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import pytest

from gradsync.fault import rng, rng_raw

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(sys.implementation.name != "cpython", reason="reads CPython objects"),
]


@pytest.fixture(autouse=True)
def _fresh_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test with readers of its own (one that turns itself off stays off), and the global
    generators as they were."""
    monkeypatch.setattr(rng, "_PYTHON", rng._Unmoved(rng_raw.PythonRaw()))
    monkeypatch.setattr(rng, "_NUMPY", rng._Unmoved(rng_raw.NumpyRaw()))
    python, numpy = random.getstate(), np.random.get_state()
    bitgen = np.random.get_state.__self__._bit_generator  # type: ignore[attr-defined]
    yield
    random.setstate(python)
    if hasattr(np.random, "set_bit_generator"):
        np.random.set_bit_generator(bitgen)  # type: ignore[attr-defined]
    np.random.set_state(numpy)


def _full() -> tuple[Any, ...]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return version, internal, gauss, kind, keys.tolist(), pos, has_gauss, cached


def _taken() -> tuple[Any, ...]:
    state = rng.rng_state()
    py, npy = state["python"], state["numpy"]
    return (
        py["version"], tuple(py["state"].tolist()), py["gauss_next"], npy["kind"],
        npy["keys"].tolist(), npy["pos"], npy["has_gauss"], npy["cached_gaussian"],
    )  # fmt: skip


def _same_words_cached_gaussian() -> None:
    # The same words and position, a cached Gaussian set: only the bytes of the cache differ.
    kind, keys, pos, _, _ = np.random.get_state(legacy=True)  # type: ignore[misc]
    np.random.set_state((kind, keys, pos, 1, 0.5))


MOVES = [
    lambda: random.random(),
    lambda: random.gauss(0, 1),  # leaves gauss_next set
    lambda: random.seed(5),
    lambda: random.setstate(random.getstate()),
    lambda: np.random.rand(),
    lambda: np.random.randn(),  # leaves a cached Gaussian, then uses it
    lambda: np.random.seed(3),
    _same_words_cached_gaussian,
    lambda: None,  # nothing drawn: the in-place read stands
]


def test_the_probes_find_where_the_states_lie() -> None:
    assert rng_raw._probe_python() is not None
    assert rng_raw._probe_numpy() is not None


def test_every_state_taken_is_the_full_read_and_the_fast_path_stays_on() -> None:
    order = random.Random(1)
    for _ in range(400):
        order.choice(MOVES)()
        assert _taken() == _full()
    # Never disagreed with a full read: the bytes stood for the state all along.
    assert not rng._PYTHON.raw.off and not rng._NUMPY.raw.off


def test_an_unmoved_state_is_not_read_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    rng.rng_state()
    # Each full read converts what it read: counted there (``random.getstate`` itself must
    # stay the generator's own method, which the in-place read goes by).
    calls = {"python": 0, "numpy": 0}
    python, numpy = rng._PYTHON_WORDS.python, rng._NUMPY_WORDS.numpy

    def counted_python(internal: Any) -> Any:
        calls["python"] += 1
        return python(internal)

    def counted_numpy(keys: Any) -> Any:
        calls["numpy"] += 1
        return numpy(keys)

    monkeypatch.setattr(rng._PYTHON_WORDS, "python", counted_python)
    monkeypatch.setattr(rng._NUMPY_WORDS, "numpy", counted_numpy)
    rng.rng_state()
    assert calls == {"python": 0, "numpy": 0}
    np.random.rand()
    rng.rng_state()
    assert calls == {"python": 0, "numpy": 1}
    random.random()
    rng.rng_state()
    assert calls == {"python": 1, "numpy": 1}


def test_a_replaced_getstate_is_read_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    # A wrapper in place of the generator's method (a library's, a test's): no in-place read.
    getstate = random.getstate
    monkeypatch.setattr(random, "getstate", lambda: getstate())
    random.gauss(0, 1)
    assert _taken() == _full()
    random.random()
    assert _taken() == _full()


def test_bytes_that_disagree_with_a_full_read_turn_the_fast_path_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As if the probe had found the wrong place: the next full read catches it.
    monkeypatch.setattr(rng_raw.NumpyRaw, "read", lambda self: None if self.off else b"x" * 2516)
    assert _taken() == _full()
    assert rng._NUMPY.raw.off
    np.random.rand()
    assert _taken() == _full()


@pytest.mark.skipif(not hasattr(np.random, "set_bit_generator"), reason="numpy < 1.25")
def test_a_new_global_bit_generator_is_followed() -> None:
    assert _taken() == _full()
    np.random.set_bit_generator(np.random.MT19937(11))  # type: ignore[attr-defined]
    assert _taken() == _full()
    np.random.rand()
    assert _taken() == _full()


def test_the_probes_read_inside_the_objects() -> None:
    # the offsets found, plus what is read there, end within each object's own bytes
    python, numpy = rng_raw._probe_python(), rng_raw._probe_numpy()
    assert python is not None and python + 4 + 4 * 624 <= random.Random.__basicsize__
    assert numpy is not None and numpy + 16 <= np.random.RandomState.__basicsize__


@pytest.mark.parametrize(
    "probe, kind",
    [(rng_raw._probe_python, random.Random), (rng_raw._probe_numpy, np.random.RandomState)],
    ids=["python", "numpy"],
)
def test_the_probes_own_reads_stay_inside_the_object(
    monkeypatch: pytest.MonkeyPatch, probe: Any, kind: type
) -> None:
    # The probe reads the fresh object whole to search it: its own bytes only
    # (``sys.getsizeof`` would add the collector's header, which lies before the object).
    sizes: list[int] = []
    read = rng_raw.ctypes.string_at

    def recorded(address: int, size: int = -1) -> bytes:
        sizes.append(size)
        return read(address, size)

    monkeypatch.setattr(rng_raw.ctypes, "string_at", recorded)
    assert probe() is not None
    assert sizes and max(sizes) == kind.__basicsize__


def test_a_replaced_numpy_generator_is_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _taken() == _full()  # the in-place read now stands for the global generator
    other = np.random.RandomState(5)
    monkeypatch.setattr(np.random, "get_state", other.get_state)
    assert _taken() == _full()
    other.rand()
    assert _taken() == _full()
    # and the module's own object, replaced by name, is not what get_state reads
    monkeypatch.setattr(np.random.mtrand, "_rand", np.random.RandomState(9))
    other.rand()
    assert _taken() == _full()


def test_the_python_generators_version_is_read_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _taken() == _full()
    monkeypatch.setattr(random.getstate.__self__, "VERSION", 2)  # type: ignore[attr-defined]
    assert _taken() == _full()
