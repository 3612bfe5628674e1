"""``RankSafeCheckpointIO``: Lightning's CheckpointIO with ranksafe's atomic, checksummed files.

Stock ``TorchCheckpointIO`` serialises the whole checkpoint into memory first (one extra copy of the
model in RAM), writes the temporary file in ``$TMPDIR`` (a rename across file systems becomes a copy that a
crash can tear) and never fsyncs. This plugin streams ``torch.save`` into a temporary file beside the
target, fsyncs and renames it (:func:`ranksafe.files.atomic_save`), and verifies the CRC footer on load, so
a torn or bit-flipped file raises :class:`~ranksafe.CorruptCheckpoint` instead of loading.

It is purely local: no collectives. Lightning calls it on global rank 0 only (``Strategy.save_checkpoint``),
and under ``ddp_spawn`` from the parent process, which has no process group. Sharing the writer's outcome
with the other ranks is the job of the :class:`~ranksafe.lightning.RankSafe` callback.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH

from ..files import atomic_save, load_file
from ..saving import _naming

_MapLocation = Callable | str | dict | None


def _is_local(path: _PATH) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


def _local_path(path: _PATH) -> str:
    path = str(path)
    return path[len("file://") :] if path.startswith("file://") else path


class RankSafeCheckpointIO(CheckpointIO):
    """Atomic, fsynced, checksummed checkpoint files for Lightning; ``Trainer(plugins=[RankSafeCheckpointIO()])``.

    Files stay loadable by stock ``torch.load`` and ``LightningModule.load_from_checkpoint`` (the footer
    sits after the zip archive, where ``torch.load`` does not look). Only local paths are supported: the
    commit protocol needs ``fsync`` and an atomic rename, which object stores do not offer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically: a reader or a crash sees the old file or the new one."""
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                f"`{type(self).__name__}`; it writes local files only"
            )
        if not _is_local(path):
            raise ValueError(f"{type(self).__name__} writes local files only, not {path}")
        path = _local_path(path)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        try:
            atomic_save(checkpoint, path)
        except OSError as e:  # name the checkpoint, not the temporary file the error speaks of
            raise _naming(e, "cannot save checkpoint", path) from e

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: _MapLocation = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Verify and load ``path``; :class:`~ranksafe.CorruptCheckpoint` names a torn or corrupt file.

        ``weights_only=None`` means torch's default (True), as for stock Lightning; a file that needs
        ``weights_only=False`` raises :class:`~ranksafe.UntrustedCheckpoint` saying so.
        """
        if not _is_local(path):
            raise ValueError(f"{type(self).__name__} reads local files only, not {path}")
        path = _local_path(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return load_file(path, map_location=map_location, weights_only=True if weights_only is None else weights_only)

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove ``path`` (a file or a directory); a missing path is not an error, as in stock Lightning."""
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)
