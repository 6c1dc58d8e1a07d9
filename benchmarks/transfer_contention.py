"""Issue 46, what slows the frontier's steps while an exchange is in flight on the emulated
cluster: is it gradsync's or gloo's work, or the network's own path through the kernel?

On 2 emulated hosts (one rank each; root and iproute2, as the other cluster benchmarks),
``benchmarks.transfer_contention_worker`` times the frontier's mlp steps with nothing else
running, while a gloo all-reduce of ``--mb`` MB runs ``--times`` times in a thread of the same
process, and while a plain TCP stream of the same bytes runs both ways between the ranks (no
gloo, no gradsync: threads that spend their time in the kernel's socket calls). Per rank:
the step time (median block), its ratio to the steps with nothing in flight, the training
thread's own CPU time per step (``time.thread_time``), and the CPU the process's other threads
took per block; then each transfer alone. Blocks interleaved, order rotated by repeat. A
kernel's network work done in a softirq is charged to whichever thread the CPU was running,
often the training thread: its "own CPU" can grow with nothing added to its code.
``python -m benchmarks.transfer_contention --write`` adds the section to BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import ROOT, Harness, machine, table
from benchmarks.transfer_contention_worker import CONDITIONS
from gradsync.cluster import Cluster, launch_on_cluster, requirements_missing

PREFIX = "gstc-"
LABELS = {
    "none": "nothing in flight",
    "gloo": "a gloo all-reduce in flight",
    "socket": "a plain TCP stream in flight",
}
ALONE = {"gloo": "gloo all-reduce", "socket": "plain TCP stream"}


def main() -> None:
    h = Harness("benchmarks.transfer_contention", __doc__, repeats=7)
    h.parser.add_argument("--link", default="1gbit", help="each host's link (%(default)s)")
    h.parser.add_argument("--mb", type=float, default=3.0, help="MB a transfer (%(default)s)")
    h.parser.add_argument("--times", type=int, default=6, help="transfers a block (%(default)s)")
    args = h.parse(quick={"repeats": 1, "times": 2})
    missing = requirements_missing()
    if missing is not None:
        raise SystemExit(f"needs the emulated cluster: {missing}")
    path = os.environ.get("PYTHONPATH")
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    with tempfile.TemporaryDirectory(prefix="gs-contention-") as tmp:
        out = Path(tmp) / "out"
        worker = ["benchmarks.transfer_contention_worker", "--mb", str(args.mb)]
        worker += ["--times", str(args.times), "--repeats", str(args.repeats), "--out", str(out)]
        with Cluster(hosts=2, link=args.link, prefix=PREFIX) as cluster:
            rc = launch_on_cluster(cluster, worker, env=env, timeout_s=900)
        if rc != 0:
            raise SystemExit(f"the launch failed (rc {rc})")
        ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]
    rows = []
    for d in ranks:
        blocks = d["blocks"]
        alone = statistics.median(b["ms_per_step"] for b in blocks["none"])
        for cond in CONDITIONS:
            bs = blocks[cond]
            ms = statistics.median(b["ms_per_step"] for b in bs)
            own = statistics.median(b["own_cpu_ms_per_step"] for b in bs)
            other = statistics.median(b["other_cpu_ms"] for b in bs)
            took = statistics.median(b["transfer_s"] for b in bs) * 1e3
            rows.append(
                [
                    str(d["rank"]),
                    LABELS[cond],
                    f"{ms:.2f}",
                    f"{ms / alone:.2f}",
                    f"{own:.2f}",
                    f"{other:.1f}",
                    f"{took:.0f}" if cond != "none" else "-",
                ]
            )
    head = (
        "rank | while | ms/step | vs nothing in flight | training thread's CPU, ms/step | "
        "other threads' CPU a block, ms | the transfers took, ms"
    )
    alone_rows = [
        [
            str(d["rank"]),
            ALONE[c],
            f"{d['alone'][c]['s'] * 1e3:.0f}",
            f"{d['alone'][c]['cpu_ms']:.1f}",
        ]
        for d in ranks
        for c in ("gloo", "socket")
    ]
    moved = args.mb * args.times
    text = (
        f"The frontier's mlp (3M parameters, 32 samples a rank), 2 emulated hosts at "
        f"{args.link}; each transfer {moved:g} MB ({args.times} x {args.mb:g} MB) each way; "
        f"{args.repeats} repeats, medians.\n\n"
        + table(head, rows)
        + "\n\nThe same transfers alone (no steps):\n\n"
        + table("rank | transfer | took, ms | process CPU, ms", alone_rows)
        + f"\n\n{machine()}. Command: `{h.command()}`"
    )
    h.finish(text)


if __name__ == "__main__":
    main()
