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
  ranksafe collective raise at once instead of waiting for the timeout.

In a single process nothing is wrapped: behaviour and files are stock Lightning's.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint

from .. import topology
from ..collectives import abort, agree, broadcast, together
from ..files import clean_orphans
from ..saving import prepare_dir
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


def _guard_strategy(trainer: pl.Trainer, timeout: float | None) -> None:
    """Wrap the strategy's save/remove/load so that their outcome is shared by every rank."""
    strategy = trainer.strategy
    if getattr(strategy, _GUARDED, False):
        return
    save, remove, load = strategy.save_checkpoint, strategy.remove_checkpoint, strategy.load_checkpoint

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
            return load(checkpoint_path, weights_only=weights_only)
        chosen = broadcast(checkpoint_path, name="Trainer.load_checkpoint path", timeout=timeout)
        if os.fspath(chosen) != os.fspath(checkpoint_path):
            warnings.warn(
                f"rank {topology.rank()} resolved the checkpoint to {checkpoint_path}, rank 0 to {chosen}; "
                "every rank loads rank 0's choice",
                stacklevel=2,
            )
            trainer._checkpoint_connector._ckpt_path = chosen
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


class RankSafe(Callback):
    """Make Lightning checkpointing safe under DDP: ``Trainer(callbacks=[RankSafe(), ModelCheckpoint(...)])``.

    Pair it with ``plugins=[RankSafeCheckpointIO()]`` for atomic, fsynced, checksummed files.

    Args:
        overwrite: empty every ModelCheckpoint directory before training (collectively, by rank 0 only,
            via :func:`ranksafe.prepare_dir`), unless the run resumes from a file inside it. With the default
            False the directory is left to Lightning, which creates it at the first save on rank 0.
        monitor_op: how a monitored metric that differs across ranks becomes one value: ``"mean"`` (what
            ``sync_dist=True`` would log), ``"main"`` (rank 0's), ``"max"`` or ``"min"``.
        timeout: seconds a rank waits for the others in a shared save/load (default: ranksafe's,
            ``RANKSAFE_TIMEOUT`` or 30 minutes); past it every rank raises :class:`~ranksafe.BarrierTimeout`.
    """

    def __init__(self, overwrite: bool = False, monitor_op: MonitorOp = "mean", timeout: float | None = None):
        self.overwrite = overwrite
        self.monitors = MonitorAgreement(monitor_op)
        self.timeout = timeout

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Runs on every rank once the process group exists, before any checkpoint is loaded or saved."""
        _guard_strategy(trainer, self.timeout)
        if not _shared():
            return
        for cb in trainer.callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.monitor:
                _wrap_once(cb, "_monitor_candidates", lambda f, m=cb.monitor: self.monitors.wrap_candidates(f, m))
            elif isinstance(cb, EarlyStopping):
                _wrap_once(cb, "_evaluate_stopping_criteria", lambda f, m=cb.monitor: self.monitors.wrap_criteria(f, m))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A rank failing alone stops the others at their current or next ranksafe collective, at once."""
        abort(exception)

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
