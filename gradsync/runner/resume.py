"""What ``gradsync run --resume`` (a built-in workload's) holds against the run it continues,
before any worker starts and before the run's config.json is rewritten with this run's flags.

A flag of these not given on the command line is the saved run's already
(``gradsync.runner.cli.RESUMED_FLAGS``): what is held here is a given one. Refused
(``UsageError``, exit 2), each naming the flag, the saved value, the given one and what to
pass instead:

- a flag that shapes what the checkpoints hold (``MUST_MATCH``): ``--workload``, ``--params``
  (for ``mlp``, the one workload it sizes), ``--strategy`` (the whole spec) and
  ``--replica-groups`` (each group's checkpoints are its own), against the saved run's
  config.json; a run of a user's script, resumed as a built-in workload's; then what the
  checkpoints themselves say (``check_resumable``: none usable, another compressor, streaming
  DiLoCo's fragments cut otherwise, other settings of the strategy than the spec the checkpoint
  holds); the strategy specs compared as ``sync.load`` compares them
  (``gradsync.checkpoint.settings``);
- ``--steps`` below the step the run would resume at: it would train nothing and report the
  saved run's steps. ``--steps`` equal to it is let through (with a line saying so): the
  workers train nothing and write the report and the final model, which a run stopped between
  its last checkpoint and its end had not written.

Warned about (one line each): a changed ``--seed``, ``--batch-size`` or ``--data``
(``DATA_FLAGS``): the run goes on, on other data than the saved run's from the resumed step on.
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradsync.attached_run import CONFIG_FILE
from gradsync.checkpoint.settings import same_strategy
from gradsync.errors import UsageError
from gradsync.runner.config import RunConfig
from gradsync.runner.rundir import CHECKPOINT_DIR

#: flags a --resume must be given the saved run's value of: they shape what its checkpoints
#: hold (the model, the strategy's state) or where they are (each replica group's own)
MUST_MATCH = ("workload", "params", "strategy", "replica_groups", "servers")
#: flags a --resume may change, with a warning: the data from the resumed step on then differ
#: from the saved run's
DATA_FLAGS = ("seed", "batch_size", "data")


@dataclass(frozen=True, slots=True)
class Resumed:
    """What a --resume goes on from: the newest usable checkpoint's step (0: none, the run
    starts over), and the saved run's --nproc (None where its config.json does not say)."""

    step: int
    saved_nproc: int | None


def check_resume(cfg: RunConfig, run_dir: Path) -> Resumed:
    """Refuse (``UsageError``) a --resume of the run in ``run_dir`` that the workers would fail,
    or that would quietly make a run other than the saved one; warn on stderr about a change of
    the data. See the module's docstring."""
    from gradsync.checkpoint.checkpointer import check_resumable
    from gradsync.compression import parse_compression

    if cfg.replica_groups:
        from gradsync.runner.replica_groups import check_groups_resumable

        # each group resumes from its own checkpoints (group-K/checkpoints)
        directories = check_groups_resumable(cfg, run_dir)
    else:
        directories = [run_dir / CHECKPOINT_DIR]
    saved = saved_config(run_dir)
    if saved is not None:
        refuse_changes(cfg, saved, run_dir)
    spec = parse_compression(cfg.compression).spec
    for checkpoints in directories:
        check_resumable(checkpoints, spec, cfg.strategy)
    # a group behind the furthest one is healed by the first quorum: the run goes on from there
    step = max((resumed_step(d, cfg.steps) for d in directories), default=0)
    check_steps(cfg, step, run_dir)
    for line in data_changes(cfg, saved or {}):
        print(f"gradsync: warning: {line}", file=sys.stderr)
    nproc = (saved or {}).get("nproc")
    if isinstance(nproc, int) and nproc != cfg.nproc and step > 0:
        _check_resizable(cfg, nproc)
    return Resumed(step, nproc if isinstance(nproc, int) else None)


def check_script_resume(cfg: RunConfig, run_dir: Path, before: int | None) -> int | None:
    """A script's --resume, held against the saved run's config.json before any worker starts
    (its checkpoints are where the script keeps them, so only the flags can be judged): a
    given flag of ``MUST_MATCH`` that differs, or a --nproc the strategy's checkpoints cannot
    resize to, is refused as a built-in workload's is. Returns the saved run's --nproc."""
    saved = saved_config(run_dir)
    if saved is None:
        return before
    refuse_changes(cfg, saved, run_dir)
    nproc = saved.get("nproc")
    if isinstance(nproc, int) and nproc != cfg.nproc:
        _check_resizable(cfg, nproc)
    return nproc if isinstance(nproc, int) else before


def _check_resizable(cfg: RunConfig, saved_nproc: int) -> None:
    """A --nproc other than the saved run's, where the strategy's checkpoint does not resize:
    refused before any worker starts. Found in a worker, the refusal came after this run's
    config.json had replaced the saved one, so a plain --resume after it failed the same way
    (a user tester's, under gossip, diloco and ssp)."""
    from gradsync.strategies.factory import parse_strategy

    strategy = parse_strategy(cfg.strategy, servers=cfg.servers)
    if (strategy.resizable or strategy.reshardable) and not cfg.uses_servers:
        return
    raise UsageError(
        f"--resume with --nproc {cfg.nproc}: the saved run has {saved_nproc} ranks, and a "
        f"{cfg.strategy} checkpoint resumes only on as many (its per-rank state has no meaning "
        f"at another size; bsp, zero:1/2/3 resize). Resume with --nproc {saved_nproc}"
    )


def saved_config(run_dir: Path, warn: bool = True) -> dict[str, Any] | None:
    """The saved run's config.json, as it was before this run (None: there is none, or it is
    not a JSON object, and nothing is compared; a stop at the wrong moment can leave it torn,
    and the checkpoints can still be resumed). ``warn``: say so where it cannot be read (the
    run's flags are read from it quietly first, and compared with it once, here)."""
    path = run_dir / CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if warn and (run_dir / CHECKPOINT_DIR).is_dir():
            # the flags not given then take their defaults (charlm on 4 ranks), whose refusal
            # ("does not fit this model") did not say why
            print(
                f"gradsync: warning: --resume: {run_dir} has checkpoints but no {CONFIG_FILE}: "
                "the flags not given take their defaults, not the saved run's; give them "
                "(--workload, --params, --strategy, --nproc, ...)",
                file=sys.stderr,
            )
        return None
    except (OSError, ValueError) as exc:
        if not warn:
            return None
        print(
            f"gradsync: warning: --resume: {path} cannot be read ({exc}): this run's flags are "
            "not compared with the saved run's",
            file=sys.stderr,
        )
        return None
    return data if isinstance(data, dict) else None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(name: str, value: Any) -> str:
    """``--workload mlp``, as a user passes ``name`` with ``value``."""
    if name == "replica_groups" and not value:
        return "no --replica-groups"
    if name == "data" and value is None:
        return "no --data (the default text)"
    return f"{_flag(name)} {value}"


def _differs(name: str, saved: dict[str, Any], cfg: RunConfig) -> bool:
    """Whether ``cfg`` gives flag ``name`` another value than the saved run's config.json (a
    value it does not hold is not judged)."""
    if name not in saved:
        return False
    given = getattr(cfg, name)
    if name == "strategy":
        # the comparison sync.load makes of the spec a checkpoint was saved under
        return not same_strategy(saved[name], given)
    if name == "params":  # sizes mlp's model only: charlm's is its own
        return cfg.workload == "mlp" and saved.get("workload") == "mlp" and saved[name] != given
    if name == "replica_groups":
        return int(saved[name] or 0) != given
    return bool(saved[name] != given)


def refuse_changes(cfg: RunConfig, saved: dict[str, Any], run_dir: Path) -> None:
    """``UsageError`` when ``cfg`` changes a flag of ``MUST_MATCH``, or resumes a script's run
    as a built-in workload's, naming each flag with both values and what to pass."""
    script = saved.get("script")
    if script and not cfg.script:
        command = " ".join(str(a) for a in script)
        raise UsageError(
            f"--resume: the run in {run_dir} trained a script ({command}; its {CONFIG_FILE}), "
            f"not a built-in workload: its checkpoints hold the script's model. Resume it with "
            f"gradsync run --resume --out {run_dir} -- {command}, or pass a new --out"
        )
    changed = [name for name in MUST_MATCH if _differs(name, saved, cfg)]
    if not changed:
        return
    was = " ".join(_shown(name, saved[name]) for name in changed)
    now = " ".join(_shown(name, getattr(cfg, name)) for name in changed)
    raise UsageError(
        f"--resume: the run in {run_dir} was trained with {was} (its {CONFIG_FILE}), this run "
        f"asks for {now}: its checkpoints hold that run's model and strategy state, not this "
        f"one's. Rerun with {was}, or pass a new --out (or --overwrite to start over in it)"
    )


def data_changes(cfg: RunConfig, saved: dict[str, Any]) -> list[str]:
    """One line per flag of ``DATA_FLAGS`` that ``cfg`` changes: both values, and what the
    change does to the resumed run."""
    lines = []
    for name in DATA_FLAGS:
        if not _differs(name, saved, cfg):
            continue
        also = (
            "; mlp's targets too (its teacher is drawn from the seed)"
            if name == "seed" and cfg.workload == "mlp"
            else ""
        )
        lines.append(
            f"--resume with {_shown(name, getattr(cfg, name))} where the saved run had "
            f"{_shown(name, saved[name])}: the data order from the resumed step on differs "
            f"from the saved run's{also}"
        )
    return lines


def resumed_step(directory: Path, steps: int) -> int:
    """The step of the checkpoint in ``directory`` a resume goes on from (0: none), exact
    where it is above ``steps`` (the newest checkpoint whose sizes are right is taken first,
    without reading every file's checksum again: ``check_resumable`` has just read them)."""
    from gradsync.checkpoint.store import CheckpointStore, CheckpointWarning

    store = CheckpointStore(directory)
    with warnings.catch_warnings():
        # check_resumable has named the checkpoints skipped, and the workers will again
        warnings.simplefilter("ignore", CheckpointWarning)
        newest = store.latest(allow_world_change=True, verify=False)
        if newest is not None and newest.step > steps:
            newest = store.latest(allow_world_change=True)  # a damaged file: an earlier one
    return 0 if newest is None else newest.step


def check_steps(cfg: RunConfig, step: int, run_dir: Path) -> None:
    """Refuse --steps below the resumed ``step``; say so when it is the resumed step."""
    if step > cfg.steps:
        raise UsageError(
            f"--resume --steps {cfg.steps}: the run in {run_dir} goes on from its checkpoint "
            f"of step {step}, past --steps {cfg.steps}: it would train nothing. --steps counts "
            f"the run's steps from its start: pass more than {step} to train on, or a new --out"
        )
    if step and step == cfg.steps:
        print(
            f"gradsync run: --resume: the checkpoint of step {step} is the run's last "
            f"(--steps {cfg.steps}): no step left to train; the workers write the report and "
            "the final model",
            file=sys.stderr,
        )
