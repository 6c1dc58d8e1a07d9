"""This replica group as a torchft participant: its ``Manager``, built so that every socket
gradsync can place listens on one address (``host``: loopback, or on the emulated cluster the
host's own, ``$GRADSYNC_MEMBERSHIP_HOST``), and the three calls a strategy makes of it (BSP
each step, ``local:H`` and ``diloco:H`` each exchange).

Why a module of its own: torchft's ``Manager`` is the only cross-replica channel under
``membership="torchft"`` (gradsync's own collectives stay inside one replica group: a world
of one, or the group's ranks summing before the quorum's mean), and building it takes
decisions that are not a strategy's: which store, which checkpoint transport, what a
replacement heals from, where things listen. Strategies see it only as
``strategies.base.Membership`` (``start_step``, ``allreduce``, ``commit``).

What listens (docs/membership.md has the table):

- the group's TCPStore, which torchft's quorum hands to the peers to build the cross-replica
  gloo group: ``processes.stores.server_store`` on ``host`` (torch's own would bind every
  interface);
- the Manager's server (quorum and commit RPCs): torchft 0.2 hard-codes ``bind="[::]:PORT"``;
  the Manager is built with ``ManagerServer`` swapped, for the construction only, for one that
  binds the same port on ``host`` (``_manager_server_bound_to``);
- gloo's sockets: ``GLOO_SOCKET_IFNAME`` (``lo`` for a local run, as gradsync's launchers set;
  the host's interface on the emulated cluster);
- the healing transfer: torchft's ``PGTransport`` over that gloo group, so no HTTP server; the
  default ``HTTPTransport`` would bind every interface (``("", 0)`` over IPv6).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from gradsync import runtime
from gradsync.attached_run import restart_count
from gradsync.checkpoint.registry import StateRegistry
from gradsync.checks.diagnose import END
from gradsync.compression.base import ReplicaExchange
from gradsync.errors import UsageError
from gradsync.logs import get_logger
from gradsync.membership import LiveSettings, StepQuorum
from gradsync.membership.lighthouse import HOST_ENV
from gradsync.processes.stores import server_store
from gradsync.strategies.base import Strategy, own_optimizer_state

logger = get_logger("membership")

#: where a local run's sockets listen
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """What a live peer sends a replacement, and how the replacement takes it: the model (as
    the strategy saves it), the optimizer, the Synchronizer's own state (step, strategy and
    compressor state) and every state registered with ``sync.register_state``: what a
    checkpoint holds, minus the RNG (each replica draws its own data) and the step records."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    sync_state: Callable[[], dict[str, Any]]
    load_sync_state: Callable[[dict[str, Any]], None]
    registry: StateRegistry

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.strategy.model_state_dict(self.model),
            "optimizer": own_optimizer_state(self.optimizer),
            "sync": self.sync_state(),
            "registered": self.registry.states(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.strategy.load_model_state_dict(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_sync_state(state["sync"])
        step = int(state["sync"]["step"])
        self.registry.load(state["registered"], step=step, world_changed=False, warn=True)


class TorchftMembership:
    """``strategies.base.Membership`` through a torchft ``Manager`` (see the module docstring).

    The quorum is synchronous (``use_async_quorum=False``): a replacement heals inside
    ``start_step``, before the step's forward pass, and takes part in that step's all-reduce
    like any peer, rather than contributing zeros for a step while its state arrives."""

    def __init__(
        self,
        settings: LiveSettings,
        state: ReplicaState,
        *,
        timeout_s: float,
        host: str | None = None,
        group: dist.ProcessGroup | None = None,
        on_healed: Callable[[int, int, float], None] | None = None,
        on_step: Callable[[StepQuorum], None] | None = None,
    ) -> None:
        import torchft.manager as ft_manager
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.process_group import ProcessGroupGloo

        _quiet_torchft_noise()
        # The Synchronizer builds this without a host: a group that ``gradsync run --hosts``
        # started on an emulated host is told its address in the environment, as gloo is told
        # its interface, so that its peers on other hosts can reach its store and Manager.
        host = host or os.environ.get(HOST_ENV) or LOOPBACK
        timeout = datetime.timedelta(seconds=timeout_s)
        # A replica group of several ranks (``group``, gradsync's own process group) has one
        # torchft Manager per rank: rank R of every group exchanges with rank R of the others
        # (torchft's replica process group), and the ranks of a group agree on each quorum
        # and commit through the group's store, which the group's rank 0 serves.
        rank, world = runtime.rank(group), runtime.world_size(group)
        self._store, port = _group_store(host, timeout, group, rank, world)
        self._pg = ProcessGroupGloo(timeout=timeout)
        transport = PGTransport(self._pg, timeout=timeout, device=torch.device("cpu"))
        self.manager = self._make_manager(
            ft_manager,
            settings,
            state,
            transport,
            host=host,
            port=port,
            timeout=timeout,
            rank=rank,
            world=world,
        )
        # One thread waits for the buckets' all-reduces in launch order and completes the
        # futures BucketReducer holds: the Manager returns a Work whose result exists only
        # once waited on, and waiting in the autograd hook would serialize the exchange with
        # the backward pass.
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradsync-torchft")
        #: a replica group of several ranks, until its first quorum: torchft heals each rank
        #: from a peer of the same rank, and where several peers are as far (replicas that
        #: all start at step 0), rank R may take group A's weights and rank R' group B's
        self._align_after_quorum = world > 1
        self._group = group
        self._state, self._on_healed = state, on_healed
        self._name = (
            "this replica group"
            if settings.replica_id is None
            else f"replica group {settings.replica_id}"
        )
        #: the step and tensor bytes of the state taken from a peer in this quorum, if any
        self._healed: tuple[int, int] | None = None
        #: until this process's first quorum (``start_step``): a sync there at step 0 of the
        #: group's first process is the groups' initial sync (they may start from different
        #: weights), which the run's report counts apart from healings (``telemetry.membership``)
        self._first_quorum = True
        self._on_step = on_step
        #: this step's quorum, until its commit is decided
        self._quorum: StepQuorum | None = None
        #: the last step a quorum decided (``_decided``: where the final average is recorded)
        self._last_step = 0
        self._seen = _QuorumSeen.wrap(self.manager)
        self._replicas = _Replicas(self.manager, self._pg)
        #: said once: a step skipped for a quorum smaller than ``min_replicas`` (``commit``)
        self._min_replicas, self._warned_small = settings.min_replicas, False
        #: steps this replica committed, and whether any of them had another group in its
        #: quorum: a group that never met one is told so at ``close`` (it trained alone)
        self._committed_steps, self._met_a_peer = 0, False
        # torchft's id of this group (``GROUP:UUID``, or a bare UUID without a group id), as
        # its Manager put it in this group's store: which of a quorum's members is this one
        self._replica_id = self._store.get(ft_manager.REPLICA_ID_KEY).decode()

    def _make_manager(
        self,
        ft_manager: Any,
        settings: LiveSettings,
        state: ReplicaState,
        transport: Any,
        *,
        host: str,
        port: int,
        timeout: datetime.timedelta,
        rank: int,
        world: int,
    ) -> Any:
        """This rank's torchft ``Manager`` (``ft_manager``: the ``torchft.manager`` module) over
        ``self._pg``: it sends ``state`` to a replacement and heals this replica (``_heal``),
        both over ``transport``; its server listens on ``host`` (``_manager_server_bound_to``)
        and the group's store is at ``host:port``."""
        with _manager_server_bound_to(ft_manager, host):
            return ft_manager.Manager(
                pg=self._pg,
                load_state_dict=self._heal,
                state_dict=state.state_dict,
                min_replica_size=settings.min_replicas,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout,
                rank=rank,
                world_size=world,
                store_addr=host,
                store_port=port,
                lighthouse_addr=settings.lighthouse,
                replica_id=settings.replica_id,
                hostname=host,
                checkpoint_transport=transport,
                # Replicas may start from different weights: the first quorum heals every
                # participant but one from it, as gradsync's initial broadcast does in a group.
                init_sync=True,
            )

    def _align_group(self) -> None:
        """After the first quorum, every rank of this replica group takes its rank 0's model
        (parameters and buffers), as the Synchronizer's initial broadcast does, and its
        strategy's state (DiLoCo's global copies and outer momentum, which a healing brings
        with the parameters: a rank with one replica's global copy and another's parameters
        would send their difference as its pseudo-gradient). The group then holds one
        replica's weights. Later quorums heal from committed replicas, which agree bitwise."""
        group = self._group
        src = _group_root(group)
        with torch.no_grad():
            for tensor in self._state.model.state_dict().values():
                dist.broadcast(tensor, src=src, group=group)
        strategy = self._state.strategy
        held: list[dict[str, Any]] = [strategy.state_dict() if runtime.rank(group) == 0 else {}]
        dist.broadcast_object_list(held, src=src, group=group)
        if runtime.rank(group) != 0:
            strategy.load_state_dict(held[0])

    def _heal(self, state: dict[str, Any]) -> None:
        self._state.load_state_dict(state)
        self._healed = (int(state["sync"]["step"]), tensor_bytes(state))

    def start_step(self, step: int) -> None:
        """Join this step's quorum (a replacement heals here, before the forward pass); a
        healing is reported to ``on_healed`` with its step, bytes and the quorum's seconds."""
        self._healed = None
        wall, start = time.time(), time.perf_counter()
        self._count_from(step)
        self.manager.start_quorum()
        first, self._first_quorum = self._first_quorum, False
        if self._align_after_quorum:
            self._align_group()
            self._align_after_quorum = False
        seconds = time.perf_counter() - start
        # joined at the step the group is at once the quorum is had: a healed replacement's
        # is its peer's (the step faults/healed.jsonl names)
        joined = step if self._healed is None else self._healed[0]
        self._quorum = self._observed(joined, wall, seconds)
        if self._healed is None:
            return
        healed_at, nbytes = self._healed
        # the group's first process: the elastic agent's restart count (gradsync run's groups
        # and torchrun's) is 0
        initial = first and healed_at == 0 and restart_count() == 0
        if runtime.rank(self._group) == 0:  # once a group, with the seconds healed.jsonl has
            said = (
                "%s started from a live peer's weights, the first quorum's initial sync: at "
                "step %d (%.2f MB in %.2f s)"
                if initial
                else "%s healed from a live peer: at step %d (%.2f MB in %.2f s)"
            )
            logger.info(said, self._name, healed_at, nbytes / 1e6, seconds)
        if self._on_healed is not None:
            self._on_healed(healed_at, nbytes, seconds)

    def allreduce(
        self,
        tensor: torch.Tensor,
        wire: torch.dtype | None = None,
        after: Callable[[], object] | None = None,
    ) -> torch.futures.Future[torch.Tensor]:
        """The mean of ``tensor`` over this step's participants, in place. A failed exchange
        (a peer lost mid-step) completes all the same, with garbage in ``tensor``: the Manager
        noted the error, and ``commit`` then says False. With ``wire`` (fp16, bf16) each
        participant sends its share, ``tensor / participants`` cast to it, the Manager sums
        the shares (so the sum cannot overflow where the fp32 values did not, as gradsync's
        fp16 hook does within a group), and the sum is cast back into ``tensor``. ``after``:
        called first, on the thread that waits for the exchanges (the group's own all-reduce
        of ``tensor``, under a replica group of several ranks), so the cross-replica exchange
        starts once it is done, buckets in launch order."""
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def exchange() -> None:
            sent, work = tensor, None
            try:
                if after is not None:
                    try:
                        after()
                    except Exception as exc:  # noqa: BLE001 - the step must not commit
                        # the group's own exchange failed (a rank of it is gone): the Manager
                        # is told, so that this step is not committed, as for its own failures
                        self.manager.report_error(exc)
                        return
                if wire is None:  # torchft's mean: a sum, then 1/participants
                    work = self.manager.allreduce(tensor)
                else:
                    sent = tensor.div(self.participants()).to(wire)
                    work = self.manager.allreduce(sent, reduce_op=dist.ReduceOp.SUM)
                work.wait()  # reports its own error to the Manager rather than raising
            finally:
                if sent is not tensor:
                    tensor.copy_(sent)
                done.set_result(tensor)

        self._waiter.submit(exchange)
        return done

    @property
    def replicas(self) -> ReplicaExchange:
        return self._replicas

    def exchange(
        self,
        run: Callable[[], torch.futures.Future[torch.Tensor]],
        tensor: torch.Tensor,
        after: Callable[[], object] | None = None,
    ) -> torch.futures.Future[torch.Tensor]:
        """A compressed exchange across the replicas: ``run()`` posts a compressor's
        collectives on ``replicas`` (torchft's process group) once ``after`` (the replica
        group's own exchange) returns, on the thread that waits for every exchange, so that
        buckets go in launch order. Its value, or ``tensor`` as it is where a collective
        failed (a peer lost mid-step): the failure goes to the Manager, whose ``commit`` then
        says False, as a failed all-reduce of its own does."""
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def go() -> None:
            result = tensor
            try:
                if after is not None:
                    after()
                result = run().wait()
            except Exception as exc:  # noqa: BLE001 - the step must not commit
                self.manager.report_error(exc)
            finally:
                done.set_result(result)

        self._waiter.submit(go)
        return done

    def commit(self, step: int) -> bool:
        """Whether this replica applies the step: every participant's exchange completed and
        the quorum had at least ``min_replicas`` participants. The step's quorum goes to
        ``on_step`` with the decision."""
        committed = bool(self.manager.should_commit())
        quorum, self._quorum = self._quorum, None
        if not committed and not self._warned_small and self.participants() < self._min_replicas:
            self._warned_small = True
            logger.warning(
                "%s skips step %d: its quorum had %d participant(s), fewer than min_replicas=%d; "
                "every step is skipped until %d replica groups take part together. The "
                "lighthouse forms a quorum once its own min_replicas have joined: start it with "
                "min_replicas=%d too (gradsync run --replica-groups does), docs/membership.md",
                self._name,
                step,
                self.participants(),
                self._min_replicas,
                self._min_replicas,
                self._min_replicas,
            )
        if committed:
            self._committed_steps += 1
            self._met_a_peer = self._met_a_peer or self.participants() > 1
        if self._on_step is not None and quorum is not None:
            self._on_step(self._decided(quorum, step, committed))
        return committed

    def _say_if_alone(self) -> None:
        """Warn where every committed step of this replica had no other group in its quorum.
        With ``min_replicas=1`` the lighthouse forms a quorum of whoever asks, so groups started
        apart (by hand, one after another, a few seconds of launch between them) can each train
        every step alone and end with different models, which nothing else would say."""
        if self._met_a_peer or not self._committed_steps or runtime.rank(self._group) != 0:
            return
        if restart_count() > 0:
            # a replacement its agent started: its group's earlier steps had peers, and the
            # others were gone (finished, with min_replicas=1 nobody waits for a replacement)
            logger.warning(
                "%s's replacement (restart %d) trained its %d committed step(s) alone: no "
                "other replica group was left in its quorums (the others had finished), so its "
                "model from there on is its own and differs from the others'; with "
                "--min-replicas G the others wait for a lost group's replacement",
                self._name,
                restart_count(),
                self._committed_steps,
            )
            return
        logger.warning(
            "%s trained alone: no other replica group took part in any quorum of its %d "
            "committed step(s), so its model is its own and differs from any other group's. "
            "Groups started apart do not wait for each other with min_replicas=1: give the "
            "lighthouse and the Synchronizer min_replicas=G for G groups (gradsync run "
            "--replica-groups starts its groups together), docs/membership.md",
            self._name,
            self._committed_steps,
        )

    def _decided(self, quorum: StepQuorum, step: int, committed: bool) -> StepQuorum:
        """The quorum as recorded: at ``step``, whose exchange it decided (the Synchronizer's
        step, a healed replacement's peer's), with the step it was joined before where that
        differs, so that a loss and a healing, seen at the join, are told at the step they
        happened at (faults/healed.jsonl's), not the period's last. The final average after
        the last step is asked for at ``END``, an order past every step and no step: it is
        recorded at the step its quorum was joined, or where it was joined for it (no period
        was open), at the last step a quorum decided, and said ``final``."""
        final = step == END
        if final:
            step = self._last_step if quorum.step == END else quorum.step
        else:
            self._last_step = max(self._last_step, step)
        joined = step if quorum.step == END else quorum.step
        return dataclasses.replace(
            quorum,
            step=step,
            committed=committed,
            joined_at=None if joined == step else joined,
            final=final,
        )

    def _observed(self, step: int, wall: float, seconds: float) -> StepQuorum:
        """The quorum just joined: its id and members as the lighthouse sent them (None
        where this torchft's result was not seen), its participants as the Manager counts
        them (those the step's all-reduce averages over)."""
        result = self._seen.last if self._seen is not None else None
        return StepQuorum(
            step=step,
            time=wall,
            quorum_s=seconds,
            quorum_id=None if result is None else int(result.quorum_id),
            participants=self.participants(),
            members=None if result is None else [str(r) for r in result.replica_ids],
            committed=False,
            healed_bytes=None if self._healed is None else self._healed[1],
            replica_id=self._replica_id,
        )

    def _count_from(self, step: int) -> None:
        """The Manager's step set to the Synchronizer's, ``step``, before each quorum: torchft
        heals the replicas of a quorum below its highest step from the one at it, and its own
        count (one per committed quorum) is not the training step where a quorum is joined once
        a period (``local:H``, ``diloco:H``) or a step was not committed. A group that loaded a
        checkpoint (``--resume``, or a replacement restarted by its agent) then compares where
        it is with where the others are: counted from its checkpoint's step against a survivor's
        quorums, a replacement of a local:2 run looked further than the survivor, which healed
        from it and went back. Every group counting alike, a quorum heals the ones behind the
        furthest (where all at step 0 would heal all but an arbitrary one from it)."""
        state = self.manager.state_dict()
        if state["step"] != step:
            self.manager.load_state_dict({**state, "step": step})

    def participants(self) -> int:
        return int(self.manager.num_participants())

    def close(self) -> None:
        self._say_if_alone()
        self._waiter.shutdown(wait=True)
        self.manager.shutdown(wait=True)
        self._pg.shutdown()


class _Replicas(ReplicaExchange):
    """This step's participants as a compressor's group: torchft's process group, which the
    Manager reconfigures at each new quorum, with the Manager's count and rank of its
    participants. The quorum is synchronous, so every replica in it takes part (a
    replacement heals before the step): the process group's ranks are the participants."""

    def __init__(self, manager: Any, pg: Any) -> None:
        self._manager, self._pg = manager, pg

    def size(self) -> int:
        return int(self._manager.num_participants())

    def rank(self) -> int:
        rank = self._manager.participating_rank()
        if rank is None:
            raise RuntimeError("this replica does not take part in the step's exchange")
        return int(rank)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> dist.Work:
        work: dist.Work = self._pg.allgather([outputs], [tensor], AllgatherOptions())
        return work

    def all_reduce_sum(self, tensor: torch.Tensor) -> dist.Work:
        work: dist.Work = self._pg.allreduce([tensor], dist.ReduceOp.SUM)
        return work


class _QuorumSeen:
    """torchft 0.2's ``ManagerClient`` as its Manager calls it, keeping the last quorum's
    result: the Manager keeps the number of participants (``num_participants``) but neither
    the quorum's id nor its members' replica ids, which tell a survivor which group it lost
    even when a replacement took the lost one's place in the same quorum. Every other call
    passes through unchanged."""

    def __init__(self, client: Any) -> None:
        self._client = client
        #: torchft's ``QuorumResult`` of the last quorum (``quorum_id``, ``replica_ids``)
        self.last: Any = None

    @classmethod
    def wrap(cls, manager: Any) -> _QuorumSeen | None:
        """Put one between ``manager`` and its client; None (and a warning: the run's
        membership.jsonl then names no members) where this torchft has no such client."""
        client = getattr(manager, "_client", None)
        if not callable(getattr(client, "_quorum", None)):
            logger.warning(
                "this torchft's Manager has no _client._quorum (tested with torchft 0.2.0): "
                "membership.jsonl records each step's participants but not who they were"
            )
            return None
        seen = cls(client)
        manager._client = seen
        return seen

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self.last = result
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class _NotAboutNccl(logging.Filter):
    """Drops torchft's warning, at every new quorum, that it cannot reset NCCL's flight
    recorder: gradsync's replica groups exchange over gloo, where there is none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "NCCL flight recorder" not in record.getMessage()


def _quiet_torchft_noise() -> None:
    """torchft 0.2's notices that tell a user of gradsync nothing to act on: the NCCL warning
    above, and two warnings its healing transfer raises inside torch's own code (a read-only
    buffer it wraps, a deprecated pytree check). Narrowly: those messages, from torchft."""
    manager_log = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _NotAboutNccl) for f in manager_log.filters):
        manager_log.addFilter(_NotAboutNccl())
    warnings.filterwarnings(
        "ignore", message="The given buffer is not writable", module=r"torchft\."
    )
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", module=r"torchft\."
    )


def _group_root(group: dist.ProcessGroup | None) -> int:
    """The global rank of ``group``'s rank 0 (the default group's: 0)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def _group_store(
    host: str,
    timeout: datetime.timedelta,
    group: dist.ProcessGroup | None,
    rank: int,
    world: int,
) -> tuple[dist.TCPStore, int]:
    """The replica group's store for its torchft Managers: served on ``host`` by the group's
    rank 0 (a port the system picks, sent to the other ranks over ``group``), a client of it
    on the others."""
    store = server_store(host, 0, timeout=timeout) if rank == 0 else None
    port = [store.port if store is not None else 0]
    if world > 1:
        src = _group_root(group)
        dist.broadcast_object_list(port, src=src, group=group)
    if store is None:
        store = dist.TCPStore(host, port[0], is_master=False, timeout=timeout)
    return store, port[0]


def tensor_bytes(state: Any) -> int:
    """The bytes of every tensor in a nested state dict (what a healing transfer carried)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(v) for v in state)
    return 0


@contextlib.contextmanager
def _manager_server_bound_to(module: Any, host: str) -> Iterator[None]:
    """While the ``Manager`` is built: its ``ManagerServer`` listens on ``host`` instead of the
    ``[::]`` that torchft 0.2 hard-codes (same port). The name is swapped in torchft's module
    and put back at once; a torchft that builds its server otherwise fails here, loudly,
    rather than binding every interface unseen."""
    made = module.ManagerServer

    def bound(**kwargs: Any) -> Any:
        if "bind" not in kwargs:
            raise UsageError(
                "this torchft builds its ManagerServer without bind=: gradsync cannot keep it "
                f"on {host} (tested with torchft 0.2.0)"
            )
        port = str(kwargs["bind"]).rpartition(":")[2]
        return made(**{**kwargs, "bind": f"{host}:{port}"})

    module.ManagerServer = bound
    try:
        yield
    finally:
        module.ManagerServer = made
