"""The ``RankSafe`` callback: ``Learner(..., cbs=RankSafe())`` makes fastai's files and decisions rank-safe.

Attached to a Learner, it gives that instance the collective writers and readers of :mod:`.learner`, ``resume``,
and a ``fit`` whose error on one rank reaches every rank. During a fit on several ranks:

* every rank takes rank 0's epoch record before any tracker reads it, so trackers decide alike;
* every epoch starts with a barrier: an error in one rank's callbacks stops the others before the next gradient
  all-reduce, where they would hang;
* ``CSVLogger``, ``lr_find`` and ``TerminateOnNaNCallback`` act as one job (:mod:`.guards`).

With ``checkpoint_dir=`` the training state (:mod:`.training_state`) goes into steps of a
:class:`~ranksafe.CheckpointManager`, also inside epochs with ``preemption`` or a save interval; a resume goes on
from the batch after the saved one; the callback forwards those moments of a fit to :class:`~.steps.FitSteps`. In a
single process it changes nothing fastai writes or decides.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from functools import partial
from typing import Any

from fastai.callback.core import Callback
from fastai.callback.progress import CSVLogger
from fastai.callback.schedule import LRFinder
from fastai.callback.tracker import TerminateOnNaNCallback
from fastai.learner import CancelFitException, Learner
from fastcore.foundation import L

from .. import remote, topology
from ..checkpoint import CheckpointManager
from ..collectives import abort, barrier, broadcast
from ..lock import StateDictLock
from ..options import needs_checkpoint_dir, positive_int
from ..retention import Retention
from ..schedule import SaveSchedule
from ..storage import Storage
from . import learner
from .distributed import any_backend, prepare_distributed, refuse_training_alone
from .guards import discard_temporaries, guard, put_back, quiet_csv_loggers, quiet_trackers, refuse_remote_csv
from .learner import in_a_pass, stock_method
from .mid_epoch import end_resumed_epoch
from .steps import Fit, FitSteps, StepBoundary

_TRANSIENT = {"_fit": None, "_steps": None, "_lock": None, "_exported_ranks": False, "storage_options": None}
"""RankSafe's attributes that belong to this process (or to its user: credentials): never pickled."""


class RankSafe(Callback):
    """Make everything fastai writes or decides correct under distributed training (see the module docstring).

    Initialise the process group before making it (or its Learner), so that ``distrib_ctx`` sees the ranks.

    Args:
        checkpoint_dir: where to keep resumable checkpoints (relative to ``learn.path``); ``None``: none.
        keep: how many checkpoints to keep (``None``: all).
        every: save at the end of every ``every``-th epoch.
        async_save: write each checkpoint in the background while the next epoch trains.
        storage: ``"auto"``, ``"shared"`` or ``"local"``: see :class:`~ranksafe.CheckpointManager`.
        resume: the first ``fit`` continues from the newest checkpoint, if there is one (as ``learn.resume()`` does
            for the next ``fit``); if a later fit of the run wrote it, the fits before that one are skipped whole. A
            damaged checkpoint is fallen back over, with a warning, to the newest older one that verifies.
        preemption: handle SIGTERM and SIGUSR1 (or these signals) during each fit: when any rank receives one, every
            rank saves a checkpoint after the same training batch and the fit returns normally, with
            ``learn.preempted`` True (later fits of the process then train nothing). The next run resumes there.
        save_interval_steps: also save every this many optimizer steps of the run, inside epochs.
        save_interval_seconds: also save when this many seconds passed since the last save (rank 0's clock).
        storage_options: for a ``checkpoint_dir`` on remote storage: the options of its fsspec file system
            (``endpoint_url``, ``profile``...); without them it is configured from the environment. Never pickled
            (they may hold credentials): an exported Learner's RankSafe has none.
    """

    order = 55  # after Recorder (50) has recorded the epoch; before CSVLogger, LRFinder, trackers (60+)
    _learn: Learner | None = None  # a class default: fastai reads `learn` while setting any attribute

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike | None = None,
        keep: int | None = 3,
        every: int = 1,
        async_save: bool = False,
        storage: Storage | str = Storage.AUTO,
        resume: bool = False,
        preemption: bool | Iterable[int] = False,
        save_interval_steps: int | None = None,
        save_interval_seconds: float | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        # refused when it is made (on every rank alike), not at the first fit
        preemption = preemption if isinstance(preemption, bool) else tuple(preemption)
        SaveSchedule(save_interval_steps, save_interval_seconds, preemption)
        Retention(keep)
        if checkpoint_dir is not None and not os.fspath(checkpoint_dir):
            raise ValueError("checkpoint_dir must name a directory, not '' (it is relative to learn.path)")
        positive_int("every", every, allow_none=False)
        needs_checkpoint_dir(
            checkpoint_dir, resume=resume, async_save=async_save, preemption=preemption, every=every != 1,
            save_interval_steps=save_interval_steps, save_interval_seconds=save_interval_seconds,
            storage=Storage(storage) is not Storage.AUTO, storage_options=storage_options,
        )  # fmt: skip
        self.checkpoint_dir, self.keep, self.every, self.storage = checkpoint_dir, keep, every, Storage(storage).value
        self.async_save, self.resume_pending = async_save, resume
        self.preemption, self.save_interval_steps = preemption, save_interval_steps
        self.save_interval_seconds = save_interval_seconds
        self._preempted = False
        self._installed: tuple[str, ...] = ()
        vars(self).update(_TRANSIENT)
        self.storage_options = storage_options
        self._exported_ranks = prepare_distributed()  # fastai saw no job before this (see refuse_training_alone)

    @property
    def state_lock(self) -> StateDictLock | None:
        """The lock the optimizer step holds (write side) while snapshots take its read side (``async_save``)."""
        if self.async_save and self._lock is None:
            self._lock = StateDictLock()
        return self._lock

    @property
    def preempted(self) -> bool:
        """Whether a fit was stopped by a preemption signal (also ``learn.preempted``, while attached)."""
        return self._preempted

    @property
    def _scheduled(self) -> bool:
        """Saves may come inside epochs: every step boundary asks the manager."""
        return bool(self.preemption or self.save_interval_steps or self.save_interval_seconds)

    @property
    def manager(self) -> CheckpointManager | None:
        """The :class:`~ranksafe.CheckpointManager` of ``checkpoint_dir`` (made at the first fit)."""
        return None if self._steps is None else self._steps.manager

    @property
    def learn(self) -> Learner | None:
        """The Learner this callback is attached to (None when it is not): ``Learner.add_cb`` sets it, installing the
        rank-safe methods and ``preempted`` on that Learner; ``remove_cb`` sets None, removing them."""
        return self._learn

    @learn.setter
    def learn(self, learn: Learner | None) -> None:
        if learn is self._learn:
            return
        old = self._learn
        ending = learn is None and self._fit is not None
        exc = sys.exc_info()[1] if ending else None
        if ending and exc is self._fit.handled:  # a fit called in an `except` block ended well
            exc = None
        if ending:  # given to one fit, taken off as it ends: fastai's fit, not the `fit` below, so do what it does
            self._end_fit(exc)
        if self._learn is not None:
            _uninstall(self._learn, self._installed)
            preempted = vars(self._learn).pop("preempted", False)
            # another RankSafe that stays attached (this one was given to one fit) keeps the Learner as it needs it
            staying = (cb for cb in self._learn.cbs if isinstance(cb, RankSafe) and cb is not self)
            if (keeper := next(staying, None)) is not None:
                keeper._stay_on(self._learn, preempted)
        self._learn, self._installed = learn, ()
        if learn is not None:
            self._exported_ranks |= prepare_distributed()
            self._stay_on(learn, vars(learn).get("preempted", False))
        if ending:
            try:
                _meet_or_abort(exc)
            except BaseException:  # another rank failed late: fastai's remove_cb stops here, so finish it
                old.remove_cb(self)  # sets learn None again: a no-op here, then takes the callback off
                raise

    def _stay_on(self, learn: Learner, preempted: bool) -> None:
        """Give ``learn`` what this callback installs (the methods it lacks, ``preempted``): attached now, or staying
        attached where another RankSafe was taken off (``preempted``: the flag it leaves, also set by that one)."""
        self._installed += _install(learn)
        vars(learn)["preempted"] = self._preempted or preempted

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k not in _TRANSIENT}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        vars(self).update(_TRANSIENT)

    # Events
    def after_create(self) -> None:
        """Attached while the Learner is made: any ``distrib_ctx`` comes later, and sees the ranks."""
        self._exported_ranks = False

    def before_fit(self) -> None:
        """Open the fit: guard the other callbacks, check that fastai sees the job, open the checkpoints."""
        learn = self.learn
        any_backend(learn.dls.loaders)
        refuse_remote_csv(learn)
        quiet_csv_loggers(learn)
        if in_a_pass(learn):
            return
        several = topology.world_size() >= 2
        # where learn.path is a URL, fastai makes local folders named after it for lr_find's model and the CSV log
        kinds = (TerminateOnNaNCallback,) if several else ()
        kinds += (LRFinder, CSVLogger) if remote.is_url(learn.path) else (LRFinder,) if several else ()
        self._fit = Fit(guarded=guard(learn.cbs, kinds), handled=sys.exc_info()[1])
        self._exported_ranks |= prepare_distributed()  # a process group made after this callback and its Learner
        if several:
            late, self._exported_ranks = self._exported_ranks, False
            refuse_training_alone(learn, late)
        if self.checkpoint_dir is not None and not any(isinstance(cb, LRFinder) for cb in learn.cbs):
            self._start_checkpointing(self._fit)

    def _start_checkpointing(self, fit: Fit) -> None:
        if self._steps is None:
            self._steps = FitSteps(self._open_manager)
        if self._scheduled and not self._preempted:
            fit.boundary = StepBoundary(self)
            self.learn.add_cb(fit.boundary)
        # a resume that raised stays pending: the next fit tries it again rather than start afresh over its checkpoint
        self.resume_pending = self._steps.start(self.learn, fit, self._preempted, self.resume_pending)

    def _open_manager(self) -> CheckpointManager:
        """The manager of ``checkpoint_dir``, under ``learn.path`` (a URL stays one)."""
        return CheckpointManager(
            remote.joinpath(self.learn.path, self.checkpoint_dir), self.keep, self.storage,
            async_save=self.async_save, lock=self.state_lock, save_interval_steps=self.save_interval_steps,
            save_interval_seconds=self.save_interval_seconds, preemption=self.preemption,
            storage_options=self.storage_options,
        )  # fmt: skip

    def before_epoch(self) -> None:
        """Every rank arrives here, or every rank learns which one failed (instead of hanging in DDP). An epoch a
        resume skips gets its saved record, for the Recorder to log as the run that trained it did."""
        fit = self._fit
        if fit is None or in_a_pass(self.learn):
            return
        fit.epoch = self.epoch
        put_back(fit.quiet, "after_epoch")
        if fit.checkpointing:
            self._steps.start_epoch(self.learn, fit)  # also raises a failed background write, on every rank
        elif topology.world_size() >= 2:
            barrier("fastai: epoch start")

    def before_train(self) -> None:
        """With saves inside epochs: keep the generators of the epoch's start, or, in the epoch a checkpoint was
        taken inside, go on from the batch after the saved one."""
        any_backend([self.learn.dl])
        if self._fit is not None and self._fit.checkpointing:
            self._steps.start_training(self.learn, self._fit, keep_epoch_start=self._scheduled)

    def after_train(self) -> None:
        """The resumed epoch's training pass is over: later passes iterate whole."""
        end_resumed_epoch(self.learn)

    def before_validate(self) -> None:
        """Let the loader of this pass broadcast under any backend (``DistributedTrainer`` makes one per pass)."""
        any_backend([self.learn.dl])

    def before_step(self) -> None:
        """Hold the write side of :attr:`state_lock` during the optimizer step (async saves only); once, since the
        lock is re-entrant and a second hold would outlive the single release of the batch."""
        fit = self._fit
        if fit is not None and fit.checkpointing and self.async_save and not fit.holding:
            self.state_lock.acquire_write()
            fit.holding = True

    def after_step(self) -> None:
        """Release the write side: a background snapshot may read the weights again."""
        self._release()

    def after_cancel_batch(self) -> None:
        """A cancelled training batch (``GradientAccumulation`` between optimizer steps) is not a step boundary."""
        if self._fit is not None and self.training:
            self._fit.cancelled = True

    def after_batch(self) -> None:
        """Release the write side if ``after_step`` did not run (a batch cancelled in an earlier callback's
        ``after_step`` skips the rest of ``after_step``; ``after_batch`` runs for it too)."""
        self._release()

    def _step_boundary(self) -> None:
        """After a training batch that was not cancelled: every rank asks the manager whether to save, and stops the
        fit when the ranks reached a preemption."""
        fit = self._fit
        if fit is None or not fit.checkpointing or not self.training or in_a_pass(self.learn):
            return
        cancelled, fit.cancelled = fit.cancelled, False
        if cancelled or not self._scheduled:
            return
        if self._steps.step_boundary(self.learn, fit):
            self._preempted = True
            vars(self.learn)["preempted"] = True
            raise CancelFitException  # every rank, after the same batch: fastai runs after_fit, fit returns

    def _release(self) -> None:
        if self._fit is not None and self._fit.holding:
            self._fit.holding = False
            self.state_lock.release_write()

    def after_epoch(self) -> None:
        """Every rank takes rank 0's record of this epoch, before any tracker reads it; then the checkpoint. (The
        write side is released first: an epoch cancelled in an earlier ``after_step`` skips our ``after_batch``.)"""
        fit = self._fit if self._fit is not None and not in_a_pass(self.learn) else None
        checkpointing = fit is not None and fit.checkpointing
        skipped = checkpointing and self.epoch < fit.skip_to  # by the resume, not by another callback
        self._release()
        end_resumed_epoch(self.learn)  # an epoch cancelled before its training pass
        if skipped and self.epoch != fit.tracked_epoch:
            quiet_trackers(self.learn, fit.quiet, "after_epoch", bookkeeping=self.epoch < len(fit.history))
        self._agree_on_record()
        if checkpointing and not skipped and (self.epoch + 1) % self.every == 0:
            self._steps.save(self.learn, fit, inside_epoch=False)

    def _agree_on_record(self) -> None:
        """Every rank's epoch record becomes rank 0's (one broadcast). A fit's only: a ``validate`` pass may run on
        one rank alone, and a ``get_preds`` pass records nothing."""
        recorder = getattr(self.learn, "recorder", None)
        if topology.world_size() >= 2 and not in_a_pass(self.learn) and getattr(recorder, "values", None):
            agreed = broadcast(list(recorder.values[-1]), name="fastai: epoch record")
            recorder.values[-1] = self.learn.final_record = L(agreed)

    def after_fit(self) -> None:
        """Wait for the last checkpoint and raise its failure on every rank. A preempted fit is not the end of
        training: the trackers' ``after_fit`` (``SaveModelCallback`` loading the best model) waits for the fit that
        ends it."""
        quiet_csv_loggers(self.learn)
        fit = self._fit
        if fit is not None and in_a_pass(self.learn):
            self.learn.epoch = fit.epoch  # a validate pass inside the fit ended: TrainEvalCallback set it to 0
        elif fit is not None and fit.checkpointing:
            if self._preempted:
                quiet_trackers(self.learn, fit.quiet, "after_fit")
            self._stop_checkpointing(fit, failed=False)

    def _stop_checkpointing(self, fit: Fit, failed: bool) -> None:
        """Undo what checkpointing set up; wait for the write in flight, or after a failure just stop the writer."""
        fit.checkpointing = False
        put_back(fit.quiet, "after_epoch")  # a quiet after_fit stays until the trackers' after_fit is over
        self._release()
        end_resumed_epoch(self.learn)
        if fit.boundary is not None:
            self.learn.remove_cb(fit.boundary)
        self._steps.stop(self.learn, fit, failed)  # collective unless failed: raises a failed write everywhere

    def _end_fit(self, exc: BaseException | None) -> None:
        """The fit is over (every ``after_fit`` has run, or it raised ``exc``): drop its state and what it set."""
        fit, self._fit = self._fit, None
        if fit is None:
            return
        if exc is not None:
            discard_temporaries(self.learn, fit.guarded)
        put_back(fit.guarded)
        put_back(fit.quiet)
        if exc is not None:
            quiet_csv_loggers(self.learn, quiet=False)
            if fit.checkpointing:
                self._stop_checkpointing(fit, failed=True)


def _meet_or_abort(exc: BaseException | None) -> None:
    """After a fit: meet the other ranks (an error one of them met late, in a later ``after_fit``, reaches this rank
    here), or post this rank's error so that they stop within seconds."""
    if exc is None:
        barrier("fastai: fit end")
    else:
        abort(exc)


def fit(learn: Learner, *args: Any, **kwargs: Any) -> None:
    """``Learner.fit`` whose error on one rank reaches every rank within seconds, and which ends with the ranks
    meeting once more (a barrier), where an error another rank met late in the fit reaches this one."""
    exc = None
    try:
        stock_method(learn, "fit", fit)(*args, **kwargs)
    except BaseException as e:
        exc = e
        raise
    finally:
        for cb in learn.cbs:
            if isinstance(cb, RankSafe):
                cb._end_fit(exc)
        _meet_or_abort(exc)


def resume(learn: Learner, resume: bool = True) -> Learner:
    """Make the next ``fit`` continue from the newest checkpoint every rank has: ``learn.resume().fit_one_cycle(10)``.

    Needs ``RankSafe(checkpoint_dir=...)``; local (the checkpoint is read when the fit starts). Without a checkpoint
    the fit starts afresh; in a re-run script with several fits, the finished ones are skipped whole.
    """
    cb = next((cb for cb in learn.cbs if isinstance(cb, RankSafe)), None)
    if cb is None or cb.checkpoint_dir is None:
        raise ValueError("learn.resume() needs the RankSafe(checkpoint_dir=...) callback on the Learner")
    cb.resume_pending = resume
    return learn


class RankSafeLearner:
    """Mixin that makes a Learner class rank-safe: ``class MyLearner(RankSafeLearner, TextLearner)``. Its methods
    are ranksafe's (as :class:`RankSafe` installs them), and every instance gets the :class:`RankSafe` callback."""

    fit, resume = fit, resume
    save, load, export = learner.save, learner.load, learner.export
    get_preds, validate, tta, summary = learner.get_preds, learner.validate, learner.tta, learner.summary
    save_encoder, load_encoder, load_pretrained = learner.save_encoder, learner.load_encoder, learner.load_pretrained

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        prepare_distributed()  # before any Accelerator exists: distrib_ctx must see the process group's ranks
        super().__init__(*args, **kwargs)
        if not any(isinstance(cb, RankSafe) for cb in self.cbs):
            self.add_cb(RankSafe())


_METHODS = {name: method for name, method in vars(RankSafeLearner).items() if not name.startswith("_")}
"""What RankSafe installs on its Learner, by name: the mixin's methods."""


def _install(learn: Learner) -> tuple[str, ...]:
    """Give ``learn`` (that instance only) ``resume`` and the mixin's methods its class has (from fastai, not from the
    mixin), where the instance has no attribute of that name; returns their names. Each is a ``functools.partial`` of
    a module-level function: it pickles by reference, where pickle would bring a bound method back as the class's own
    (it looks it up by name)."""
    kind = type(learn)
    names = tuple(
        name
        for name, method in _METHODS.items()
        if name not in vars(learn)
        and getattr(kind, name, None) is not method
        and (name == "resume" or hasattr(kind, name))
    )
    for name in names:
        vars(learn)[name] = partial(_METHODS[name], learn)
    return names


def _uninstall(learn: Learner, names: tuple[str, ...]) -> None:
    """Take off what :func:`_install` set (a method set on the instance since, by someone else, stays)."""
    for name in names:
        method = vars(learn).get(name)
        if isinstance(method, partial) and method.func is _METHODS[name]:
            del vars(learn)[name]
