"""``RunConfig``: everything ``gradsync run`` needs, validated before any process starts."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradsync.compression import parse_compression
from gradsync.errors import UsageError
from gradsync.inject import parse_kill, parse_slow
from gradsync.strategies.base import parse_strategy, uses_servers
from gradsync.telemetry.stragglers import StragglerConfig
from gradsync.workloads import WORKLOADS, make_workload
from gradsync.workloads.data import check_data_file

MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_LOCAL_PROCESSES = 256
MAX_PARAMS = 1_000_000_000


def default_out() -> str:
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


@dataclass(slots=True, kw_only=True)
class RunConfig:
    nproc: int = 4
    workload: str = "charlm"
    strategy: str = "bsp"
    compression: str | None = None
    steps: int = 200
    batch_size: int = 16
    lr: float | None = None
    bucket_mb: float = 25.0
    micro_batches: int = 1
    seed: int = 0
    out: str = field(default_factory=default_out)
    threads: int = 1
    data: str | None = None
    params: int = 100_000
    slow: str | None = None
    timeout: float = 300.0
    telemetry_every: int = 10
    progress: bool = True
    servers: int = 1
    straggler_window: int = 20
    straggler_threshold: float = 0.75
    straggler_warmup: int = 10
    plots: bool = True
    balance: bool = False
    check_every: int = 100
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    max_restarts: int = 0
    kill: str | None = None
    hosts: int = 0
    link: str = "1gbit"

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise UsageError(f"--nproc must be at least 1, got {self.nproc}")
        if self.workload not in WORKLOADS:
            raise UsageError(f"unknown workload {self.workload!r}; valid: {', '.join(WORKLOADS)}")
        parse_strategy(self.strategy)  # raises with the valid forms
        parse_compression(self.compression)
        for name in ("steps", "batch_size", "micro_batches", "threads", "telemetry_every"):
            value = getattr(self, name)
            if value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.batch_size % self.micro_batches:
            raise UsageError(
                f"--batch-size {self.batch_size} does not split into --micro-batches "
                f"{self.micro_batches} equal parts; use a multiple of {self.micro_batches}"
            )
        if not self.bucket_mb > 0:
            raise UsageError(f"--bucket-mb must be > 0, got {self.bucket_mb}")
        if self.lr is not None and not self.lr > 0:
            raise UsageError(f"--lr must be > 0, got {self.lr}")
        if not 0 < self.timeout <= MAX_TIMEOUT_S:
            raise UsageError(
                f"--timeout must be > 0 and at most {MAX_TIMEOUT_S:.0f} seconds (a week), "
                f"got {self.timeout}"
            )
        if self.nproc > MAX_LOCAL_PROCESSES:
            raise UsageError(
                f"--nproc {self.nproc} is more local workers than gradsync starts on one machine "
                f"(at most {MAX_LOCAL_PROCESSES}); use torchrun across nodes for more"
            )
        if not 1000 <= self.params <= MAX_PARAMS:
            raise UsageError(
                f"--params must be between 1000 and {MAX_PARAMS:,} (4 GB of fp32), "
                f"got {self.params}"
            )
        try:
            StragglerConfig(
                window=self.straggler_window,
                threshold=self.straggler_threshold,
                warmup=self.straggler_warmup,
            )
        except UsageError as exc:
            flag = next(
                f"--straggler-{name}"
                for name in ("window", "threshold", "warmup")
                if str(exc).startswith(name)
            )
            raise UsageError(f"{flag}: {exc}") from None
        if self.data is not None:
            check_data_file(self.data)
        if self.balance and parse_strategy(self.strategy).name != "bsp":
            raise UsageError(f"--balance needs --strategy bsp, got {self.strategy}")
        if self.check_every < 0:
            raise UsageError(f"--check-every must be >= 0 (0: off), got {self.check_every}")
        if self.checkpoint_every < 0:
            raise UsageError(
                f"--checkpoint-every must be >= 0 (0: off), got {self.checkpoint_every}"
            )
        if self.keep_checkpoints < 1:
            raise UsageError(f"--keep-checkpoints must be at least 1, got {self.keep_checkpoints}")
        if not 0 <= self.max_restarts <= 1000:
            raise UsageError(f"--max-restarts must be between 0 and 1000, got {self.max_restarts}")
        kills = parse_kill(self.kill)
        for k in kills:
            if k.rank >= self.processes:
                raise UsageError(
                    f"--kill names rank {k.rank}, but ranks are 0..{self.processes - 1}"
                )
        for k in kills:
            if self.uses_servers and k.rank >= self.nproc:
                # A server only serves: it has no step of its own at which to kill itself.
                raise UsageError(
                    f"--kill names rank {k.rank}, a parameter server with --strategy "
                    f"{self.strategy}; only worker ranks 0..{self.nproc - 1} can be killed"
                )
        if kills and self.max_restarts < len(kills):
            raise UsageError(
                f"--kill injects {len(kills)} failure(s) but --max-restarts is "
                f"{self.max_restarts}: the run could not survive them"
            )
        if self.hosts:
            self._check_hosts()
        if self.servers < 1:
            raise UsageError(f"--servers must be at least 1, got {self.servers}")
        self._check_servers()
        for s in parse_slow(self.slow):
            if s.rank >= self.nproc:
                raise UsageError(
                    f"--slow names rank {s.rank}, but ranks are 0..{self.nproc - 1} "
                    f"with --nproc {self.nproc}"
                )

    def _check_servers(self) -> None:
        if not self.uses_servers:
            if self.servers != 1:
                raise UsageError(
                    f"--servers {self.servers} is for the parameter-server strategies (ssp:S, "
                    f"async); --strategy {self.strategy} runs no servers"
                )
            return
        if self.servers > 1:
            # Every server needs a parameter tensor of its own (shards are whole tensors).
            workload = make_workload(
                self.workload, seed=self.seed, data=self.data, params=self.params
            )
            tensors = sum(p.requires_grad for p in workload.build_model().parameters())
            if self.servers > tensors:
                raise UsageError(
                    f"--servers {self.servers} is more than the {tensors} trainable parameter "
                    f"tensors of workload {self.workload}: each server holds whole tensors, so "
                    f"use at most {tensors} servers"
                )

    def _check_hosts(self) -> None:
        from gradsync.cluster import parse_rate

        if self.hosts < 0:
            raise UsageError(f"--hosts must be >= 0 (0: no emulated cluster), got {self.hosts}")
        parse_rate(self.link)
        if self.processes % self.hosts:
            raise UsageError(
                f"{self.processes} processes do not split evenly over --hosts {self.hosts}; "
                "use a number of workers (plus servers) that is a multiple of the hosts"
            )
        if self.max_restarts:
            raise UsageError("--max-restarts is not supported with --hosts yet")

    @property
    def uses_servers(self) -> bool:
        return uses_servers(self.strategy)

    @property
    def processes(self) -> int:
        """Processes to launch: the workers, plus the servers of ssp/async (the last ranks)."""
        return self.nproc + (self.servers if self.uses_servers else 0)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.nproc

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, run_dir: Path, **extra: Any) -> None:
        """Write config.json: the flags, plus derived facts for reports (``extra``)."""
        data = {**self.to_dict(), **extra}
        (run_dir / "config.json").write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})
