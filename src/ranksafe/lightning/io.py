"""``RankSafeCheckpointIO``: Lightning's CheckpointIO with ranksafe's atomic, checksummed files.

Stock ``TorchCheckpointIO`` serialises the whole checkpoint into memory first, writes its temporary file in
``$TMPDIR`` (a rename across file systems is a copy a crash can tear) and never fsyncs. This plugin streams
``torch.save`` into a temporary file beside the target, fsyncs and renames it, and verifies the CRC footer on
load. Its calls are local: Lightning makes them on global rank 0 only (under ``ddp_spawn``, from a parent without
a process group); sharing their outcome is the RankSafe callback's job.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins import CheckpointIO

from .. import remote, topology
from ..async_save import AsyncSaver
from ..checkpoint_file import load_file, save_file
from ..errors import naming_target
from ..files import atomic_link, local_path, make_dirs
from ..lock import StateDictLock

PathLike = str | os.PathLike


class RankSafeCheckpointIO(CheckpointIO):
    """Atomic, fsynced, checksummed checkpoint files for Lightning; ``Trainer(plugins=[RankSafeCheckpointIO()])``.

    Files stay loadable by stock ``torch.load`` and ``LightningModule.load_from_checkpoint`` (the footer sits
    after the zip archive). Paths may be fsspec URLs (``s3://``, ``gs://``, ``memory://``; ``http://`` to load),
    with ``storage_options`` for their file system, as stock Lightning takes them.

    Args:
        async_save: write in the background (:class:`~ranksafe.AsyncSaver`); ``save_checkpoint`` returns once
            the checkpoint is copied into reused staging buffers, under the read side of :attr:`lock`. A save
            while a write is in flight waits for it. Unlike stock ``AsyncCheckpointIO``, removing the previous
            checkpoint (top-k, ``last.ckpt``) waits for the new one's commit and is dropped if it fails, and with
            the :class:`~ranksafe.lightning.RankSafe` callback a failure is raised on every rank within one
            training step (without it: on the writing rank, at teardown). Saves after teardown (``ddp_spawn``'s
            hand-over, ``trainer.save_checkpoint`` after ``fit``) are synchronous: nothing would wait for them.
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

    @property
    def _deferring(self) -> bool:
        """Whether removals and links wait for the latest background save (made in this run, before teardown)."""
        return self.async_save and not self._torn_down and self._saver is not None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically: a reader or a crash sees the old file or the new one.
        With ``async_save`` it returns once ``checkpoint`` is snapshotted."""
        path = remote.canonical(path)
        if storage_options is not None and not remote.is_url(path):  # as stock TorchCheckpointIO
            raise TypeError(f"storage_options are for the file system of a URL; {path} is a local path")
        if not self.async_save or self._torn_down:
            self._write(checkpoint, path, storage_options=storage_options)
            return
        self.wait()
        if self.saver.failed:  # never commit past a failed write: last.ckpt would name a top-k file that never came
            raise self.saver.take_error()  # type: ignore[misc]
        if not remote.is_url(path):  # now, not on the writer thread: a link or copy made before the commit finds it
            with naming_target("cannot save checkpoint", path):
                make_dirs(os.path.dirname(path))
        self._latest = path
        write = functools.partial(self._write, path=path, storage_options=storage_options)
        self.saver.submit(checkpoint, write)  # a failed snapshot: for check()

    def _write(self, checkpoint: dict[str, Any], path: str, storage_options: Any | None = None) -> None:
        """The commit itself, on the calling thread or the background one."""
        save_file(checkpoint, path, storage_options, action="cannot save checkpoint")

    def load_checkpoint(
        self,
        path: PathLike,
        map_location: Callable | str | dict | None = lambda storage, loc: storage,  # as stock: on the CPU
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Verify and load ``path`` (after its write in flight); a torn or corrupt file raises
        :class:`~ranksafe.CorruptCheckpoint` naming it. ``weights_only=None`` leaves the choice to ``torch.load``,
        as stock Lightning does; a file that needs False then raises :class:`~ranksafe.UntrustedCheckpoint`."""
        if self.writing(path):
            self.wait()
        if not remote.is_url(path) and not os.path.exists(local_path(path)):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return load_file(path, map_location=map_location, weights_only=weights_only)

    def writing(self, path: PathLike) -> bool:
        """Whether a background write to ``path`` is in flight (the file is not there yet). Local."""
        in_flight = self._saver is not None and self._saver.in_flight
        return in_flight and self._latest == remote.canonical(path)

    def remove_checkpoint(self, path: PathLike) -> None:
        """Remove ``path`` (a file or a directory; missing is fine, as stock). With a background save in flight,
        after its commit, and not at all if it fails: the removal made way for a checkpoint that never came."""
        if self._deferring:
            self.saver.after_commit(functools.partial(self._remove, path))
        else:
            self._remove(path)

    def link_checkpoint(self, filepath: str, linkpath: str) -> None:
        """Point ``linkpath`` at ``filepath``; local. When ``filepath`` is the background save in flight, the link
        follows its commit, and is not made if it fails: the old link stays."""
        if self._deferring and self._latest == remote.canonical(filepath):
            self.saver.after_commit(functools.partial(atomic_link, filepath, linkpath))
        else:
            atomic_link(filepath, linkpath)

    def _remove(self, path: PathLike) -> None:
        """The removal itself, on the calling thread or the background one."""
        remote.remove(remote.canonical(path))  # "~" and "file://" as save_checkpoint takes them

    def wait(self) -> None:
        """Block until the background write in flight (if any) has committed or failed. Local."""
        if self._saver is not None:
            self._saver.wait()

    def check(self) -> None:
        """Raise :class:`~ranksafe.RankFailure` on every rank if a background write failed; collective (one
        exchange). In a single process the original error is raised unchanged."""
        self.saver.check()

    def teardown(self) -> None:
        """Wait for the write in flight (no thread outlives the run); local. Lightning calls it on every rank at
        the end of a run, success or failure, so it cannot host a collective: RankSafe checks at ``on_fit_end``.
        Without RankSafe, a background failure is raised here, on the writing rank."""
        if self._saver is not None:
            self._saver.shutdown()
        self._torn_down = True
        if self.async_save and not self._agreed_check and self._saver is not None and self._saver.failed:
            if topology.world_size() == 1:
                self._saver.check()  # one process: raises the original error and marks it reported
            raise self._saver.take_error()  # type: ignore[misc]  # other ranks may be gone: no collective here

    def _attach(self, timeout: float | None) -> None:
        """Called by RankSafe at setup: a run begins (saves are asynchronous again) and RankSafe checks, waiting
        ``timeout`` (RankSafe's) for the other ranks."""
        self._torn_down = False
        self._agreed_check = True
        if self.async_save:
            self.saver.timeout = timeout
