"""``RankSafe``: the Lightning callback that turns a failed or diverging checkpoint step into one error on all ranks.

Lightning's ``Trainer.save_checkpoint`` runs on every rank, lets global rank 0 write, then waits in a
barrier: when rank 0's write raises, rank 0 never reaches the barrier and the others wait until the
process-group timeout (30 minutes by default), or die with gloo's "Connection closed by peer" once rank 0
exits, never learning why. From ``setup`` on, this callback guards the strategy of its Trainer:

* ``save_checkpoint`` / ``remove_checkpoint`` run inside :class:`ranksafe.together`: the writer's outcome
  reaches every rank at once, and a failure is raised on all ranks as :class:`~ranksafe.RankFailure`
  naming the rank and its error. This covers ModelCheckpoint and ``trainer.save_checkpoint`` from user code.
* ``load_checkpoint`` loads the path rank 0 chose (``ckpt_path="last"`` is resolved on each rank, before
  the process group exists, from file modification times) and shares the outcome: a corrupt file raises
  :class:`~ranksafe.CorruptCheckpoint` on every rank, not on some while the others train on.
* ModelCheckpoint and EarlyStopping read their monitored metric through :class:`MonitorAgreement`, so a
  metric logged without ``sync_dist=True`` gives one decision and one file name on every rank.
* An exception on one rank (``on_exception``) is posted with :func:`ranksafe.abort`: ranks waiting in a
  ranksafe collective raise within seconds instead of waiting for the timeout.
* With ``RankSafeCheckpointIO(async_save=True)``: the optimizer step holds the write side of the plugin's
  :class:`~ranksafe.StateDictLock`, every training step ends with the plugin's agreed
  :meth:`~ranksafe.lightning.RankSafeCheckpointIO.check` (a background failure is raised on every rank
  within one step), a load first waits for the write in flight, and ``on_fit_end`` (after the plugin's
  teardown waited for the last write) checks once more.
* With ``checkpoint_dir``: the Trainer's full checkpoint goes into a :class:`~ranksafe.CheckpointManager`
  every ``every_n_epochs`` epochs (atomic step directories, retention, a copy on every node under
  node-local storage), and ``resume=True`` starts ``fit`` from the latest step committed on every node.

In a single process nothing is wrapped: behaviour and files are stock Lightning's.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback, Checkpoint, EarlyStopping, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from .. import topology
from ..async_save import check_savers
from ..checkpoint import STATE, CheckpointManager
from ..collectives import abort, agree, broadcast, together
from ..files import clean_orphans
from ..saving import prepare_dir
from ..snapshot import StateDictLock
from ..storage import Storage
from .io import RankSafeCheckpointIO, link
from .monitor import MonitorAgreement, MonitorOp

_GUARDED = "_ranksafe_guarded"


def _shared() -> bool:
    """True when other ranks exist to share outcomes with (never in a ``ddp_spawn`` parent, for instance)."""
    return topology.is_distributed() and topology.world_size() > 1


def _inside(path: Any, directory: str) -> bool:
    if path is None or "://" in str(path):
        return False
    path, directory = os.path.abspath(os.fspath(path)), os.path.abspath(directory)
    return os.path.commonpath([path, directory]) == directory


def _find_io(checkpoint_io: CheckpointIO | None) -> RankSafeCheckpointIO | None:
    """The RankSafeCheckpointIO in the strategy's plugin, looking inside wrappers (``AsyncCheckpointIO``)."""
    seen = 0
    while checkpoint_io is not None and seen < 8:
        if isinstance(checkpoint_io, RankSafeCheckpointIO):
            return checkpoint_io
        checkpoint_io, seen = getattr(checkpoint_io, "checkpoint_io", None), seen + 1
    return None


def _async_io(trainer: pl.Trainer) -> RankSafeCheckpointIO | None:
    io = _find_io(trainer.strategy.checkpoint_io)
    return io if io is not None and io.async_save else None


def _guard_strategy(trainer: pl.Trainer, callback: RankSafe) -> None:
    """Wrap the strategy's save/remove/load so that their outcome is shared by every rank."""
    strategy = trainer.strategy
    if getattr(strategy, _GUARDED, False):
        return
    save, remove, load = strategy.save_checkpoint, strategy.remove_checkpoint, strategy.load_checkpoint
    timeout = callback.timeout

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not _shared():
            return save(checkpoint, filepath, storage_options=storage_options)
        with together("Trainer.save_checkpoint", timeout):
            save(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(filepath: Any) -> None:
        if not _shared():
            return remove(filepath)
        with together("Trainer.remove_checkpoint", timeout):
            remove(filepath)

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if not _shared():
            step = callback._managed_step(checkpoint_path)
            if step is not None:
                return callback.manager.load(step, weights_only=weights_only)  # type: ignore[union-attr]
            return load(checkpoint_path, weights_only=weights_only)
        io = _async_io(trainer)
        if io is not None:  # the file may be the one rank 0 is still writing: every rank waits for it
            io.wait()
            io.check()
        chosen = broadcast(checkpoint_path, name="Trainer.load_checkpoint path", timeout=timeout)
        if os.fspath(chosen) != os.fspath(checkpoint_path):
            warnings.warn(
                f"rank {topology.rank()} resolved the checkpoint to {checkpoint_path}, rank 0 to {chosen}; "
                "every rank loads rank 0's choice",
                stacklevel=2,
            )
            trainer._checkpoint_connector._ckpt_path = chosen
        step = callback._managed_step(chosen)
        if step is not None:  # verified against its manifest on every node, the outcome agreed
            return callback.manager.load(step, weights_only=weights_only)  # type: ignore[union-attr]
        result: dict[str, Any] = {}
        with together("Trainer.load_checkpoint", timeout):
            result = load(chosen, weights_only=weights_only)
        return result

    strategy.save_checkpoint = save_checkpoint
    strategy.remove_checkpoint = remove_checkpoint
    strategy.load_checkpoint = load_checkpoint
    setattr(strategy, _GUARDED, True)


def _wrap_once(obj: Any, method: str, wrap: Callable[[Callable], Callable]) -> None:
    if method not in vars(obj):  # not yet wrapped on this instance
        setattr(obj, method, wrap(getattr(obj, method)))


def _counting_writes_in_flight(checkpoint: ModelCheckpoint, io: RankSafeCheckpointIO) -> Callable[[Callable], Callable]:
    """``ModelCheckpoint.file_exists`` that counts a file still being written in the background as existing.

    ModelCheckpoint names a new version (``ckpt-v1.ckpt``) when the name it wants exists; with background writes
    the previous file does not exist yet when the next save asks, so the next save took the same name and
    overwrote it. Same collective as Lightning's: rank 0 (the writer) decides, every rank learns the answer.
    """

    def wrap(_: Callable) -> Callable:
        def file_exists(filepath: Any, trainer: pl.Trainer) -> bool:
            mine = trainer.is_global_zero and (io.writing(filepath) or checkpoint._fs.exists(filepath))
            return trainer.strategy.reduce_boolean_decision(bool(mine), all=False)

        return file_exists

    return wrap


def _linking(timeout: float | None) -> Callable[[Callable], Callable]:
    """``ModelCheckpoint._link_checkpoint`` (``save_last="link"``) made safe: with background writes the link
    to a file still being written is made after its commit (and not at all if the write fails, so the old link
    stays); the link replaces the old one atomically; and rank 0's outcome reaches every rank instead of the
    stock barrier, which left the others waiting when the link failed."""

    def wrap(_: Callable) -> Callable:
        def link_checkpoint(trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
            shared = together("ModelCheckpoint link", timeout) if _shared() else contextlib.nullcontext()
            with shared:
                if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
                    io = _async_io(trainer)
                    if io is not None:
                        io.link_checkpoint(filepath, linkpath)
                    else:
                        link(filepath, linkpath)

        return link_checkpoint

    return wrap


def _then(after: Callable[[pl.Trainer], None]) -> Callable[[Callable], Callable]:
    """An ``on_train_epoch_end`` followed by ``after(trainer)``."""

    def wrap(hook: Callable) -> Callable:
        def on_train_epoch_end(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            hook(trainer, pl_module)
            after(trainer)

        return on_train_epoch_end

    return wrap


def _holding(locks: list[StateDictLock]) -> Callable[[Callable], Callable]:
    """``optimizer_step`` wrapped in the write side of ``locks``: no snapshot sees weights mid-update."""

    def wrap(step: Callable) -> Callable:
        def optimizer_step(*args: Any, **kwargs: Any) -> Any:
            with contextlib.ExitStack() as held:
                for lock in locks:
                    held.enter_context(lock.write())
                return step(*args, **kwargs)

        return optimizer_step

    return wrap


class RankSafe(Callback):
    """Make Lightning checkpointing safe under DDP: ``Trainer(callbacks=[RankSafe(), ModelCheckpoint(...)])``.

    Pair it with ``plugins=[RankSafeCheckpointIO()]`` for atomic, fsynced, checksummed files, or
    ``RankSafeCheckpointIO(async_save=True)`` to write them in the background.

    Args:
        overwrite: empty every ModelCheckpoint directory before training (collectively, by rank 0 only,
            via :func:`ranksafe.prepare_dir`), unless the run resumes from a file inside it. With the default
            False the directory is left to Lightning, which creates it at the first save on rank 0.
        monitor_op: how a monitored metric that differs across ranks becomes one value: ``"mean"`` (what
            ``sync_dist=True`` would log), ``"main"`` (rank 0's), ``"max"`` or ``"min"``.
        timeout: seconds a rank waits for the others in a shared save/load (default: ranksafe's,
            ``RANKSAFE_TIMEOUT`` or 30 minutes); past it every rank raises :class:`~ranksafe.BarrierTimeout`.
        checkpoint_dir: save the Trainer's full checkpoint (what ``trainer.save_checkpoint`` writes: weights,
            optimizers, loops, callbacks) at the end of every ``every_n_epochs``-th training epoch into a
            :class:`~ranksafe.CheckpointManager` under this directory. The step number is
            ``trainer.global_step`` (optimizer steps so far), so it grows across epochs and resumed runs. The
            save comes right after the last ModelCheckpoint's or EarlyStopping's ``on_train_epoch_end`` (which
            Lightning runs after every other callback's): their state in the step is that of this epoch, as in a
            ModelCheckpoint file saved then.
        keep: committed steps to keep under ``checkpoint_dir`` (``None``: all).
        every_n_epochs: save every this many epochs.
        storage: ``"auto"`` probes whether ``checkpoint_dir`` is shared by every rank or local to each node
            (then every node keeps its own copy); ``"shared"`` / ``"local"`` say so.
        resume: ``trainer.fit(model)`` without ``ckpt_path`` starts from the latest step committed on every
            node (:meth:`latest_checkpoint`), or from scratch when there is none. An explicit ``ckpt_path``
            wins.
        async_save: the manager commits each step in the background (``CheckpointManager(async_save=True)``):
            the epoch end waits only for the snapshot; a failed commit is raised on every rank at the end of
            the next training step, and ``on_fit_end`` waits for the last one.
    """

    def __init__(
        self,
        overwrite: bool = False,
        monitor_op: MonitorOp = "mean",
        timeout: float | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        keep: int | None = 3,
        every_n_epochs: int = 1,
        storage: Storage = "auto",
        resume: bool = False,
        async_save: bool = False,
    ):
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be a positive int, not {every_n_epochs!r}")
        if resume and checkpoint_dir is None:
            raise ValueError("resume=True needs a checkpoint_dir to resume from")
        self.overwrite = overwrite
        self.monitors = MonitorAgreement(monitor_op)
        self.timeout = timeout
        self.every_n_epochs = every_n_epochs
        self.resume = resume
        self._manager_args = None if checkpoint_dir is None else (checkpoint_dir, keep, storage, timeout, async_save)
        self.lock = StateDictLock()  # the manager's snapshots take its read side; optimizer steps its write side
        self.manager = self._new_manager()
        self._io: RankSafeCheckpointIO | None = None  # the async plugin of the current run, if any
        self._after_monitors = False  # the epoch's step is saved after the last monitoring callback's epoch end

    def _new_manager(self) -> CheckpointManager | None:
        if self._manager_args is None:
            return None
        root, keep, storage, timeout, async_save = self._manager_args
        return CheckpointManager(root, keep, storage, timeout=timeout, async_save=async_save, lock=self.lock)

    def __getstate__(self) -> dict[str, Any]:
        """``ddp_spawn`` pickles the callbacks with the Trainer: locks and threads are made anew in the worker."""
        return {**self.__dict__, "lock": None, "manager": None, "_io": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = StateDictLock()
        self.manager = self._new_manager()

    def latest_checkpoint(self) -> str | None:
        """The file of the newest step committed on every node, the same on every rank, or None; collective.

        Under Lightning's own ``ddp`` launcher the process group exists only inside ``fit``: use
        ``resume=True`` there. With ``torchrun`` (the group initialised before the Trainer) you may pass
        ``ckpt_path=rank_safe.latest_checkpoint()`` yourself.
        """
        if self.manager is None:
            raise ValueError("latest_checkpoint() needs RankSafe(checkpoint_dir=...)")
        step = self.manager.latest()
        return None if step is None else os.path.join(self.manager.step_dir(step), STATE)

    @property
    def _async_manager(self) -> bool:
        return self.manager is not None and self.manager.async_save

    def _managed_step(self, path: Any) -> int | None:
        """The step whose state file ``path`` is, when it lies in this callback's checkpoint_dir."""
        if self.manager is None or path is None or "://" in str(path):
            return None
        step_dir, name = os.path.split(os.path.abspath(os.fspath(path)))
        root, step_name = os.path.split(step_dir)
        digits = step_name[len(self.manager.prefix) :]
        if name != STATE or root != self.manager.root or not digits.isdigit():
            return None
        return int(digits) if self.manager.step_dir(int(digits)) == step_dir else None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Runs on every rank once the process group exists, before any checkpoint is loaded or saved."""
        _guard_strategy(trainer, self)
        self._io = _async_io(trainer)
        if self._io is not None:
            self._io._attach()
        locks = [self._io.lock] if self._io is not None else []
        if self._async_manager:
            locks.append(self.lock)
        if locks:
            _wrap_once(trainer.strategy, "optimizer_step", _holding(locks))
        if self.resume:
            _wrap_once(trainer._checkpoint_connector, "_restore_modules_and_callbacks", self._resuming(trainer))
        if self.manager is not None:
            # Lightning runs the monitoring callbacks' epoch end after every other callback's, and ModelCheckpoint
            # and EarlyStopping update their state there: saved in this callback's own, the step held their state
            # of the epoch before (a resumed ModelCheckpoint lost track of its newest top-k file)
            monitors = [cb for cb in trainer.callbacks if isinstance(cb, (EarlyStopping, Checkpoint))]
            self._after_monitors = bool(monitors)
            if monitors:
                _wrap_once(monitors[-1], "on_train_epoch_end", _then(self._save_step))
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint):
                _wrap_once(cb, "_link_checkpoint", _linking(self.timeout))
                if self._io is not None and self._io.async_save:
                    _wrap_once(cb, "file_exists", _counting_writes_in_flight(cb, self._io))
        if not _shared():
            return
        for cb in trainer.callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.monitor:
                _wrap_once(cb, "_monitor_candidates", lambda f, m=cb.monitor: self.monitors.wrap_candidates(f, m))
            elif isinstance(cb, EarlyStopping):
                _wrap_once(cb, "_evaluate_stopping_criteria", lambda f, m=cb.monitor: self.monitors.wrap_criteria(f, m))

    def _resuming(self, trainer: pl.Trainer) -> Callable[[Callable], Callable]:
        """The connector's restore, with ``ckpt_path=None`` replaced by the agreed latest step (fit only)."""

        def wrap(restore: Callable) -> Callable:
            def restore_latest(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
                fitting = trainer.state.fn == TrainerFn.FITTING  # the same on every rank
                if checkpoint_path is None and fitting:  # every rank is here, inside the process group
                    checkpoint_path = self.latest_checkpoint()
                return restore(checkpoint_path, weights_only)

            return restore_latest

        return wrap

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """A background write that failed is raised on every rank now, not at the next save.

        One exchange per step for the plugin's and the manager's savers together.
        """
        savers = [self._io.saver] if self._io is not None else []
        if self._async_manager:
            savers.append(self.manager.saver)  # type: ignore[union-attr]
        if savers:
            check_savers(savers, "RankSafe")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every ``every_n_epochs`` epochs, the Trainer's full checkpoint becomes a committed manager step: here
        when no monitoring callback comes after this one, else right after the last of them (see ``setup``)."""
        if not self._after_monitors:
            self._save_step(trainer)

    def _save_step(self, trainer: pl.Trainer) -> None:
        if self.manager is None or (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)  # what save_checkpoint writes
        self.manager.save(trainer.global_step, checkpoint)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The plugin's teardown (before this hook) waited for the last write: report its outcome everywhere."""
        if self._io is not None:
            if self._io is not trainer.strategy.checkpoint_io:  # inside a wrapper, which does not pass teardown on
                self._io.teardown()
            self._io.check()
        if self._async_manager:
            self.manager.close()  # type: ignore[union-attr]  # waits for the last step's commit, then checks

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A rank failing alone stops the others at their current or next ranksafe collective, within seconds."""
        abort(exception)
        if self.manager is not None:
            self.manager.shutdown()  # a step being committed in the background is not lost; no thread stays

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """ModelCheckpoint resolved its directory in its own ``setup``: prepare it now, before the first save."""
        for cb in trainer.checkpoint_callbacks:
            if not isinstance(cb, ModelCheckpoint) or not cb.dirpath or "://" in str(cb.dirpath):
                continue
            dirpath = os.fspath(cb.dirpath)
            # ckpt_path="last" is resolved by each rank on its own: agree before taking a collective branch
            resuming_here = self.overwrite and agree(_inside(trainer.ckpt_path, dirpath), "any", name="resume dir")
            if self.overwrite and not resuming_here:
                prepare_dir(dirpath, overwrite=True)
            elif self.overwrite and topology.is_main():
                warnings.warn(f"RankSafe(overwrite=True) keeps {dirpath}: the run resumes from it", stacklevel=2)
            if topology.is_main():  # temporaries of writers that crashed (a killed run) go before new ones appear
                clean_orphans(dirpath)
