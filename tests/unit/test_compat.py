"""Each private torch API behind ``gradsync.compat``: what it gives, and its fallback."""

from __future__ import annotations

import contextlib
import datetime
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradsync import compat

pytestmark = pytest.mark.unit


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo group in this process (FileStore: no port, no other process)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_without_a_group_every_lookup_answers_none() -> None:
    assert not dist.is_initialized()
    assert compat.default_group() is None
    assert compat.default_store() is None
    assert compat.backends(None) == []
    assert compat.collective_timeout(None) is None
    assert compat.set_collective_timeout(None, 5.0) is False


def test_the_default_group_and_store_are_found(one_rank_group: None) -> None:
    assert compat.default_group() is not None
    store = compat.default_store()
    assert store is not None
    store.set("compat/test", "1")
    assert store.get("compat/test") == b"1"


def test_the_collective_timeout_is_read_and_changed(one_rank_group: None) -> None:
    assert compat.collective_timeout(None) == 30.0
    assert compat.set_collective_timeout(None, 7.0) is True
    assert compat.collective_timeout(None) == 7.0


def test_the_group_timeout_is_ours_inside_gradsync_and_theirs_outside(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradsync.checks.diagnose import GroupTimeout

    held = GroupTimeout(None, 7.0)
    assert held.applied and held.inside and compat.collective_timeout(None) == 7.0
    # Its backends are looked up once, at construction: not at every enter and leave.
    real, looked_up = compat.backends, []
    monkeypatch.setattr(compat, "backends", lambda group: looked_up.append(group) or real(group))
    for _ in range(3):
        held.leave()
        assert not held.inside and real(None)[0].options._timeout.total_seconds() == 30.0
        held.enter()
        assert held.inside and real(None)[0].options._timeout.total_seconds() == 7.0
    assert looked_up == []
    monkeypatch.undo()
    held.restore()
    assert not held.applied and compat.collective_timeout(None) == 30.0
    held.enter()  # restored: the user's timeout stays
    assert compat.collective_timeout(None) == 30.0


def test_a_torch_without_the_private_names_degrades_to_the_fallbacks(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "_c10d", object())
    assert compat.default_group() is None
    assert compat.default_store() is None
    # A group object that hides its backends (no _device_types / _get_backend).
    hidden = object()
    assert compat.backends(hidden) == []  # type: ignore[arg-type]
    assert compat.collective_timeout(hidden) is None  # type: ignore[arg-type]
    assert compat.set_collective_timeout(hidden, 3.0) is False  # type: ignore[arg-type]


def test_marking_the_optimizer_stepped_silences_the_scheduler_warning() -> None:
    def scheduler_warnings(mark: bool) -> list[str]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        if mark:
            compat.mark_optimizer_stepped(opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sched.step()
        return [str(w.message) for w in caught if "optimizer.step()" in str(w.message)]

    assert scheduler_warnings(mark=False)  # the warning exists in this torch
    assert scheduler_warnings(mark=True) == []


def test_whether_the_forkserver_runs_is_read_and_unknown_means_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import multiprocessing.forkserver

    class Server:
        _forkserver_pid: int | None = None

    monkeypatch.setattr(multiprocessing.forkserver, "_forkserver", Server())
    assert compat.forkserver_started() is False
    monkeypatch.setattr(Server, "_forkserver_pid", 4321)
    assert compat.forkserver_started() is True
    monkeypatch.setattr(multiprocessing.forkserver, "_forkserver", object())  # a Python hiding it
    assert compat.forkserver_started() is True


def test_the_exit_handlers_run_through_pythons_call_and_not_where_it_is_hidden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import atexit

    # A stand-in: the real call would run this test process's own handlers (pytest's).
    calls: list[str] = []
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: calls.append("ran"))
    assert compat.run_exit_handlers() is True
    assert calls == ["ran"]
    monkeypatch.delattr(atexit, "_run_exitfuncs")  # a Python hiding it: nothing runs
    assert compat.run_exit_handlers() is False
    assert calls == ["ran"]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "without the fused call"])
def test_the_foreach_operations_act_on_every_tensor_and_on_none(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not fused:  # a torch without them: the loop of public calls
        monkeypatch.delattr(torch, "_foreach_copy_")
        monkeypatch.delattr(torch, "_foreach_div_")
    grads = [torch.full((3,), 6.0), torch.full((2, 2), 3.0, dtype=torch.float64)]
    compat.foreach_div(grads, 3.0)
    assert grads[0].tolist() == [2.0] * 3 and grads[1].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert grads[1].dtype == torch.float64
    copies = [torch.zeros(3), torch.zeros(2, 2, dtype=torch.float64)]
    compat.foreach_copy(copies, grads)
    assert all(torch.equal(c, g) for c, g in zip(copies, grads, strict=True))
    compat.foreach_div([], 3.0)  # an empty list (no gradients here) is nothing to do
    compat.foreach_copy([], [])


def test_annotate_records_a_range_only_while_a_profiler_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with compat.annotate("gradsync.test_range"):
        pass
    assert isinstance(compat.annotate("gradsync.idle"), contextlib.nullcontext)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    # the annotation is entered after the profiler: it sees one recording
    with torch.profiler.profile(activities=cpu) as prof, compat.annotate("gradsync.test_range"):
        torch.ones(2).add_(1)
    assert "gradsync.test_range" in {event.name for event in prof.events()}
    # a torch that hides the check: always annotated
    monkeypatch.delattr(torch.autograd, "_profiler_enabled")
    assert not isinstance(compat.annotate("gradsync.x"), contextlib.nullcontext)


def test_a_found_inf_skips_a_fused_step_and_other_optimizers_read_the_host() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    fused = torch.optim.AdamW([p], lr=0.1, fused=True)
    assert compat.takes_found_inf(fused)
    assert not compat.takes_found_inf(torch.optim.AdamW([p], lr=0.1))  # the fallback: the host
    p.grad = torch.full((3,), float("nan"))
    compat.step_with_found_inf(fused, torch.ones(()))
    assert torch.equal(p.detach(), torch.ones(3))
    assert not hasattr(fused, "found_inf")  # taken away again, as GradScaler does
    p.grad = torch.ones(3)
    compat.step_with_found_inf(fused, torch.zeros(()))
    assert not torch.equal(p.detach(), torch.ones(3))
    assert int(fused.state[p]["step"]) == 1  # the skipped step was not counted


def test_compiler_errors_are_torch_compiles_own_and_everything_where_it_hides_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (error,) = compat.compiler_errors()
    assert issubclass(error, RuntimeError) and not issubclass(MemoryError, error)
    assert error.__module__.startswith("torch._dynamo")
    monkeypatch.setitem(sys.modules, "torch._dynamo.exc", None)  # a torch without the module
    assert compat.compiler_errors() == (Exception,)
