"""The run's secret, and gradsync's keys in the store named through it.

torch's c10d stores have no authentication: any process that reaches a run's TCPStore (every
local user's, on loopback) reads and writes any key in it, and a recent torch's TCPStore lists
them all (``Store.list_keys``). gradsync's own keys (the heartbeats, the step gates, the arrival
records) were fixed names: another process could read where each rank was and, by adding to the
counters of the gates to come, keep every rank waiting at them.

So each key gradsync keeps is stored under a keyed hash of its name (:class:`KeyedStore`): the
key ``gradsync/arrive/gate/7/3/the step`` lives at ``gradsync/<blake2b(name, key=secret)>``.
Without the secret no name can be derived, so no gate to come can be reached before a rank
creates its counter. The names that exist can still be listed, and their values read or
changed, by anyone who reaches the store: the gate's waits are therefore bounded whatever the
store holds (``gradsync.checks.gate``), and README's trust model says what remains.

The secret comes from the environment (:data:`SECRET_ENV`: ``gradsync run`` draws one per run
and hands it to its workers; another user cannot read a process's environment, where a
command line is public), or is agreed over the process group (:func:`agree`: rank 0 draws it
and broadcasts it, never through the store): by ``gs.init()``, or at the first step gate of a
Synchronizer whose ranks are the whole world when the script made its group itself.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import secrets
from typing import Any

import torch
import torch.distributed as dist

#: the environment variable holding the run's secret (hex); ``gradsync run`` sets it for its
#: workers (``gradsync.processes.launch`` names the same variable)
SECRET_ENV = "GRADSYNC_RUN_SECRET"
_SECRET_BYTES = 16


def draw() -> str:
    """A fresh secret."""
    return secrets.token_hex(_SECRET_BYTES)


def from_environment() -> str | None:
    """The secret this process was given, if any."""
    return os.environ.get(SECRET_ENV) or None


def agree(group: dist.ProcessGroup | None = None) -> str:
    """A secret that every rank of ``group`` (None: the world) returns: rank 0's draw,
    broadcast over the group. A collective: every rank calls it at the same point."""
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    drawn = torch.zeros(_SECRET_BYTES, dtype=torch.uint8, device=device)
    if dist.get_rank(group) == 0:
        drawn.copy_(torch.tensor(list(secrets.token_bytes(_SECRET_BYTES)), dtype=torch.uint8))
    source = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(drawn, src=source, group=group)
    return bytes(drawn.cpu().tolist()).hex()


class KeyedStore:
    """``store`` with every key name replaced by a keyed hash of it (the methods gradsync's
    checks use). Ranks holding the same secret address the same keys."""

    def __init__(self, store: Any, secret: str) -> None:
        self.store = store
        self._key = bytes.fromhex(secret) if _is_hex(secret) else secret.encode()
        self._key = self._key[:64] or b"\0"  # blake2b takes at most 64 bytes of key

    def over(self, store: Any) -> KeyedStore:
        """``store`` with its keys named as this one's (the step gate's group stores)."""
        keyed = KeyedStore(store, "0")
        keyed._key = self._key
        return keyed

    def name(self, key: str) -> str:
        """Where ``key`` lives in the underlying store."""
        digest = hashlib.blake2b(key.encode(), key=self._key, digest_size=16).hexdigest()
        return f"gradsync/{digest}"

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(self.name(key), value)

    def get(self, key: str) -> bytes:
        return bytes(self.store.get(self.name(key)))

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(self.name(key), amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self.store.check([self.name(k) for k in keys]))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        names = [self.name(k) for k in keys]
        if timeout is None:
            self.store.wait(names)
        else:
            self.store.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.store.delete_key(self.name(key)))


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def keyed(store: Any, secret: str | None) -> Any:
    """``store`` with its keys named through ``secret``; ``store`` itself where there is no
    secret (a world of one) or no store."""
    if store is None or not secret:
        return store
    return KeyedStore(store, secret)


__all__ = ["SECRET_ENV", "KeyedStore", "agree", "draw", "from_environment", "keyed"]
