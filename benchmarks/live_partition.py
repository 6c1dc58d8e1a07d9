"""A link partition under live membership on the emulated cluster (issue 45): what happens to a
replica group cut off from the others for a few seconds, and after the link heals.

``python -m benchmarks.live_partition [--down-s 4] [--at 40] [--steps 300]`` (root): runs
``gradsync run --replica-groups 2 --hosts 2 --min-replicas 1`` (mlp, one rank per group,
``--timeout 30``); once group 1 has recorded step ``--at``, host 1's port on the emulated switch
is set down (the partition machinery of ``benchmarks/cluster.py``'s part 3, ``_set_link``) for
``--down-s`` seconds and then up again. Prints what each group's run directory recorded: the
run's exit status, each group's starts (restarts), healings, the steps group 0 took alone, the
steps group 1 did not commit, and whether both ended bitwise equal. docs/membership.md
("The emulated cluster") says what it showed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.cluster import _set_link
from gradsync.cluster import Cluster, cleanup_stale, requirements_missing
from gradsync.cluster.netns import DEFAULT_PREFIX


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _last_step(directory: Path) -> int:
    lines = _jsonl(directory / "membership.jsonl")
    return max((int(m["step"]) for m in lines), default=-1)


def _ranges(steps: list[int]) -> list[str]:
    """[3, 4, 5, 9] -> ["3-5", "9"]."""
    out: list[list[int]] = []
    for s in sorted(steps):
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return [f"{a}-{b}" if a != b else str(a) for a, b in out]


def _cluster_of(log: Path, deadline: float) -> Cluster:
    """The cluster ``gradsync run`` named on stderr, by its names only (it is the run's)."""
    while time.monotonic() < deadline:
        found = re.search(r"emulated cluster (\S+) of", log.read_text())
        if found:
            return Cluster(hosts=2, name=found[1].removeprefix(DEFAULT_PREFIX))
        time.sleep(0.1)
    raise RuntimeError(f"gradsync run named no cluster: {log.read_text()[-2000:]}")


def _partition(args: argparse.Namespace, out: Path, log: Path) -> dict[str, Any]:
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gradsync", "run", "--hosts", "2", "--replica-groups", "2"]
            + ["--nproc", "1", "--min-replicas", "1", "--workload", "mlp", "--params", "5000"]
            + ["--steps", str(args.steps), "--timeout", str(args.timeout)]
            + ["--max-restarts", "1"]
            + ["--no-plots", "--no-progress", "--out", str(out)],
            stdout=err,
            stderr=err,
            start_new_session=True,
        )
    cluster = None
    res: dict[str, Any] = {}
    try:
        cluster = _cluster_of(log, time.monotonic() + 120)
        while _last_step(out / "group-1") < args.at and proc.poll() is None:
            time.sleep(0.05)
        res["group0_step_at_cut"] = _last_step(out / "group-0")
        _set_link(cluster, 1, up=False)
        res["cut_at"] = time.time()
        time.sleep(args.down_s)
        _set_link(cluster, 1, up=True)
        res["healed_at"] = time.time()
        res["group0_step_at_heal"] = _last_step(out / "group-0")
        res["exit"] = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if cluster is not None:
            cleanup_stale(DEFAULT_PREFIX, cluster.tag)
    return res


def _read(out: Path, res: dict[str, Any]) -> dict[str, Any]:
    import torch

    for k in (0, 1):
        d = out / f"group-{k}"
        lines = _jsonl(d / "membership.jsonl")
        res[f"group{k}"] = {
            "starts": [a["restart"] for a in _jsonl(d / "faults" / "attempts.jsonl")],
            "healed": [(h["step"], h["restart"]) for h in _jsonl(d / "faults" / "healed.jsonl")],
            "alone": _ranges([m["step"] for m in lines if m["participants"] < 2]),
            "not_committed": [m["step"] for m in lines if not m["committed"]],
            "longest_quorum_s": max((m["quorum_s"] for m in lines), default=None),
            "last_step": max((m["step"] for m in lines), default=None),
            # the lines from 2 s before the cut to 2 s after the link came back that are not
            # a plain step (a slow quorum, not committed, a process's first, members changed):
            # step, restart, seconds from the cut when the step's quorum was asked for,
            # participants, committed, quorum_s
            "around_the_cut": [
                (
                    m["step"],
                    m["restart"],
                    round(m["time"] - res["cut_at"], 2),
                    m["participants"],
                    m["committed"],
                    round(m["quorum_s"], 2),
                )
                for m in lines
                if res["cut_at"] - 2 < m["time"] < res["healed_at"] + 2
                and (m["quorum_s"] > 0.1 or not m["committed"] or "members" in m)
            ][:20],  # fmt: skip
        }
    finals = [out / f"group-{k}" / "final_model.pt" for k in (0, 1)]
    if all(f.exists() for f in finals):
        a, b = (torch.load(f, weights_only=True) for f in finals)
        res["bitwise_equal"] = a.keys() == b.keys() and all(torch.equal(a[x], b[x]) for x in a)
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.live_partition")
    parser.add_argument("--down-s", type=float, default=4.0)
    parser.add_argument("--at", type=int, default=40, help="group 1's step to cut the link at")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--timeout", type=float, default=30.0, help="gradsync run --timeout")
    args = parser.parse_args(argv)
    missing = requirements_missing()
    if missing:
        print(f"emulated cluster unavailable: {missing}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gs-partition-") as tmp:
        out, log = Path(tmp) / "run", Path(tmp) / "run.log"
        res = _partition(args, out, log)
        res = _read(out, res)
        with contextlib.suppress(OSError):
            said = ("error", "failed", "exited", "healed", "killed", "membership:")
            res["messages"] = [
                line[:300] for line in log.read_text().splitlines() if any(w in line for w in said)
            ]
    print(json.dumps(res, indent=2))
    return 0 if res.get("exit") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
