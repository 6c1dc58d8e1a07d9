"""``gradsync run --replica-groups G``: G replica groups, each a torchft participant (live
membership, docs/membership.md), started, watched and stopped together.

How: the run starts torchft's lighthouse in this process, bound to 127.0.0.1 with a port the
system picks (``membership.lighthouse``; or takes ``--lighthouse``), then one child process per
group, ``python -m gradsync.runner.group --config RUN/group-K/config.json``, an ordinary local
launch of the group's ranks through torch's elastic agent (``gradsync.processes.launch``) with
the group's own ``--max-restarts``. A group whose worker dies is restarted by its own agent;
the replacement's Synchronizer heals from a live peer at its first step; no other group's
process stops. Each group trains in its own run directory, ``RUN/group-K/``, whose config.json
says which group it is (``replica_group``) and holds ``--kill`` and ``--slow`` in the group's
own ranks, and whose ``replica_groups`` makes its Synchronizer take ``membership="torchft"``
(``AttachedRun.live``).

Why a process per group rather than G launches in this one: the elastic agent installs its
signal handlers and the launch sets the environment it hands the workers (``REPLICA_GROUP_ID``
differs per group), both for the whole process. Each group runs in a session of its own, so
that on Ctrl-C or SIGTERM this process stops every group itself (its agent stops the group's
workers) and, past a grace period, kills what is left of the group's process tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradsync.attached_run import CONFIG_FILE, FAULTS_DIR, GROUP_DIR, MANAGER_UP_FILE
from gradsync.errors import UsageError
from gradsync.membership import LIGHTHOUSE_ENV, REPLICA_ID_ENV, torchft_missing
from gradsync.membership.lighthouse import local_lighthouse
from gradsync.runner.config import RunConfig
from gradsync.runner.rundir import RunDirectory, claim, is_gradsync_run
from gradsync.telemetry.membership import FINAL_MODEL_PATH, counted

if TYPE_CHECKING:
    from gradsync.cluster.netns import Host

#: how long a group's agent has to stop its workers after SIGTERM before its tree is killed
STOP_GRACE_S = 20.0


def group_dir(run_dir: Path, group: int) -> Path:
    return run_dir / GROUP_DIR.format(group)


class _Signalled(BaseException):
    """SIGINT or SIGTERM reached this process while the groups ran."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run_groups(cfg: RunConfig, run_dir: Path, given: list[str]) -> int:
    """Run every replica group to its end; print the summary; the exit status: 0 when every
    group succeeded, 128 + N after signal N, else 1."""
    cfg.save(run_dir, given=given)
    if not os.environ.get("GRADSYNC_DEBUG"):
        # torchft's lighthouse and Managers log every quorum at info (a few lines a step, per
        # group): warnings and errors only, as gradsync quiets the elastic agent's logs.
        os.environ.setdefault("RUST_LOG", "warn")
    claims = [_claim_group(run_dir, k, cfg.resume) for k in range(cfg.replica_groups)]
    children: list[subprocess.Popen[bytes]] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signalled: int | None = None
    try:
        for s in previous:
            signal.signal(s, _raise_signalled)
        with _network(cfg) as (address, hosts):
            _announce(cfg, run_dir, address)
            try:
                for k in range(cfg.replica_groups):
                    config = _write_group_config(cfg, run_dir, k, address, given)
                    children.append(_start_group(config, k, address, hosts[k], cfg.link))
                codes = _wait(children)
            finally:
                # before an emulated cluster goes, which would kill them unordered
                _stop(children, signal.SIGTERM)
    except _Signalled as stop:
        signalled = stop.signum
    finally:
        # SIGTERM whatever came here: a worker's Python handler for SIGINT waits for the
        # torchft call it is blocked in (a quorum that now never forms); SIGTERM ends it.
        _stop(children, signal.SIGTERM)
        for s, handler in previous.items():
            signal.signal(s, handler)
        for c in claims:
            c.release()
    if signalled is not None:
        name = signal.Signals(signalled).name
        print(f"gradsync: interrupted by {name}: every replica group was stopped", file=sys.stderr)
        return 128 + signalled
    print(summarize_groups(cfg, run_dir, codes))
    failed = [k for k, code in enumerate(codes) if code != 0]
    if failed:
        print(
            f"gradsync: error: replica group(s) {', '.join(map(str, failed))} failed (exit "
            f"code(s) {', '.join(str(codes[k]) for k in failed)}): see their messages above",
            file=sys.stderr,
        )
        return 1
    return 0


def _raise_signalled(signum: int, frame: Any) -> None:
    raise _Signalled(signum)


def _claim_group(run_dir: Path, group: int, resume: bool = False) -> RunDirectory:
    """The group's directory, locked for this run. The run's own directory was claimed empty
    or with --overwrite: a group directory of an earlier run in it is replaced whole (its
    final_model.pt and report.json too, which a failing group would not write again). With
    --resume it is kept, less its record of the last start's Managers (``wait_for_groups``
    must wait for this start's)."""
    path = group_dir(run_dir, group)
    if resume:
        (path / FAULTS_DIR / MANAGER_UP_FILE).unlink(missing_ok=True)
        # the last start's final model: a group that fails this time must not be compared by it
        (path / FINAL_MODEL_PATH).unlink(missing_ok=True)
        return claim(path, resume=True, overwrite=False)
    if path.is_dir() and is_gradsync_run(path):
        shutil.rmtree(path)
    return claim(path, resume=False, overwrite=True)


def check_groups_resumable(cfg: RunConfig, run_dir: Path) -> list[Path]:
    """Before ``gradsync run --replica-groups G --resume`` starts a group: the run in
    ``run_dir`` must have been one of G replica groups (its config.json, not yet rewritten);
    returns each group's checkpoint directory. Each group resumes from its own newest
    checkpoint; a group with none starts at step 0, and the first quorum heals every group
    behind the furthest one from it. A directory without a run resumes nothing, as a plain
    ``gradsync run --resume`` there starts at step 0."""
    from gradsync.runner.rundir import CHECKPOINT_DIR

    config = run_dir / CONFIG_FILE
    if not config.exists():  # nothing to resume: every group starts at step 0, as a run does
        return [group_dir(run_dir, k) / CHECKPOINT_DIR for k in range(cfg.replica_groups)]
    try:
        before = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"--resume: {config} cannot be read ({exc})") from None
    groups = int(before.get("replica_groups") or 0)
    if groups != cfg.replica_groups:
        was = f"{groups} replica groups" if groups else "no replica groups"
        raise UsageError(
            f"--resume --replica-groups {cfg.replica_groups}: the run in {run_dir} had {was} "
            f"(its {CONFIG_FILE}); resume it with --replica-groups {groups or 0}, or pass "
            "--overwrite to start over"
        )
    return [group_dir(run_dir, k) / CHECKPOINT_DIR for k in range(groups)]


@contextlib.contextmanager
def _network(cfg: RunConfig) -> Iterator[tuple[str, list[Host | None]]]:
    """The lighthouse's address and where each group runs: on this machine (None), or with
    ``--hosts`` group K on the emulated cluster's host K (``runner.groups_on_hosts``)."""
    if not cfg.hosts:
        with _lighthouse(cfg) as address:
            yield address, [None] * cfg.replica_groups
        return
    from gradsync.runner.groups_on_hosts import emulated_hosts

    with emulated_hosts(cfg) as (address, hosts):
        yield address, list(hosts)


@contextlib.contextmanager
def _lighthouse(cfg: RunConfig) -> Iterator[str]:
    """The lighthouse's address: ``--lighthouse``, or one started here on loopback and shut
    down when the groups are done."""
    if cfg.lighthouse is not None:
        yield cfg.lighthouse
        return
    missing = torchft_missing()
    if missing is not None:
        raise UsageError(f"--replica-groups: {missing}")
    with local_lighthouse(cfg.min_replicas, cfg.heartbeat_timeout) as address:
        yield address


def _announce(cfg: RunConfig, run_dir: Path, address: str) -> None:
    what = " ".join(cfg.script) if cfg.script else f"{cfg.workload}, {counted(cfg.steps, 'step')}"
    started = "" if cfg.lighthouse is not None else " (started for this run)"
    print(
        f"gradsync run: {what}, {cfg.replica_groups} replica groups of "
        f"{counted(cfg.nproc, 'worker')}, "
        f"strategy {cfg.strategy}, membership torchft, lighthouse {address}{started}, at least "
        f"{counted(cfg.min_replicas, 'group')} per step -> {run_dir}/group-K",
        file=sys.stderr,
    )


def ranks_of_group(spec: str | None, group: int, per_group: int) -> str | None:
    """The items of a ``--kill`` or ``--slow`` spec (``RANK:...``, comma-separated, ranks of
    the whole run) that name group ``group``'s ranks, renumbered as the group's own."""
    if spec is None:
        return None
    mine = []
    for item in spec.split(","):
        rank, _, rest = item.strip().partition(":")
        if int(rank) // per_group == group:
            mine.append(f"{int(rank) - group * per_group}:{rest}")
    return ",".join(mine) or None


def group_config(cfg: RunConfig, run_dir: Path, group: int, lighthouse: str) -> RunConfig:
    """Group ``group``'s own config: its directory, its ranks' faults, the lighthouse; the
    live progress line is group 0's alone (two would overwrite each other)."""
    return dataclasses.replace(
        cfg,
        out=str(group_dir(run_dir, group)),
        replica_group=group,
        kill=ranks_of_group(cfg.kill, group, cfg.processes),
        slow=ranks_of_group(cfg.slow, group, cfg.nproc),
        lighthouse=lighthouse,
        progress=cfg.progress and group == 0,
        overwrite=False,
    )


def _write_group_config(
    cfg: RunConfig, run_dir: Path, group: int, lighthouse: str, given: list[str]
) -> Path:
    own = group_config(cfg, run_dir, group, lighthouse)
    own.save(Path(own.out), given=given)
    return Path(own.out) / CONFIG_FILE


def _start_group(
    config: Path, group: int, lighthouse: str, host: Host | None = None, link: str = ""
) -> subprocess.Popen[bytes]:
    env = {**os.environ, LIGHTHOUSE_ENV: lighthouse, REPLICA_ID_ENV: str(group)}
    command = [sys.executable, "-m", "gradsync.runner.group", "--config", str(config)]
    if host is not None:
        from gradsync.runner.groups_on_hosts import group_on_host

        command = group_on_host(command, env, host, link)
    return subprocess.Popen(command, env=env, start_new_session=True)


def _wait(children: list[subprocess.Popen[bytes]]) -> list[int]:
    """Every group's exit status, once all have ended (a group that failed for good leaves
    the others training: that is what live membership is for)."""
    while any(c.poll() is None for c in children):
        time.sleep(0.1)
    return [int(c.returncode) for c in children]


def _stop(children: list[subprocess.Popen[bytes]], signum: int) -> None:
    """Each group still running gets ``signum`` (its agent stops its workers with it); a group
    still there after STOP_GRACE_S loses its whole process tree (its session) to SIGKILL."""
    running = [c for c in children if c.poll() is None]
    for c in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.pid, signum)
    deadline = time.monotonic() + STOP_GRACE_S
    for c in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.wait(timeout=max(0.0, deadline - time.monotonic()))
    for k, c in enumerate(children):
        if c.poll() is None:
            name = signal.Signals(signum).name
            print(
                f"gradsync: replica group {k} did not stop within {STOP_GRACE_S:.0f} s of "
                f"{name}: its processes were killed",
                file=sys.stderr,
            )
    for c in children:
        # What the group's agent left behind (or the agent itself): its session, killed whole.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.wait(timeout=10)


def group_outcome(directory: Path) -> dict[str, Any]:
    """What a group's directory says of its run: the last step recorded and its loss, the
    steps before it that some rank has no record of, the restarts of its process and the
    healings of its replacements."""
    from gradsync.telemetry.membership import peer_healings, read_group, step_ranges
    from gradsync.telemetry.records import METRICS_FILE, read_records

    records = read_records(directory) if (directory / METRICS_FILE).exists() else []
    last = max((r.step for r in records), default=None)
    losses = [r.loss for r in records if r.step == last and r.loss is not None]
    seen = read_group(directory)  # its faults/attempts.jsonl and healed.jsonl, lines checked
    # ``steps`` is the step reached, and a group's report.json counts the steps recorded: the
    # steps between, said here, were skipped by a healing or their records lost with a
    # killed process (docs/membership.md, "What a kill loses of the step records")
    held: dict[int, set[int]] = {}
    for r in records:
        held.setdefault(r.rank, set()).add(r.step)
    every = set(range(0 if last is None else last + 1))
    unrecorded = sorted(set().union(*(every - steps for steps in held.values())))
    return {
        "steps": None if last is None else last + 1,
        "unrecorded_at": step_ranges(unrecorded),
        "final_loss": sum(losses) / len(losses) if losses else None,
        "restarts": max((int(a["restart"]) for a in seen.attempts), default=0),
        # the first quorum's sync of replicas that started apart is a healing too: not these
        "healed": peer_healings(seen),
    }


def summarize_groups(cfg: RunConfig, run_dir: Path, codes: list[int]) -> str:
    """The table printed at the end: each group's exit, steps, final loss, restarts and
    healings, a line of the run's membership, and a warning where the groups' final models
    differ; each group's trace.json and plots are written into its directory, and the run's
    report.json (``write_run_report``) into ``run_dir``."""
    from gradsync.telemetry.cli import REPORT_FILE, summarize_run
    from gradsync.telemetry.membership import describe, final_models_warning
    from gradsync.telemetry.records import METRICS_FILE

    lines = [
        f"{'group':>5}  {'exit':>4}  {'steps':>5}  {'final loss':>10}  {'restarts':>8}  healed"
    ]
    outcomes = []
    for k, code in enumerate(codes):
        directory = group_dir(run_dir, k)
        if (directory / METRICS_FILE).exists():
            summarize_run(
                directory,
                window=cfg.straggler_window,
                threshold=cfg.straggler_threshold,
                plots=cfg.plots,
                warmup=cfg.straggler_warmup,
            )
        got = group_outcome(directory)
        outcomes.append({"group": k, "exit": code, **got})
        healed = ", ".join(
            f"at step {h['step']} ({h['bytes'] / 1e6:.2f} MB in {h['seconds']:.2f} s)"
            for h in got["healed"]
        )
        steps = "-" if got["steps"] is None else str(got["steps"])
        loss = "-" if got["final_loss"] is None else f"{got['final_loss']:.4f}"
        lines.append(
            f"{k:>5}  {code:>4}  {steps:>5}  {loss:>10}  {got['restarts']:>8}  {healed or '-'}"
        )
    for got in outcomes:
        if got["unrecorded_at"]:
            lines.append(
                f"group {got['group']}: no step records of step(s) {got['unrecorded_at']} "
                "(skipped by a healing, or lost with a killed process: docs/membership.md)"
            )
    report = write_run_report(cfg, run_dir, outcomes)
    exits = [int(o["exit"]) for o in outcomes]
    lines.append(describe(report["membership"], exits, final_models=report["final_models"]))
    # Exit 0 all the same where every group did: each ran its steps, as --min-replicas lets a
    # group cut off from the others do; the warning and report.json say the models differ.
    warning = final_models_warning(report["final_models"], report["membership"])
    if warning is not None:
        lines.append(warning)
    lines.append(f"each group's metrics, report.json, trace.json and plots: {run_dir}/group-K/")
    lines.append(f"the run's report (groups, membership): {run_dir / REPORT_FILE}")
    trace = write_run_trace(cfg, run_dir)
    if trace is not None:
        lines.append(f"every group on one clock (open at https://ui.perfetto.dev): {trace}")
    return "\n".join(lines)


def write_run_trace(cfg: RunConfig, run_dir: Path) -> Path | None:
    """``RUN/trace.json``: every group's trace.json on one clock, group K's ranks numbered
    from ``K * nproc`` as ``--kill`` names them; None when no group wrote a trace. A group's
    trace that cannot be read is left out with a notice rather than failing the summary."""
    from gradsync.telemetry.cli import TRACE_FILE
    from gradsync.telemetry.trace import merge_traces

    parts = []
    for k in range(cfg.replica_groups):
        path = group_dir(run_dir, k) / TRACE_FILE
        if not path.exists():
            continue
        try:
            trace = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            print(f"gradsync run: {path} left out of the run's trace: {exc}", file=sys.stderr)
            continue
        parts.append((f"group {k}", k * cfg.nproc, trace))
    if not parts:
        return None
    out = run_dir / TRACE_FILE
    out.write_text(json.dumps(merge_traces(parts), separators=(",", ":")), encoding="utf-8")
    return out


def run_membership(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    """The membership section of the run's report.json: every group's membership.jsonl,
    healings and starts (``gradsync.telemetry.membership.summarize``), a step having fewer
    participants than --replica-groups."""
    from gradsync.telemetry.membership import read_group, summarize

    groups = [read_group(group_dir(run_dir, k), str(k)) for k in range(cfg.replica_groups)]
    return summarize(groups, expected=cfg.replica_groups)


def write_run_report(
    cfg: RunConfig, run_dir: Path, outcomes: list[dict[str, Any]]
) -> dict[str, Any]:
    """``RUN/report.json``: each group's outcome (the table's row), the run's membership and
    whether the groups' final models agree (``final_models``: each group's recorded
    fingerprint, ``compare_final_models``); each group's own report.json holds its step
    records' report. Returns what it wrote."""
    from gradsync.telemetry.cli import REPORT_FILE
    from gradsync.telemetry.membership import compare_final_models, read_final_model

    report = {
        "replica_groups": cfg.replica_groups,
        "min_replicas": cfg.min_replicas,
        # the lighthouse gradsync run started; one given with --lighthouse keeps its own
        "heartbeat_timeout_s": None if cfg.lighthouse is not None else cfg.heartbeat_timeout,
        "groups": outcomes,
        "membership": run_membership(cfg, run_dir),
        "final_models": compare_final_models(
            {str(k): read_final_model(group_dir(run_dir, k)) for k in range(cfg.replica_groups)}
        ),
    }
    (run_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report
