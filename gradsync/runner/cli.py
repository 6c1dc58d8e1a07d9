"""The ``gradsync`` command: run | compare | checkpoint export | simulate | bench | report."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradsync.errors import UsageError
from gradsync.logs import one_line_warnings
from gradsync.module_cli import closed_pipe
from gradsync.runner.workload_flags import WORKLOAD_ONLY
from gradsync.telemetry.membership import counted

if TYPE_CHECKING:
    from gradsync.runner.resume import Resumed


def _add_run_flags(p: argparse.ArgumentParser, unlisted: frozenset[str] = frozenset()) -> None:
    """Flags of ``run`` and ``compare``: one per field of RunConfig, declared there."""
    from gradsync.flags import add_flags
    from gradsync.runner.config import RunConfig

    add_flags(p, RunConfig, unlisted=unlisted)


def _config_from_args(args: argparse.Namespace) -> Any:
    from gradsync.flags import from_namespace
    from gradsync.runner.config import RunConfig

    for name in HELD_DEFAULTS:  # not given and not taken from a saved run: the default
        value = getattr(args, name, None)
        if isinstance(value, _Default):
            setattr(args, name, value.value)
    return from_namespace(RunConfig, args, script=list(getattr(args, "script", None) or []))


#: run's flags that a --resume without them takes from the saved run's config.json (the run's
#: workload, model size, steps, strategy, compressor, replica groups and ranks, how it
#: checkpoints and restarts: a resume that dropped --checkpoint-every wrote no checkpoint
#: more, and its config.json said 0 to the next resume; and the quorum its groups need and
#: how soon a silent one is left out: a resume that dropped --min-replicas 2 let a group train
#: alone); a given one is held against the saved run's (gradsync.runner.resume): refused
#: where it must match
RESUMED_FLAGS = (
    "workload",
    "params",
    "steps",
    "strategy",
    "compression",
    "replica_groups",
    "nproc",
    "checkpoint_every",
    "keep_checkpoints",
    "max_restarts",
    "min_replicas",
    "heartbeat_timeout",
    "servers",
)


#: run's flags whose default its parser holds as ``_Default``, to tell a value given from it:
#: those a --resume takes from the saved run, --link (given, it needs --hosts), and the
#: built-in workloads' (given, they are refused beside a script)
HELD_DEFAULTS = tuple(dict.fromkeys((*RESUMED_FLAGS, "link", "timeout", *WORKLOAD_ONLY)))


class _Default:
    """A flag of ``HELD_DEFAULTS``'s default as run's parser holds it, told apart from the same
    value given (``--nproc 4``, ``--workload charlm``); its help shows the value."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        return str(self.value)

    def __float__(self) -> float:  # a help text's %(default)g (--timeout's)
        return float(self.value)

    __repr__ = __str__


def _saved_value(name: str, saved: dict[str, Any]) -> Any:
    """The saved run's value of flag ``name`` (a field of RunConfig), or ``_Default`` itself
    where its config.json does not hold one of the field's kind (a script's run records no
    --workload, --params or --steps)."""
    value = saved.get(name, _Default)
    if name == "replica_groups" and value is None:
        return 0
    if name == "compression":
        return value if value is None or isinstance(value, str) else _Default
    if name in ("workload", "strategy"):
        return value if isinstance(value, str) and value else _Default
    if name == "heartbeat_timeout":
        number = type(value) in (int, float) and value > 0
        return float(value) if number else _Default
    # nproc, params, steps, keep_checkpoints, min_replicas; replica_groups, checkpoint_every,
    # max_restarts, where 0 is a setting (none, off)
    least = 0 if name in ("replica_groups", "checkpoint_every", "max_restarts") else 1
    return value if type(value) is int and value >= least else _Default


def _take_saved_flags(args: argparse.Namespace) -> int | None:
    """Under --resume, each flag of ``RESUMED_FLAGS`` not given takes the saved run's value
    (the run continues with its settings); else, or where config.json does not say, its
    default. Returns the saved run's --nproc (None: no resume, or not known)."""
    from gradsync.runner.resume import saved_config

    saved = saved_config(Path(args.out), warn=False) if args.resume and args.out else None
    for name in RESUMED_FLAGS:
        value = getattr(args, name)
        if not isinstance(value, _Default):
            continue  # given: a --nproc that differs is taken, the others are held to match
        taken = _saved_value(name, saved) if saved is not None else _Default
        if name == "params" and args.workload != "mlp":
            taken = _Default  # sizes mlp's model only: another workload's is its own
        setattr(args, name, value.value if taken is _Default else taken)
    nproc = _saved_value("nproc", saved) if saved is not None else None
    return nproc if isinstance(nproc, int) else None


def _check_script_flags_given(args: argparse.Namespace) -> None:
    """Refuse the built-in workloads' flags beside a script even where given at their default
    value: RunConfig can refuse only values other than the defaults, and ``--workload charlm
    -- train.py`` ran the script as if the flag were not there (a tester's finding)."""
    from gradsync.runner.config import workload_flags_refused

    if getattr(args, "script", None):
        given = [n for n in WORKLOAD_ONLY if not isinstance(getattr(args, n, None), _Default)]
        if given:
            raise workload_flags_refused(given)


def _check_link_given(args: argparse.Namespace) -> None:
    """Refuse a given ``--link`` without ``--hosts`` (RunConfig refuses only one other than
    the default: ``--link 1gbit`` on a local run was taken silently, as if it shaped a link)."""
    link = args.link
    if not isinstance(link, _Default) and not args.hosts:
        from gradsync.errors import UsageError

        raise UsageError(f"--link {link} sets the emulated cluster's links: it needs --hosts H")


def cmd_run(args: argparse.Namespace) -> int:
    from gradsync.runner.rundir import claim

    # --resume continues the saved run with its settings where a flag does not say otherwise:
    # its ranks (a given --nproc that differs is taken, and the summary's header names both),
    # its workload, model, steps, strategy, compressor and replica groups
    _check_script_flags_given(args)  # before the saved run's flags replace the held defaults
    explicit = _given_on_the_command_line(args)
    before = _take_saved_flags(args)
    _check_link_given(args)
    cfg = _config_from_args(args)
    run_dir = Path(cfg.out)
    # Held until this process ends: no second run in the same directory meanwhile.
    claimed = claim(run_dir, resume=cfg.resume, overwrite=cfg.overwrite)
    try:
        if cfg.resume and cfg.script:
            _say_if_nothing_to_resume(run_dir)
            from gradsync.runner.resume import check_script_resume

            # the flags held against the saved run, as a built-in workload's are, before
            # config.json is rewritten: a refusal found by the workers left it rewritten
            before = check_script_resume(cfg, run_dir, before)
        if cfg.resume and not cfg.script:  # a script resumes from its own checkpoints
            from gradsync.runner.resume import check_resume

            # before any worker starts, and before config.json is rewritten with this run's
            # flags: a refused --resume leaves the saved run's as it was
            resumed: Resumed = check_resume(cfg, run_dir)
            before = resumed.saved_nproc
        given = sorted({*cfg.changed_fields(), *explicit})
        return _run(cfg, run_dir, given, before)
    finally:
        claimed.release()


def _given_on_the_command_line(args: argparse.Namespace) -> list[str]:
    """The flags of ``HELD_DEFAULTS`` the command line gave, at any value: config.json's
    ``given`` names them, so that a script naming another value is refused even where the
    flag was given at its default (``--strategy bsp`` beside a script that asks for
    ``local:4`` ran ``local:4``: a tester's finding)."""
    return [n for n in HELD_DEFAULTS if not isinstance(getattr(args, n, _Default(None)), _Default)]


def _say_if_nothing_to_resume(run_dir: Path) -> None:
    """--resume of a script's run into a directory that holds none: said, as a built-in
    workload's "starting over (no checkpoint)" is (a tester's finding: it started anew
    silently). The script resumes from its own checkpoints; gradsync cannot see those."""
    from gradsync.runner.rundir import is_gradsync_run

    if not is_gradsync_run(run_dir):
        print(
            f"gradsync run: --resume: {run_dir} holds no run yet (no config.json): this run "
            "starts a new one there",
            file=sys.stderr,
        )


def _placement(backend: str) -> str:
    """``on the GPU (nccl)`` or ``on the CPU (gloo)``: where each worker's model lives."""
    return f"on the {'GPU' if backend == 'nccl' else 'CPU'} ({backend})"


def _run(cfg: Any, run_dir: Path, given: list[str] | None = None, before: int | None = None) -> int:
    """The run of ``cfg`` into ``run_dir``; ``before``: under --resume, the saved run's
    --nproc (None: no resume, or not known)."""
    from gradsync.processes.launch import launch
    from gradsync.runner.worker import run_rank

    given = given or []
    if cfg.replica_groups:
        from gradsync.runner.replica_groups import run_groups

        return run_groups(cfg, run_dir, given)  # a launch per group, each with its restarts
    servers = f" + {counted(cfg.servers, 'server')}" if cfg.uses_servers else ""
    workers = counted(cfg.nproc, "worker")
    # the compressor, where one is set (a script's Synchronizer takes it from --compress)
    compressed = f", compression {cfg.compression}" if cfg.compression else ""
    # Where the model trains is decided per machine (--backend auto): said up front, so a
    # run meant for the GPU that fell back to the CPU is seen before its first step.
    where = "" if cfg.hosts else f", {_placement(cfg.process_backend(cfg.processes))}"
    if cfg.script:
        cfg.save(run_dir, given=given)
        strategy = f"strategy {cfg.strategy}" if "strategy" in given else "its own strategy"
        print(
            f"gradsync run: {' '.join(cfg.script)}, {strategy}{compressed}, {workers}{servers}"
            f"{where} -> {run_dir}",
            file=sys.stderr,
        )
    else:
        cfg.save(run_dir, fp32_bytes_per_step=4 * _trainable_params(cfg), given=given)
        print(
            f"gradsync run: {cfg.workload}, strategy {cfg.strategy}{compressed}, {workers}"
            f"{servers}, {counted(cfg.steps, 'step')}, batch {cfg.batch_size}/worker{where} "
            f"-> {run_dir}",
            file=sys.stderr,
        )
    if cfg.hosts:
        _run_on_cluster(cfg, run_dir)
    else:
        results = launch(
            run_rank,
            (cfg.to_dict(),),
            nproc=cfg.processes,
            threads=cfg.threads,
            max_restarts=cfg.max_restarts,
        )
        if results.get(0) is None:
            raise RuntimeError("rank 0 returned no report")
    _record_bucket_plan(cfg, run_dir)
    print(_summary(cfg, run_dir, before))
    return 0


def _record_bucket_plan(cfg: Any, run_dir: Path) -> None:
    """The gradient buckets the run ended with (the default plan, a given ``--bucket-mb``, or
    the one ``--bucket-mb auto`` kept), into config.json beside the flags (issue 48): the
    report's ``strategy_summary`` has them, where the strategy buckets its exchange."""
    try:
        summary = json.loads((run_dir / "report.json").read_text())["strategy_summary"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no report, or a strategy without buckets
    if not isinstance(summary, dict) or "bucket_sizes_mb" not in summary:
        return
    plan = {
        k: summary[k] for k in ("bucket_mb", "bucket_sizes_mb", "bucket_mb_auto") if k in summary
    }
    cfg.add_facts(run_dir, bucket_plan=plan)


def _summary(cfg: Any, run_dir: Path, before: int | None = None) -> str:
    """The final table, stragglers, trace.json and plots of the finished run. Its header
    names the ranks this attempt ran (``_attempts_header``; ``before``: the saved run's
    --nproc under --resume), followed by a warning line for each --kill that never fired.
    progress.json is rewritten with the run's last step (``_end_progress``)."""
    from gradsync.telemetry.cli import analyze_run
    from gradsync.telemetry.records import METRICS_FILE

    if cfg.script and not (run_dir / METRICS_FILE).exists():
        raise UsageError(
            f"{' '.join(cfg.script)} ran, but wrote no step records into {run_dir}: it made "
            "no gs.Synchronizer, or its Synchronizer took no step (telemetry=False, or "
            "run_dir= naming another directory)"
        )
    analysis = analyze_run(
        run_dir,
        window=cfg.straggler_window,
        threshold=cfg.straggler_threshold,
        plots=cfg.plots,
        warmup=cfg.straggler_warmup,
    )
    text = analysis.format()
    if cfg.resume:
        text = _attempts_header(text, cfg.nproc, before)
    records = analysis.records  # read once (a long run's metrics.jsonl takes seconds)
    _end_progress(cfg, run_dir, records)
    notes = _unfired_kills(cfg, run_dir, records) + _restarted_counts(cfg, run_dir)
    return _with_notes(text, notes)


def _restarted_counts(cfg: Any, run_dir: Path) -> list[str]:
    """A line for each restart whose step count began again at 0 (the script resumed from
    its own checkpoint, or started over, without ``sync.load``): gradsync numbers its steps
    on after the attempts before it (``telemetry.records.latest_attempts``), which need not be
    the script's own iterations."""
    from gradsync.telemetry.records import (
        METRICS_FILE,
        StepRecord,
        read_jsonl,
        restarted_counts,
    )

    try:
        raw = [StepRecord.from_dict(d) for d in read_jsonl(run_dir / METRICS_FILE)]
    except (OSError, ValueError, TypeError):
        return []
    most = f" of {cfg.max_restarts}" if cfg.max_restarts else ""
    return [
        f"restart {attempt}{most}: the script counted its steps from 0 again (it resumed "
        f"without sync.load), so gradsync cannot know its own iterations: steps {moved} on "
        f"are that attempt's steps 0 on; sync.load (sync.register_state for the script's "
        "other state) keeps the step numbers"
        for attempt, moved in sorted(restarted_counts(raw).items())
    ]


def _with_notes(text: str, notes: list[str]) -> str:
    """``text`` with ``notes`` as lines of their own after its header."""
    if not notes:
        return text
    first, newline, rest = text.partition("\n")
    return "\n".join([first, *notes]) + newline + rest


def _unfired_kills(cfg: Any, run_dir: Path, records: list[Any]) -> list[str]:
    """A warning line for each --kill that did not fire: its step was past the rank's last
    (a script's steps are its own, so it could not be refused before the run). A kill that
    fired left its marker in ``faults/`` (``gradsync.inject.maybe_kill``)."""
    from gradsync.attached_run import FAULTS_DIR
    from gradsync.inject import parse_kill

    lines = []
    for kill in parse_kill(cfg.kill):
        if (run_dir / FAULTS_DIR / f"kill-rank{kill.rank}-step{kill.step}.json").exists():
            continue
        steps = [r.step for r in records if r.rank == kill.rank]
        ended = (
            f"rank {kill.rank}'s last step was {max(steps)}"
            if steps
            else f"rank {kill.rank} recorded no step"
        )
        lines.append(
            f"warning: --kill {kill.rank}:{kill.step} did not fire: {ended}, so no fault was "
            "injected and nothing restarted"
        )
    return lines


def _end_progress(cfg: Any, run_dir: Path, records: list[Any]) -> None:
    """progress.json as the run ended: its last step, of as many (a script's number of steps
    is known now), and the mean loss of the newest step with one. Rank 0 rewrites it at each
    gather only, so the steps after the last one (a script that never calls report()) were
    not in it."""
    from gradsync.progress import HEARTBEAT_FILE, Progress

    if not records:
        return
    last = max(r.step for r in records)
    # the newest step with a loss (a script may give one every few steps only)
    scored = max((r.step for r in records if r.loss is not None), default=last)
    losses = [r.loss for r in records if r.step == scored and r.loss is not None]
    total = last + 1 if cfg.script else cfg.steps
    beat = Progress(total, enabled=False, heartbeat=run_dir / HEARTBEAT_FILE)
    beat.update(last + 1, sum(losses) / len(losses) if losses else None, 0.0, 0.0)


#: the summary's header: ``run: DIR (N steps, R ranks)``, R the ranks in the run's records
#: (``1 step``, ``1 rank``: ``telemetry.membership.counted``)
_HEADER = re.compile(r"run: (?P<dir>.*) \((?P<steps>\d+) steps?, (?P<ranks>\d+) ranks?\)")


def _attempts_header(text: str, nproc: int, before: int | None) -> str:
    """``text`` with a header that names this attempt's ranks, ``nproc``, and the saved run's
    (``before``) where a --resume changed their number, fewer or more: the run's records hold
    the saved run's ranks too, which the report's header counts."""
    first, newline, rest = text.partition("\n")
    header = _HEADER.fullmatch(first)
    if header is None:
        return text
    recorded = int(header["ranks"])
    if before is not None and before != nproc:
        was = f"{before} before the resume"
    elif recorded != nproc:
        was = f"{recorded} in the run's records"
    else:
        return text
    steps = counted(int(header["steps"]), "step")
    ranks = counted(nproc, "rank")
    return f"run: {header['dir']} ({steps}, {ranks}; {was}){newline}{rest}"


def _run_on_cluster(cfg: Any, run_dir: Path) -> None:
    """The same workers, started by torch's launcher inside each emulated host's namespace."""
    from gradsync.checks import secret
    from gradsync.cluster import Cluster, launch_on_cluster, requirements_missing

    missing = requirements_missing()
    if missing:
        raise UsageError(f"--hosts needs the emulated cluster: {missing}")
    per_host = cfg.processes // cfg.hosts
    print(
        f"gradsync run: emulated cluster of {counted(cfg.hosts, 'host')}, {cfg.link} links, "
        f"{counted(per_host, 'process', 'processes')} per host",
        file=sys.stderr,
    )
    with Cluster(hosts=cfg.hosts, link=cfg.link) as cluster:
        rc = launch_on_cluster(
            cluster,
            ["gradsync.runner.worker", "--config", str(run_dir / "config.json")],
            nproc_per_host=per_host,
            env={
                "OMP_NUM_THREADS": str(cfg.threads),
                "GRADSYNC_THREADS": str(cfg.threads),
                # one secret for every host's workers (gradsync.checks.secret); the environment,
                # unlike a command line, is not readable by other users
                secret.SECRET_ENV: secret.draw(),
            },
            # a script's steps are its own: its timeout is the run's, once per started hour
            timeout_s=cfg.timeout + 60.0 * (cfg.steps if not cfg.script else 60),
            max_restarts=cfg.max_restarts,
        )
    if rc != 0:
        raise RuntimeError(f"workers on the emulated cluster failed (exit code {rc})")


def cmd_compare(args: argparse.Namespace) -> int:
    from gradsync.runner.compare import (
        format_table,
        parse_strategies,
        refuse_strategy_flag,
        run_comparison,
    )
    from gradsync.strategies.factory import uses_servers

    refuse_strategy_flag(args.strategy)
    strategies = parse_strategies(args.strategies)
    # A placeholder for RunConfig (each run sets its own): one that takes --servers, if any does.
    args.strategy = next((s for s in strategies if uses_servers(s)), strategies[0])
    cfg = _config_from_args(args)
    if args.out is None:
        cfg.out = cfg.out.replace("runs/", "runs/compare-", 1)
    steps = counted(cfg.steps, "step")
    what = " ".join(cfg.script) if cfg.script else f"{cfg.workload}, {steps} each"
    print(
        f"gradsync compare: {', '.join(strategies)} on {what}, "
        f"{counted(cfg.nproc, 'worker')} -> {cfg.out}",
        file=sys.stderr,
    )
    result = run_comparison(cfg, strategies, args.target_loss, show_progress=cfg.progress)
    print(format_table(result))
    return 0


def cmd_checkpoint_export(args: argparse.Namespace) -> int:
    """``gradsync checkpoint export``: a run's (or a checkpoint directory's) checkpoint as a
    file torch opens alone (``gradsync.checkpoint.export``)."""
    from gradsync.checkpoint.export import export_checkpoint
    from gradsync.checkpoint.store import CheckpointError

    one_line_warnings()  # a skipped checkpoint: a gradsync line, not Python's warning format
    given, step = Path(args.directory), args.step
    named = re.fullmatch(r"step-(\d+)", given.name)
    if named is not None and given.is_dir():
        # a step's own directory (what export's messages and the docs name a checkpoint):
        # that step of the checkpoint directory it is in
        if step is not None and step != int(named.group(1)):
            raise UsageError(
                f"checkpoint export: {given} is step {int(named.group(1))}'s checkpoint, and "
                f"--step {step} names another: pass one of them"
            )
        given, step = given.parent, int(named.group(1))
    directory = _checkpoint_dir(given)
    try:
        done = export_checkpoint(directory, args.out, to=args.to, step=step)
    except CheckpointError as exc:
        raise UsageError(f"checkpoint export: {exc}") from None
    how = (
        "torch.load(path, weights_only=True)"
        if done.to == "torch"
        else "torch.distributed.checkpoint.load(state, checkpoint_id=path)"
    )
    print(
        f"gradsync: exported the checkpoint of step {done.step} ({done.strategy}, "
        f"{counted(done.world_size, 'rank')}, {done.checkpoint}) to {done.path}; "
        f"open it with {how}",
        file=sys.stderr,
    )
    return 0


def _checkpoint_dir(path: Path) -> Path:
    """The checkpoint directory ``path`` names: a run directory's ``checkpoints/``, or
    ``path`` itself."""
    from gradsync.runner.rundir import CHECKPOINT_DIR

    if not path.exists():
        raise UsageError(
            f"checkpoint export: {path} does not exist: pass a run directory (gradsync run "
            "--out) or the checkpoint directory itself"
        )
    if not path.is_dir():
        raise UsageError(f"checkpoint export: {path} is not a directory")
    if (path / CHECKPOINT_DIR).is_dir():
        return path / CHECKPOINT_DIR
    groups = sorted(g.name for g in path.glob("group-*") if (g / CHECKPOINT_DIR).is_dir())
    if groups:  # a --replica-groups run: each group saved its own
        raise UsageError(
            f"checkpoint export: {path} is a run of replica groups, each with its own "
            f"checkpoints ({', '.join(groups)}): export one group's, e.g. "
            f"gradsync checkpoint export {path / groups[0]} OUT"
        )
    if (path / "config.json").is_file() and not any(path.glob("step-*")):
        raise UsageError(
            f"checkpoint export: run directory {path} has no {CHECKPOINT_DIR}/: the run took "
            "none (gradsync run --checkpoint-every N writes them)"
        )
    return path


#: ``gradsync.checkpoint.export.TARGETS``, spelled here: importing that module (torch's distributed
#: checkpointing, the writers) would add a second to every command's start
EXPORT_TARGETS = ("torch", "dcp")


def _add_checkpoint_parsers(sub: Any) -> None:
    checkpoint = sub.add_parser("checkpoint", help=COMMANDS["checkpoint"][0])
    actions = checkpoint.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    export = actions.add_parser(
        "export",
        help="write a checkpoint as a file torch opens alone (torch.save or DCP)",
        description="Put the newest complete checkpoint (or --step's) back together as a "
        "single-process script holds it, {model, optimizer, step, extra}: the model's and "
        "the optimizer's state dicts, and write it with torch.save (open with "
        "torch.load(OUT, weights_only=True)) or torch.distributed.checkpoint (DCP, a "
        "directory). Exports bsp, zero:1, zero:2, local:H, diloco:H, gossip:H, noloco:H and "
        "hogwild checkpoints; see docs/checkpoints.md.",
    )
    export.add_argument(
        "directory",
        metavar="RUN_OR_CHECKPOINT_DIR",
        help="a run directory (its checkpoints/) or a checkpoint directory",
    )
    export.add_argument("out", metavar="OUT", help="the file (torch) or directory (dcp) to write")
    export.add_argument(
        "--to",
        choices=EXPORT_TARGETS,
        default=EXPORT_TARGETS[0],
        help="torch: one torch.save file; dcp: a torch.distributed.checkpoint directory "
        "(default %(default)s)",
    )
    export.add_argument(
        "--step",
        type=int,
        default=None,
        help="the checkpoint of this step (default: the newest complete one)",
    )
    export.set_defaults(func=cmd_checkpoint_export)


def _trainable_params(cfg: Any) -> int:
    """Parameter count of the run's model, for the compression ratio against fp32 gradients."""
    from gradsync.workloads import make_workload
    from gradsync.workloads.mlp import parameter_count

    if cfg.workload == "mlp":  # by formula: --params may be far too large to allocate here
        return parameter_count(cfg.params)
    model = make_workload(cfg.workload, seed=cfg.seed, data=cfg.data, params=cfg.params)
    return sum(p.numel() for p in model.build_model().parameters() if p.requires_grad)


def _add_run_parser(sub: Any) -> None:
    run = sub.add_parser(
        "run",
        help=COMMANDS["run"][0],
        usage="gradsync run [flags] [-- SCRIPT.py ARGS... | -- -m MODULE ARGS...]",
        description="Train on local worker processes started by torch's elastic agent: your "
        "own script after --, which gets the run directory, reports, faults and restarts "
        "through its gs.Synchronizer (docs/your-script.md), or a built-in workload "
        "(--workload).",
    )
    _add_run_flags(run)
    from gradsync.runner.config import RunConfig

    # told apart from a given --nproc 4: a --resume without --nproc takes the saved run's
    defaults = RunConfig()
    held = {name: _Default(getattr(defaults, name)) for name in HELD_DEFAULTS}
    run.set_defaults(func=cmd_run, **held)


def _add_compare_parser(sub: Any) -> None:
    compare = sub.add_parser(
        "compare",
        help=COMMANDS["compare"][0],
        usage="gradsync compare [flags] [-- SCRIPT.py ARGS... | -- -m MODULE ARGS...]",
        description="Run each of --strategies on the same training, one after the other, and "
        "compare time to a target loss: a built-in workload, or your own script after -- "
        "(its gs.Synchronizer must leave strategy= out, so that each run chooses it).",
    )
    compare.add_argument(
        "--strategies",
        default="bsp,ssp:2,async,local:8,diloco:32",
        help="comma-separated strategy specs (default %(default)s)",
    )
    compare.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="loss to time each strategy to (default: the worst final loss of the set)",
    )
    # --strategy, --hosts and --link are run's: compare refuses them (saying what to use), so
    # its help does not offer them. None tells cmd_compare that --strategy was not given.
    from gradsync.runner.compare import RUN_ONLY_FIELDS

    _add_run_flags(compare, unlisted=RUN_ONLY_FIELDS)
    compare.set_defaults(func=cmd_compare, strategy=None)


#: Every command: its line in ``gradsync --help`` and the function ("module:name") that adds
#: its parser. Listed here so that ``gradsync --help`` (and a command's own) imports only the
#: module of the command named: run's flags and the cluster's module import torch, seconds
#: before any output. test_cli_startup checks that each module's own help line is the same.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "train your script (run ... -- train.py) or a built-in workload on local processes",
        "gradsync.runner.cli:_add_run_parser",
    ),
    "compare": (
        "run several strategies on the same workload or script (compare ... -- train.py)",
        "gradsync.runner.cli:_add_compare_parser",
    ),
    "checkpoint": ("work with a run's checkpoints", "gradsync.runner.cli:_add_checkpoint_parsers"),
    "simulate": (
        "predict step time, idle and staleness of a strategy at any scale",
        "gradsync.sim.cli:add_parsers",
    ),
    "bench": ("measure collectives on the live backend", "gradsync.sim.cli:add_parsers"),
    "report": (
        "summarize a finished run: per-rank table, stragglers, trace.json, plots",
        "gradsync.telemetry.cli:add_parsers",
    ),
    "cluster": (
        "emulated multi-host cluster: network namespaces + rate-limited links",
        "gradsync.cluster.cli:add_parsers",
    ),
}

#: Commands that take a script after ``--``
SCRIPT_COMMANDS = frozenset({"run", "compare"})

#: Commands that never start torch's launcher: main() neither imports torch nor quiets its logs
#: for them (the simulator and the report are pure Python and numpy).
TORCH_FREE = frozenset({"simulate", "report"})


def version() -> str:
    """The installed distribution's version; gradsync.__version__ where gradsync runs from a
    source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("gradsync")
    except PackageNotFoundError:
        import gradsync

        return str(getattr(gradsync, "__version__", "unknown"))


class _VersionAction(argparse.Action):
    """``--version``, whose version is looked up only when asked for (importlib.metadata
    reads the installed distributions: not worth doing on every start)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print gradsync's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"gradsync {version()}")
        parser.exit()


class _OneCommand:
    """The subparsers action as a module's ``add_parsers`` sees it when only one of the
    commands it adds is wanted: that one is added; the others (already listed as stubs) get a
    parser that is thrown away."""

    def __init__(self, sub: Any, name: str) -> None:
        self._sub, self._name = sub, name

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if name == self._name:
            return self._sub.add_parser(name, **kwargs)
        return argparse.ArgumentParser(prog=name)


def build_parser(full: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``gradsync`` parser. ``full``: the commands whose parsers are built in full (their
    modules imported); the others are stubs with their help line, enough for ``gradsync
    --help`` and for argparse to name the valid commands. None: every command in full."""
    parser = argparse.ArgumentParser(
        prog="gradsync", description="Synchronization for data-parallel PyTorch training."
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    built: set[str] = set()
    for name, (help_line, where) in COMMANDS.items():
        if full is not None and name not in full:
            sub.add_parser(name, help=help_line)
            continue
        if where in built and full is None:
            continue  # its module added this command with the one before it
        try:
            add = _load(where)
        except ImportError as exc:
            if full is None:
                continue  # a part this installation lacks (torch for the cluster): left out
            raise UsageError(f"gradsync {name} cannot start here: {exc}") from None
        add(sub if full is None else _OneCommand(sub, name))
        built.add(where)
    for command_parser in sub.choices.values():
        # so that main() has an unknown flag refused with the command's usage, not gradsync's
        command_parser.set_defaults(**{COMMAND_PARSER: command_parser})
    return parser


#: where a parsed command's namespace holds its own parser (``build_parser``; main drops it)
COMMAND_PARSER = "command_parser"


def _load(where: str) -> Any:
    import importlib

    module, _, attr = where.partition(":")
    return getattr(importlib.import_module(module), attr)


def _command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (gradsync's own options,
    --help and --version, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_of(argv)
    # ``gradsync run [flags] -- SCRIPT ARGS``: what follows ``--`` is the user's command, not
    # gradsync's flags (its own options may look like ours: --lr, --steps)
    script: list[str] | None = None
    if command in SCRIPT_COMMANDS and "--" in argv:
        cut = argv.index("--")
        argv, script = argv[:cut], argv[cut + 1 :]
        if not script:
            print(f"gradsync: error: gradsync {command} ... --: name a script", file=sys.stderr)
            return 2
    try:
        parser = build_parser(full={command} if command in COMMANDS else set())
    except UsageError as exc:
        print(f"gradsync: error: {exc}", file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    command_parser = vars(args).pop(COMMAND_PARSER, parser)
    if unknown:  # told by the command's own parser, with its usage (not gradsync's)
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.script = script
    # The elastic agent logs every worker failure with a full traceback; the CLI says which
    # rank failed and why in one line instead (set GRADSYNC_DEBUG=1 to see the agent's logs).
    # A worker's death the agent recovers from gets one line too (``worker_deaths``). And
    # c10d's own warnings are left out of the workers' output: a rank whose peer died prints
    # the store's failure with a C++ backtrace, which gradsync names in its own words.
    # After parsing: this imports torch, which --help and the torch-free commands never need.
    if not os.environ.get("GRADSYNC_DEBUG") and args.command not in TORCH_FREE:
        from gradsync.processes.worker_deaths import quiet_elastic_logs

        quiet_elastic_logs()
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # here, where a reader gone away is caught, not at exit
        return status
    except UsageError as exc:
        print(f"gradsync: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gradsync: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return closed_pipe()
    except Exception as exc:  # noqa: BLE001 - workers' failures are reported, not re-raised
        if "torch" not in sys.modules:
            raise  # neither a worker's failure nor the agent's signal: torch never ran
        return _worker_failure(exc)


def _worker_failure(exc: Exception) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from gradsync import compat
    from gradsync.processes.worker_deaths import signal_name

    # torch's agent turns a Ctrl-C (or a SIGTERM) into an exception of its own, once it
    # has stopped the workers: an interruption, not a failure with a traceback
    signum = compat.elastic_signal(exc)
    if signum is not None:
        print(
            f"gradsync: interrupted by {signal_name(signum)}: the workers were stopped",
            file=sys.stderr,
        )
        return 128 + signum
    if isinstance(exc, ChildFailedError):
        print(f"gradsync: error: {_describe_child_failure(exc)}", file=sys.stderr)
        return 1
    raise exc


def _describe_child_failure(exc: Any) -> str:
    from gradsync.processes import task_limit
    from gradsync.processes.worker_deaths import describe_exit

    lines = []
    for rank, failure in sorted(exc.failures.items()):
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", json.dumps(message))
        text = [t for t in str(message).strip().splitlines() if t.strip()]
        if text and "To enable traceback" not in text[-1] and "Signal" not in text[-1]:
            why = text[-1]  # the exception @record saved, even if teardown then aborted
        elif failure.exitcode < 0:
            # as the line ``worker_deaths`` printed for the same death just before
            why = describe_exit(failure.exitcode).removeprefix("was ")
        else:
            # a script's sys.exit(N): no exception to name (a tester's run found "the worker
            # output above" empty)
            why = (
                f"it exited with status {failure.exitcode} and no exception (a "
                f"sys.exit({failure.exitcode}) in the script, or an os._exit)"
            )
        lines.append(f"rank {rank} failed (exit code {failure.exitcode}): {why}")
    limit = task_limit.explain_failure(lines)
    if limit is not None:
        lines.append(limit)
    return "worker failure\n  " + "\n  ".join(lines)


if __name__ == "__main__":
    sys.exit(main())
