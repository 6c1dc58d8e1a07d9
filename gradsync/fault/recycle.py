"""Pruned checkpoint directories, kept aside whole to be overwritten by later saves.

With a checkpoint every step, each step creates a step directory, each rank's file and its
``.sum``, and a manifest, and pruning deletes as many. On this machine (ext4) creating a
734 KB file and writing it took 310 us where overwriting an existing one of that size took
130 us; a ``mkdir`` 80 us and an ``rmdir`` 100 us, against 18 us for a ``rename``; and all of
it is CPU time a busy machine takes from the training steps. So a store that recycles (the
background writer's) prunes a checkpoint by deleting its manifest and moving the directory,
files and all, into ``DIR/.spare/``; a later save renames a spare directory to its own step
and overwrites each file found there in place (renamed to a temporary name first, written,
cut to length and renamed back, exactly as a new file would be).

What keeps this as safe as deleting:

- The manifest goes first, so a recycled directory is never a complete checkpoint again until
  a new commit writes a new manifest; ``latest`` and ``load`` only trust manifests.
- Each ``.sum`` names its step and save: one left from the directory's earlier step cannot
  vouch for a file of the new step (``CheckpointStore.missing`` / ``try_commit`` check both).
- A file is overwritten under a temporary name and renamed over its target, so a reader sees
  the old file or the whole new one (``checkpoint._atomic_write``).
- Claiming is a rename: two ranks claiming spares for the same step cannot both succeed (a
  directory renamed onto one a peer already wrote into fails), and the loser uses the peer's.
- At most ``PER_NAME`` spare directories are kept; others are deleted as before.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

__all__ = ["PER_NAME", "SPARE_DIR", "SpareFiles"]

SPARE_DIR = ".spare"
#: spare directories kept: one pruned checkpoint's, plus one for a save in flight
PER_NAME = 2
_DIR_NAME = "step-dir"


class SpareFiles:
    """The spare step directories of the checkpoint store at ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.root = directory / SPARE_DIR

    @staticmethod
    def claim(path: str | Path, tmp: str | Path) -> bool:
        """Rename ``path`` (a file a recycled directory brought along) to ``tmp`` to be
        overwritten there; False when there is none."""
        try:
            os.rename(path, tmp)
            return True
        except OSError:
            return False

    def claim_dir(self, step_dir: Path) -> bool:
        """Rename a spare directory to ``step_dir``; False if none or ``step_dir`` is taken."""
        for spare in self._spares():
            try:
                # Onto an existing empty directory this replaces it, which is as good; onto one
                # a peer already wrote into it fails, and the peer's directory is used.
                os.rename(self.root / spare, step_dir)
                return True
            except OSError:
                continue
        return False

    def keep(self, step_dir: Path, manifest: str) -> None:
        """Retire the pruned checkpoint ``step_dir``: its manifest deleted first, then the
        directory moved to the spares whole, or deleted when there are enough; never raises
        (a prune must not fail on a spare)."""
        try:
            (step_dir / manifest).unlink(missing_ok=True)
            if len(self._spares()) < PER_NAME:
                self.root.mkdir(exist_ok=True)
                os.rename(step_dir, self.root / f"{_DIR_NAME}.{uuid.uuid4().hex[:12]}")
                return
        except OSError:
            pass
        shutil.rmtree(step_dir, ignore_errors=True)

    def _spares(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.root) if n.startswith(_DIR_NAME + ".")]
        except OSError:
            return []
