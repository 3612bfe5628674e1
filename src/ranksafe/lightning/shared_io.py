"""What RankSafe runs in place of the Trainer's checkpoint I/O during a run: the strategy's save, remove and load and
the optimizer step, the checkpoint connector's ``resume_start``, ModelCheckpoint's link and ``file_exists``.

:class:`SharedCheckpointIO` is a base class of :class:`~ranksafe.lightning.RankSafe`, which wraps those methods at
``setup`` (:mod:`.wrapped`). Each of its methods takes ``original``, the method it replaces; they are methods of
RankSafe, not closures, so that what is installed on Lightning's objects pickles with the Trainer.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from .. import remote, topology
from ..checkpoint import CheckpointManager
from ..collectives import agree, broadcast, default_timeout, together
from ..files import atomic_link
from ..lock import StateDictLock
from ..monitor import MonitorAgreement
from ..saving import prepare_dir
from . import compat
from .io import RankSafeCheckpointIO
from .steps import TrainerSteps

EXCEPTION_SAVE_WAIT = 30.0
"""At most this many seconds a save made while Lightning handles an exception (ModelCheckpoint's
``save_on_exception``) waits for the other ranks. Ranks that failed alike (a signal, one bad batch) arrive; a rank that
failed alone would otherwise wait for ranks held in a DDP collective that only its own exit ends."""


def shared_outcome(name: str, timeout: float | None) -> contextlib.AbstractContextManager:
    """A block whose failure on one rank is raised on every rank; a plain block without other ranks."""
    return together(name, timeout) if topology.with_other_ranks() else contextlib.nullcontext()


def checkpoint_dirs(trainer: pl.Trainer) -> dict[str, bool]:
    """The directories of the Trainer's ModelCheckpoints (resolved in their ``setup``), each with whether its callback
    names files there already (an earlier ``fit`` of this Trainer saved them: its best, top-k and last paths)."""
    dirs: dict[str, bool] = {}
    for cb in trainer.checkpoint_callbacks:
        dirpath = getattr(cb, "dirpath", None)  # a stand-in (a Mock with a spec) may have none
        if isinstance(cb, ModelCheckpoint) and dirpath:
            named = bool(cb.best_model_path or cb.last_model_path or cb.best_k_models)
            dirs[os.fspath(dirpath)] = dirs.get(os.fspath(dirpath), False) or named
    return dirs


class SharedCheckpointIO:
    """The replacements RankSafe installs: every rank shares the outcome of a checkpoint's save, removal, load and
    link, and takes rank 0's checkpoint path. What they read is RankSafe's, set in its ``__init__`` and ``setup``."""

    timeout: float | None
    resume: bool
    overwrite: bool
    lock: StateDictLock
    steps: TrainerSteps | None
    _io: RankSafeCheckpointIO | None  # the async plugin of the current run, if any
    _failed: bool  # Lightning is handling an exception of this stage: its saves wait less for the others
    manager: CheckpointManager | None
    monitors: MonitorAgreement
    _stopping_read: tuple[dict[str, Any], str, Any] | None  # EarlyStopping's metrics, its monitor, this rank's value

    def _wait(self) -> float | None:
        """How long a collective of RankSafe waits for the other ranks: less while an exception is handled
        (:data:`EXCEPTION_SAVE_WAIT`), where a rank that failed alone would wait for ranks that never come."""
        return min(self.timeout or default_timeout(), EXCEPTION_SAVE_WAIT) if self._failed else self.timeout

    def _together(self, name: str, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The strategy's save or remove with its outcome shared by every rank."""
        with together(name, self._wait()):
            return original(*args, **kwargs)

    def _agreed_candidates(self, cb: ModelCheckpoint, read: Callable[..., Any], trainer: pl.Trainer) -> dict[str, Any]:
        """ModelCheckpoint's read of the metrics, with the monitored one and those that name its files agreed by every
        rank (:meth:`~ranksafe.lightning.MonitorAgreement.agree_all`); the others, which it does not use, stay each
        rank's own."""
        templates = f"{cb.filename or ''} {cb.CHECKPOINT_NAME_LAST or ''}"
        names = {cb.monitor, *re.findall(r"\{([^:}]*)", templates)} - {None}
        return self.monitors.agree_all(read(trainer), names, self._wait(), reader="ModelCheckpoint")

    def _agreed_condition(self, monitor: str, validate: Callable[..., Any], logs: dict[str, Any]) -> bool:
        """EarlyStopping's check that the monitored metric was logged, made of the value every rank agreed. A rank
        that did not log it checks the others' value (stock Lightning skips the check there, and the other ranks wait
        for its stop decision); when no rank logged it, every rank answers alike. The agreed value stays in ``logs``
        (the trainer's metrics) for Lightning's next read only, the stopping criteria's (:meth:`_agreed_criteria`)."""
        own = logs.get(monitor)
        agreed = self.monitors.agree(monitor, own, self._wait())
        if agreed is not None:
            logs[monitor] = agreed
            self._stopping_read = (logs, monitor, own)
        return validate(logs)

    def _agreed_criteria(self, evaluate: Callable[..., Any], current: Any) -> Any:
        """EarlyStopping's stopping criteria, of the agreed value Lightning just read (:meth:`_agreed_condition`); the
        trainer's metrics hold this rank's own value again first (none, where it logged none)."""
        if self._stopping_read is not None:
            logs, monitor, own = self._stopping_read
            self._stopping_read = None
            if own is None:
                logs.pop(monitor, None)
            else:
                logs[monitor] = own
        return evaluate(current)

    def _load(
        self, trainer: pl.Trainer, original: Callable[..., Any], checkpoint_path: Any, weights_only: bool | None = None
    ) -> Any:
        """The strategy's load: a step of the manager is verified against its manifest on every node, a file is
        loaded with the outcome shared; a background write in flight is waited for on every rank first."""
        if topology.with_other_ranks() and self._io is not None:
            self._io.wait()
            self._io.check()
        step = None if self.manager is None or checkpoint_path is None else self.manager.step_of(checkpoint_path)
        if step is not None:
            return self.steps.load(trainer, step, checkpoint_path, weights_only, original)  # type: ignore[union-attr]
        with shared_outcome("Trainer.load_checkpoint", self.timeout):
            return original(checkpoint_path, weights_only=weights_only)

    def _resume_start(
        self, trainer: pl.Trainer, original: Callable[..., Any], checkpoint_path: Any = None, weights_only: Any = None
    ) -> Any:
        """The connector's ``resume_start``: every rank takes rank 0's path; ``resume=True`` fills in the latest
        step when ``fit`` has none."""
        if topology.with_other_ranks():
            chosen = broadcast(checkpoint_path, name="Trainer ckpt_path", timeout=self.timeout)
            if str(chosen) != str(checkpoint_path):
                warnings.warn(
                    f"rank {topology.rank()} resolved the checkpoint to {checkpoint_path}, rank 0 to {chosen}; "
                    "every rank loads rank 0's choice",
                    stacklevel=2,
                )
            checkpoint_path = chosen
        fitting = trainer.state.fn == TrainerFn.FITTING
        # a later fit of the same Trainer goes on from its progress in memory, as it does without RankSafe
        fresh = compat.trained_batches(trainer) == 0
        resuming = checkpoint_path is None and self.resume and fitting and fresh and self.steps is not None
        path = self.steps.resuming() if resuming else contextlib.nullcontext(checkpoint_path)  # type: ignore[union-attr]
        with path as checkpoint_path:
            if self.overwrite and fitting:  # the path is agreed by now (and before any save, whatever the strategy)
                self._overwrite(trainer, resuming=checkpoint_path is not None)
            return original(checkpoint_path, weights_only=weights_only)

    def _overwrite(self, trainer: pl.Trainer, resuming: bool) -> None:
        """``overwrite=True``: empty every ModelCheckpoint directory, unless the fit resumes or an earlier ``fit`` of
        this Trainer saved there: the restored, or kept, state names files there, as ``best_model_path`` does."""
        for dirpath, named in checkpoint_dirs(trainer).items():
            if topology.with_other_ranks():  # prepare_dir is collective: every rank keeps or empties alike
                named = agree(named, "any", name=f"checkpoints named in {dirpath}", timeout=self.timeout)
            if not (resuming or named):
                prepare_dir(dirpath, overwrite=True)
            elif topology.is_main():
                why = "the run resumes" if resuming else "an earlier fit of this Trainer saved there"
                warnings.warn(f"RankSafe(overwrite=True) keeps {dirpath}: {why}", stacklevel=3)

    def _locks(self) -> list[StateDictLock]:
        """The locks whose snapshots run in the background: the plugin's and the manager's, with ``async_save``."""
        locks = [self._io.lock] if self._io is not None else []
        return locks + ([self.lock] if self.manager is not None and self.manager.saver is not None else [])

    def _holding_locks(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The optimizer step, holding the write side of the snapshot locks: no snapshot sees weights mid-update."""
        with contextlib.ExitStack() as held:
            for lock in self._locks():
                held.enter_context(lock.write())
            return original(*args, **kwargs)

    def _link(self, original: Callable[..., Any], trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
        """ModelCheckpoint's ``save_last="link"``: the link replaces the old one atomically, waits for a background
        write's commit (and is not made if it fails: the old link stays), and rank 0's outcome reaches every rank
        instead of the stock barrier, which left the others waiting when the link failed."""
        with shared_outcome("ModelCheckpoint link", self.timeout):
            if trainer.is_global_zero and remote.canonical(filepath) != remote.canonical(linkpath):
                if self._io is not None:
                    self._io.link_checkpoint(filepath, linkpath)
                else:
                    atomic_link(filepath, linkpath)

    def _file_exists(self, original: Callable[..., Any], filepath: Any, trainer: pl.Trainer) -> bool:
        """``ModelCheckpoint.file_exists`` that counts a file still being written in the background as existing:
        else the next save takes the same name (no ``-v1``) and overwrites it. Rank 0 decides, as in Lightning."""
        mine = trainer.is_global_zero and (self._io.writing(filepath) or remote.exists(filepath))  # type: ignore[union-attr]
        return trainer.strategy.reduce_boolean_decision(bool(mine), all=False)
