"""``RankSafeCheckpointIO``: Lightning's CheckpointIO with ranksafe's atomic, checksummed files.

Stock ``TorchCheckpointIO`` serialises the whole checkpoint into memory first (one extra copy of the
model in RAM), writes the temporary file in ``$TMPDIR`` (a rename across file systems becomes a copy that a
crash can tear) and never fsyncs. This plugin streams ``torch.save`` into a temporary file beside the
target, fsyncs and renames it (:func:`ranksafe.files.atomic_save`), and verifies the CRC footer on load, so
a torn or bit-flipped file raises :class:`~ranksafe.CorruptCheckpoint` instead of loading.

With ``async_save=True`` the write happens on a background thread (:class:`~ranksafe.AsyncSaver`), and the
three things stock ``AsyncCheckpointIO`` gets wrong are fixed:

* removing an old checkpoint (ModelCheckpoint's top-k, ``last.ckpt``) is deferred until the save in flight
  has committed, and dropped if that save fails: the previous checkpoint survives a failed write (stock
  deletes it as soon as the new save is *submitted*, so a failure leaves nothing on disk);
* a background failure is reported by :meth:`~RankSafeCheckpointIO.check`, a collective the
  :class:`~ranksafe.lightning.RankSafe` callback calls after every training step: every rank raises it
  within one step (stock raises it on rank 0 only, at the next save or at teardown);
* the snapshot goes into reused staging buffers (one copy, no allocation per save), under the read side of
  :attr:`~RankSafeCheckpointIO.lock`, whose write side RankSafe holds around the optimizer step.

Saving, loading and removing are purely local: no collectives. Lightning calls them on global rank 0 only
(``Strategy.save_checkpoint``), and under ``ddp_spawn`` from the parent process, which has no process group.
Sharing outcomes with the other ranks is the job of the :class:`~ranksafe.lightning.RankSafe` callback.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH

from .. import topology
from ..async_save import AsyncSaver
from ..files import atomic_save, load_file, make_dirs
from ..saving import error_naming_target
from ..snapshot import StateDictLock

_MapLocation = Callable | str | dict | None


def _is_local(path: _PATH) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


def _local_path(path: _PATH) -> str:
    path = str(path)
    return path[len("file://") :] if path.startswith("file://") else path


def link(filepath: str, linkpath: str) -> None:
    """Point ``linkpath`` at ``filepath`` (ModelCheckpoint's ``save_last="link"``): a relative symlink, or a copy
    where links are not allowed. Made beside the target and renamed over it, so ``last.ckpt`` is never missing."""
    if os.path.isdir(linkpath) and not os.path.islink(linkpath):
        shutil.rmtree(linkpath)
    temporary = f"{linkpath}.ranksafe-link"
    if os.path.lexists(temporary):
        os.remove(temporary)
    try:
        os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), temporary)
    except OSError:
        shutil.copy(filepath, temporary)
    os.replace(temporary, linkpath)


class RankSafeCheckpointIO(CheckpointIO):
    """Atomic, fsynced, checksummed checkpoint files for Lightning; ``Trainer(plugins=[RankSafeCheckpointIO()])``.

    Files stay loadable by stock ``torch.load`` and ``LightningModule.load_from_checkpoint`` (the footer
    sits after the zip archive, where ``torch.load`` does not look). Only local paths are supported: the
    commit protocol needs ``fsync`` and an atomic rename, which object stores do not offer.

    Args:
        async_save: write in the background; ``save_checkpoint`` returns once the checkpoint is copied
            into staging buffers. At most one write is in flight: a save while one is running waits for it
            (no checkpoint is dropped). Pair it with the :class:`~ranksafe.lightning.RankSafe` callback,
            which reports a background failure on every rank within one training step; without it, the
            failure is raised on the writing rank at teardown, as stock ``AsyncCheckpointIO`` does.
            Saves after the training run's teardown (``ddp_spawn``'s final hand-over, a
            ``trainer.save_checkpoint`` after ``fit``) are synchronous: nothing would wait for them.
    """

    def __init__(self, async_save: bool = False) -> None:
        super().__init__()
        self.async_save = async_save
        self._saver: AsyncSaver | None = None
        self._lock: StateDictLock | None = None
        self._latest: str | None = None  # the path of the latest background save
        self._torn_down = False  # teardown ran: later saves are synchronous until RankSafe reopens
        self._agreed_check = False  # a RankSafe callback reports failures on every rank

    def __getstate__(self) -> dict[str, Any]:
        """``ddp_spawn`` pickles the plugin with the Trainer: threads and locks stay behind."""
        return {**self.__dict__, "_saver": None, "_lock": None, "_latest": None}

    @property
    def lock(self) -> StateDictLock:
        """Snapshots hold its read side; hold its write side while the weights change (RankSafe does)."""
        if self._lock is None:
            self._lock = StateDictLock()
        return self._lock

    @property
    def saver(self) -> AsyncSaver:
        """The background writer (created on first use, on every rank that checks or saves)."""
        if self._saver is None:
            # "all": whoever Lightning calls writes (global rank 0; the local rank 0 of a ddp_spawn worker)
            self._saver = AsyncSaver(lock=self.lock, policy="wait", writer="all", name="RankSafeCheckpointIO")
        return self._saver

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically: a reader or a crash sees the old file or the new one.

        With ``async_save`` it returns once ``checkpoint`` is snapshotted; the file appears when the
        background write commits.
        """
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                f"`{type(self).__name__}`; it writes local files only"
            )
        if not _is_local(path):
            raise ValueError(f"{type(self).__name__} writes local files only, not {path}")
        path = os.path.abspath(_local_path(path))
        if not self.async_save or self._torn_down:
            self._write(checkpoint, path)
            return
        self.wait()
        if self.saver.failed:  # never commit past a failed write: last.ckpt would name a top-k file that never came
            raise self.saver.take_error()  # type: ignore[misc]
        try:  # now, not on the writer thread: a link or copy made before the commit finds the directory
            make_dirs(os.path.dirname(path))
        except OSError as e:
            raise error_naming_target(e, "cannot save checkpoint", path) from e
        self._latest = path  # a failed snapshot is recorded for check(), and drops what waits for it
        self.saver.submit(checkpoint, functools.partial(self._write, path=path))

    def _write(self, checkpoint: dict[str, Any], path: str) -> None:
        """The commit itself, on the calling thread or the background one."""
        try:
            make_dirs(os.path.dirname(os.path.abspath(path)))
            atomic_save(checkpoint, path)
        except OSError as e:  # name the checkpoint, not the temporary file the error speaks of
            raise error_naming_target(e, "cannot save checkpoint", path) from e

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: _MapLocation = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Verify and load ``path``; :class:`~ranksafe.CorruptCheckpoint` names a torn or corrupt file.

        A background write to ``path`` still in flight is waited for first. ``weights_only=None`` leaves the
        choice to ``torch.load``, as stock Lightning does: True, unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is
        set; a file that needs ``weights_only=False`` then raises :class:`~ranksafe.UntrustedCheckpoint` saying so.
        """
        if not _is_local(path):
            raise ValueError(f"{type(self).__name__} reads local files only, not {path}")
        path = _local_path(path)
        if self.writing(path):
            self.wait()
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return load_file(path, map_location=map_location, weights_only=weights_only)

    def writing(self, path: _PATH) -> bool:
        """Whether a background write to ``path`` is in flight (the file is not there yet). Local."""
        in_flight = self._saver is not None and self._saver.in_flight
        return in_flight and self._latest == os.path.abspath(_local_path(path))

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove ``path`` (a file or a directory); a missing path is not an error, as in stock Lightning.

        While a background save is in flight the removal waits for its commit, and is dropped if that save
        fails: whatever the removal made way for never arrived, so the old checkpoint stays.
        """
        if self._deferring:
            self.saver.after_commit(functools.partial(self._remove, path))
        else:
            self._remove(path)

    def link_checkpoint(self, filepath: str, linkpath: str) -> None:
        """Point ``linkpath`` at ``filepath`` (:func:`link`); local. When ``filepath`` is still being written,
        the link is made after its commit, and not at all if that write fails: the old link stays."""
        if self._deferring and self._latest == os.path.abspath(_local_path(filepath)):
            self.saver.after_commit(functools.partial(link, filepath, linkpath))
        else:
            link(filepath, linkpath)

    def _remove(self, path: _PATH) -> None:
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)

    @property
    def _deferring(self) -> bool:
        """Whether removals and links wait for the latest background save (made in this run, before teardown)."""
        return self.async_save and not self._torn_down and self._saver is not None

    def wait(self) -> None:
        """Block until the background write in flight (if any) has committed or failed. Local."""
        if self._saver is not None:
            self._saver.wait()

    def check(self) -> None:
        """Raise :class:`~ranksafe.RankFailure` on every rank if a background write failed; collective.

        One exchange, so cheap enough for every training step; ranks that never write take part too. In a
        single process the original error is raised unchanged.
        """
        self.saver.check()

    def teardown(self) -> None:
        """Wait for the write in flight (no thread outlives the run, no save is lost); local.

        Lightning calls this on every rank at the end of a run, on success and failure alike, so it cannot
        host a collective: the RankSafe callback checks the outcome at ``on_fit_end``. Without that callback
        a background failure is raised here, on the writing rank.
        """
        if self._saver is not None:
            self._saver.shutdown()
        self._torn_down = True
        if self.async_save and not self._agreed_check and self._saver is not None and self._saver.failed:
            if topology.world_size() == 1:
                self._saver.check()  # one process: raises the original error and marks it reported
            raise self._saver.take_error()  # type: ignore[misc]  # other ranks may be gone: no collective here

    def _attach(self) -> None:
        """Called by RankSafe at setup: a run begins (saves are asynchronous again) and RankSafe checks."""
        self._torn_down = False
        self._agreed_check = True
