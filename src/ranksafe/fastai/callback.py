"""The ``RankSafe`` callback: ``Learner(..., cbs=RankSafe())`` makes fastai's files and decisions rank-safe.

While attached to a Learner it gives that Learner (that instance only, never the class) the collective
``save``/``load``/``export``/``get_preds`` (and the text learners' encoder loaders) of
:mod:`ranksafe.fastai.learner`, and during ``fit``:

* **decisions**: after the ``Recorder`` has recorded an epoch (order 50) and before any
  ``TrackerCallback`` reads it (order 60+), every rank replaces its epoch record by rank 0's. So
  ``SaveModelCallback``, ``EarlyStoppingCallback``, ``ReduceLROnPlateau`` and any other tracker see the same
  value on every rank and decide the same way: save together, stop at the same epoch. Rank 0's record is
  the one the CSV log and the progress bar show, so what is logged is what was decided.
* **failures**: ``fit`` runs under :func:`ranksafe.abort_on_error`, and every epoch starts with a barrier:
  a rank that raises in a callback (a full disk under the log, a tracker) stops every rank at their next
  ranksafe collective, before they enter the next epoch's gradient all-reduce, where only the process
  group's own timeout would end the wait. Two small collectives per epoch in all when nothing is saved.
* **CSVLogger**: only rank 0 opens and writes the log; a failure to open it is raised on every rank.
* **lr_find**: one temporary model, named by rank 0, written once, loaded by every rank, and removed once
  after every rank has loaded it.
* **checkpoints** (``RankSafe(checkpoint_dir="ckpt")``, relative to ``learn.path``): every ``every`` epochs
  the resumable training state (:mod:`ranksafe.fastai.training_state`) goes into a step directory of a
  :class:`~ranksafe.CheckpointManager`, ``keep`` of them kept. Steps grow across fits: a fit numbers its
  epochs from the step after the newest one committed when it starts (the first fit into an empty directory
  from 0), so that the second fit of ``fine_tune`` (or any later ``fit``) neither replaces the first one's
  checkpoints nor has retention delete its own, and the newest step is always the end of training so far.
  ``learn.resume()`` (or ``RankSafe(resume=True)``) makes the next ``fit`` continue from the newest step
  every rank has: weights, optimizer, random generators and recorded values are restored, and fastai's
  ``SkipToEpoch`` skips the epochs already done (the learning-rate schedule of ``fit_one_cycle`` continues
  where it was). Each checkpoint records which fit of the run wrote it (0 for the callback's first
  checkpointing fit in the process, 1 for the next, ...), so a script with several fits can be run again
  from its first line with ``resume=True``: the fits its newest checkpoint shows finished are skipped whole,
  nothing restored, and the resume waits for the fit that wrote it. With
  ``async_save=True`` the state is snapshotted at the end of the epoch and written while the next one
  trains; the optimizer step holds the write side of :attr:`RankSafe.state_lock`, and a failed background
  write is raised on every rank at the next epoch start, through the barrier that is there anyway.

Attaching it also points fastai at the process group's ranks and makes ``distrib_ctx()`` work with gloo on
CPU (:mod:`ranksafe.fastai.cpu`). In a single process it changes nothing fastai writes or decides.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fastai.callback.core import Callback
from fastai.callback.progress import CSVLogger
from fastai.callback.schedule import LRFinder, ParamScheduler
from fastai.callback.tracker import EarlyStoppingCallback, ReduceLROnPlateau, TerminateOnNaNCallback, TrackerCallback
from fastai.learner import CancelFitException, Learner, SkipToEpoch
from fastcore.foundation import L

from .. import topology
from ..checkpoint import CheckpointManager
from ..collectives import abort, barrier, broadcast, together
from ..files import load_file
from ..snapshot import StateDictLock
from ..storage import Storage
from .cpu import prepare_distributed
from .learner import LEARNER_METHODS, NEW_METHODS, RankSafeLearner, inside_wrapped_fit, opens_fit
from .training_state import FIT, STATE, STEP_BASE, rank_state, restore, rng_file, set_rank_state, training_state

_WRAPPED = "_ranksafe_wrapped"


def _wrap_events(cb: Callback, **events: Any) -> None:
    """Give one callback instance its own versions of some events, for one fit: its ``after_fit``, or RankSafe's
    ``fit_failed``, undoes them (:func:`_unwrap_events`). Left on, they would outlive RankSafe, and a Learner
    exported with them would not load (a pickled method of the callback is looked up by name)."""
    for name, fn in events.items():
        cb.__dict__[name] = types.MethodType(fn, cb)
    cb.__dict__[_WRAPPED] = tuple(events)


def _unwrap_events(cb: Callback) -> None:
    for name in cb.__dict__.pop(_WRAPPED, ()):
        cb.__dict__.pop(name, None)


def _nan_after_batch(self: TerminateOnNaNCallback) -> None:
    """Stop on every rank when the loss is not finite on any rank. Each rank looking at its own loss stopped the
    rank with the bad batch while the others went on into the next batch's all-reduce and waited there.

    One all-reduce (MAX) of one flag per batch, on the loss's device: a third of what fastai's gather costs
    (measured on 2 gloo ranks: 0.33 ms against 1.0 ms), and no trimming of padding rows to misapply to flags.
    """
    bad = (~torch.isfinite(self.loss.detach())).any().float().reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # the same answer on every rank
    if bad.item():
        raise CancelFitException


def _nan_after_fit(self: TerminateOnNaNCallback) -> None:
    if opens_fit(self.learn):  # the fit ends, not a validate pass inside it (it holds the lock)
        _unwrap_events(self)


def _csv_before_fit(self: CSVLogger) -> None:
    if hasattr(self, "gather_preds"):
        return
    with together("CSVLogger.before_fit"):
        if topology.is_main():
            Path(self.path).mkdir(parents=True, exist_ok=True)  # fastai makes only path.parent
            type(self).before_fit(self)


def _csv_after_fit(self: CSVLogger) -> None:
    try:
        if topology.is_main():
            type(self).after_fit(self)
    finally:
        _unwrap_events(self)


def _lr_finder_before_fit(self: LRFinder) -> None:
    ParamScheduler.before_fit(self)
    path = Path(self.path) / self.model_dir
    name = None
    with together("lr_find: temporary directory"):
        if topology.is_main():
            path.mkdir(parents=True, exist_ok=True)
            name = Path(tempfile.mkdtemp(dir=path)).name
    self.tmp_p = broadcast(name, name="lr_find: temporary directory")
    self.learn.save(f"{self.tmp_p}/_tmp")
    self.best_loss = float("inf")


def _lr_finder_after_fit(self: LRFinder) -> None:
    self.learn.opt.zero_grad()  # needed before detaching the optimizer for future fits
    try:
        self.learn.load(f"{self.tmp_p}/_tmp", with_opt=True)  # returns on a rank once every rank has read it
    finally:
        with together("lr_find: remove temporary model"):
            if topology.is_main():
                shutil.rmtree(Path(self.path) / self.model_dir / self.tmp_p, ignore_errors=True)
        _unwrap_events(self)


def _skipped_event() -> None:
    """A tracker's ``after_epoch`` on an epoch a resume skips (see :meth:`RankSafe._quiet_trackers`)."""


_TRANSIENT = (
    "_installed", "_manager", "_lock", "_skip", "_active", "_trained", "_holding", "_depth", "_history", "_fits",
    "_ordinal", "_base", "_quieted", "_epoch", "_fitting", "_ended_unwrapped",
)  # fmt: skip
"""RankSafe's attributes that belong to one attachment, process or fit: never pickled with an exported Learner."""


class RankSafe(Callback):
    """Make everything fastai writes or decides correct under distributed training.

    Add it to any Learner: ``Learner(dls, model, cbs=RankSafe())``, then train as usual, inside
    ``learn.distrib_ctx()`` or not, under ``torchrun`` or ``mp.spawn``. Initialise the process group before
    creating the Learner, so that ``distrib_ctx`` sees the right ranks. See the module docstring.

    Args:
        checkpoint_dir: where to keep resumable checkpoints (relative to ``learn.path``); ``None``: none.
        keep: how many checkpoints to keep (``None``: all).
        every: save at the end of every ``every``-th epoch.
        async_save: write each checkpoint in the background while the next epoch trains.
        storage: ``"auto"``, ``"shared"`` or ``"local"``: see :class:`~ranksafe.CheckpointManager`.
        resume: the first ``fit`` continues from the newest checkpoint, if there is one (as
            ``learn.resume()`` does for the next ``fit``); if a later fit of the run wrote it, the fits
            before that one are skipped and the fit that wrote it continues.
    """

    order = 55  # after Recorder (50) has recorded the epoch; before CSVLogger, LRFinder, trackers (60+)
    _learn: Learner | None = None
    _installed: tuple[str, ...] = ()
    # per fit, never pickled (export): the manager and its background writer, the lock, the epoch skipper
    _manager: CheckpointManager | None = None
    _lock: StateDictLock | None = None
    _skip: SkipToEpoch | None = None
    _fitting = False  # inside a fit (from its before_fit to its after_fit; validate passes inside it aside)
    _ended_unwrapped = False  # a fit without ranksafe's fit wrapper (fit(cbs=[RankSafe()])) ended: see _taken_off
    _active = False  # checkpointing in this fit (a training fit, not validate/get_preds/lr_find)
    _trained = False  # this epoch trained (SkipToEpoch did not skip it)
    _holding = False  # the optimizer step holds the write side of the lock
    _depth = 0  # before_fit events seen in this fit minus after_fit events (validate inside fit nests)
    _history: tuple | list = ()  # recorded values of the epochs a resumed fit skips
    _quieted: tuple = ()  # trackers whose after_epoch this skipped epoch must not run
    _epoch = 0  # the fit's epoch: a validate inside the fit sets learn.epoch to 0, after_fit puts it back
    _fits = 0  # checkpointing fits this callback began in this process: the ordinal of the next one
    _ordinal = 0  # this fit's ordinal, recorded in its checkpoints (a re-run script finds its place with it)
    _base = 0  # the step of this fit's epoch 0: after every step of the earlier fits

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike | None = None,
        keep: int | None = 3,
        every: int = 1,
        async_save: bool = False,
        storage: Storage = "auto",
        resume: bool = False,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, not {every!r}")
        if resume and checkpoint_dir is None:
            raise ValueError("resume=True needs a checkpoint_dir")
        self.checkpoint_dir, self.keep, self.every, self.storage = checkpoint_dir, keep, every, storage
        self.async_save, self.resume_pending = async_save, resume
        prepare_distributed()

    @property
    def state_lock(self) -> StateDictLock | None:
        """The lock the optimizer step holds (write side) while snapshots take its read side (``async_save``)."""
        if self.async_save and self._lock is None:
            object.__setattr__(self, "_lock", StateDictLock())
        return self._lock

    @property
    def _checkpointing(self) -> bool:
        """Checkpointing in this fit, and not inside a validate/get_preds pass that a callback started in it."""
        return self._active and self._depth == 1

    @property
    def manager(self) -> CheckpointManager | None:
        """The :class:`~ranksafe.CheckpointManager` of ``checkpoint_dir`` (made at the first fit)."""
        return self._manager

    # Attaching: Learner.add_cb sets `cb.learn`, remove_cb sets it to None.
    @property
    def learn(self) -> Learner | None:
        """The Learner this callback is attached to (None when it is not); attaching installs the rank-safe
        methods, taking it off removes them."""
        return self._learn

    @learn.setter
    def learn(self, learn: Learner | None) -> None:
        if learn is self._learn:
            return
        meet = learn is None and self._taken_off()
        self._uninstall()
        object.__setattr__(self, "_learn", learn)
        if learn is not None:
            prepare_distributed()
            self._install()
        if meet:
            barrier("fastai: fit end")

    def _taken_off(self) -> bool:
        """Taken off the Learner at the end of ``fit(cbs=[RankSafe()])`` (fastai removes a fit's callbacks on the way
        out). That ``fit`` is fastai's own, without the wrapper of a Learner RankSafe is attached to
        (:func:`~ranksafe.fastai.learner.learner_fit`), so this does what the wrapper does: an error on its way
        out (before this callback's ``after_fit``, or after it, in a later callback's) is posted for the other ranks
        (:func:`ranksafe.abort`) and what the fit held is released; after a clean fit, True: the ranks meet once
        more (a barrier), where they hear of an error another rank met after this callback's last collective."""
        fitting, ended = self._fitting, self._ended_unwrapped
        object.__setattr__(self, "_fitting", False)
        object.__setattr__(self, "_ended_unwrapped", False)
        exc = sys.exc_info()[1]
        if exc is None:
            return ended
        if fitting or ended:
            abort(exc)
        if fitting:
            self.fit_failed()
        return False

    def reattach(self) -> None:
        """Install the rank-safe methods again on a Learner restored from a pickle (``load_learner``)."""
        object.__setattr__(self, "_installed", ())
        self._install()

    def _install(self) -> None:
        learn = self._learn
        if learn is None or isinstance(learn, RankSafeLearner):
            return
        names = [
            n for n in LEARNER_METHODS if (hasattr(type(learn), n) or n in NEW_METHODS) and n not in learn.__dict__
        ]
        for name in names:
            learn.__dict__[name] = types.MethodType(LEARNER_METHODS[name], learn)
        object.__setattr__(self, "_installed", tuple(names))

    def _uninstall(self) -> None:
        learn = self._learn
        for name in self._installed:
            if learn is not None and getattr(learn.__dict__.get(name), "__func__", None) is LEARNER_METHODS[name]:
                del learn.__dict__[name]
        object.__setattr__(self, "_installed", ())

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        for name in _TRANSIENT:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickled with its Learner (fastai's own ``load_learner`` too): install the rank-safe methods again."""
        super().__setstate__(state)
        if self.__dict__.get("_learn") is not None:
            self.reattach()

    # Events
    def before_fit(self) -> None:
        """Guard CSVLogger and lr_find for this fit; open the checkpoint manager and resume if asked."""
        if topology.world_size() >= 2:
            for cb in self.learn.cbs:
                if isinstance(cb, CSVLogger) and _WRAPPED not in cb.__dict__:
                    _wrap_events(cb, before_fit=_csv_before_fit, after_fit=_csv_after_fit)
                elif isinstance(cb, LRFinder) and _WRAPPED not in cb.__dict__:
                    _wrap_events(cb, before_fit=_lr_finder_before_fit, after_fit=_lr_finder_after_fit)
                elif isinstance(cb, TerminateOnNaNCallback) and _WRAPPED not in cb.__dict__:
                    _wrap_events(cb, after_batch=_nan_after_batch, after_fit=_nan_after_fit)
        if self._active:  # validate/get_preds called inside this fit: its after_fit must not end the fit
            object.__setattr__(self, "_depth", self._depth + 1)
            return
        # the same answer on every rank: every rank runs the same fit with the same callbacks
        opens = opens_fit(self.learn)
        if opens:
            object.__setattr__(self, "_fitting", True)
        if not (opens and self.checkpoint_dir is not None):
            return
        if any(isinstance(cb, LRFinder) for cb in self.learn.cbs):
            return
        object.__setattr__(self, "_active", True)
        object.__setattr__(self, "_depth", 1)
        object.__setattr__(self, "_history", ())
        object.__setattr__(self, "_ordinal", self._fits)
        object.__setattr__(self, "_fits", self._fits + 1)
        if self._manager is None:
            root = Path(self.learn.path) / self.checkpoint_dir
            manager = CheckpointManager(root, self.keep, self.storage, async_save=self.async_save, lock=self.state_lock)
            object.__setattr__(self, "_manager", manager)
        newest = self._manager.latest()  # agreed: every rank numbers this fit's steps alike
        object.__setattr__(self, "_base", 0 if newest is None else newest + 1)
        if self.resume_pending:
            self._resume(newest)

    def _resume(self, newest: int | None) -> None:
        """Continue this fit from step ``newest``, or skip the whole fit if a later fit of the run wrote it.

        A re-run script runs its fits again from the first one, and the checkpoint names the fit that wrote
        it. A later fit: this one had finished, so all its epochs are skipped, nothing is restored, and the
        resume stays pending for the next fit. This fit: it continues after the saved epoch, its steps
        numbered as before. An earlier fit (``learn.resume()`` then ``fit`` again in the process whose fit
        failed): this fit takes that one's place and continues it. A checkpoint without the ordinal (written
        before it was recorded) counts as this fit's.
        """
        mgr = self._manager
        if newest is None:
            self.resume_pending = False
            return  # nothing saved yet: a fresh start
        state = mgr.load(newest)
        writer = state.get(FIT, self._ordinal)
        if writer > self._ordinal:
            warnings.warn(
                f"resume: the newest checkpoint (step {newest}) was written by fit #{writer} of the run and this is "
                f"fit #{self._ordinal}: skipping this fit, which that run had finished (resuming fit #{writer} "
                "needs the fits before it to run first, as when the script is run again from its start)",
                RuntimeWarning,
                stacklevel=2,
            )
            self._skip_to(self.learn.n_epoch)
            return
        self.resume_pending = False
        if writer < self._ordinal:  # ``learn.resume()`` after a failed fit, in the same process: continue that one
            object.__setattr__(self, "_ordinal", writer)
            object.__setattr__(self, "_fits", writer + 1)
        rng = os.path.join(mgr.step_dir(mgr.loaded_step), rng_file(topology.rank()))
        with together("fastai: resume", what=f"resume from {mgr.step_dir(mgr.loaded_step)}"):
            restore(self.learn, state)
            if os.path.exists(rng):  # absent when the world grew since: those ranks start new generators
                set_rank_state(self.learn, load_file(rng))
            else:
                warnings.warn(f"{rng} does not exist: random generators not restored", RuntimeWarning, stacklevel=2)
        object.__setattr__(self, "_base", state.get(STEP_BASE, mgr.loaded_step - state["epoch"]))
        object.__setattr__(self, "_history", state["recorder"])
        self._skip_to(state["epoch"] + 1)

    def _skip_to(self, epoch: int) -> None:
        """Have fastai skip this fit's epochs before ``epoch`` (undone at the end of the fit)."""
        skip = SkipToEpoch(epoch)
        object.__setattr__(self, "_skip", skip)
        self.learn.add_cb(skip)

    def before_epoch(self) -> None:
        """Every rank arrives here, or every rank learns which one failed (instead of hanging in DDP).

        With checkpoints, the barrier is the manager's :meth:`~ranksafe.CheckpointManager.check`: the same
        single exchange, which also raises a failed background write on every rank. An epoch a resume skips
        gets its saved record now, between the Recorder's ``before_epoch`` and fastai's ``SkipToEpoch``: the
        Recorder records and logs it (the CSV log's row) as the run that trained it did.
        """
        if not (self._active and self._depth > 1):  # not a validate pass inside the fit (it fires epoch events too)
            self._unquiet_trackers()
            object.__setattr__(self, "_epoch", self.epoch)
            recorder = getattr(self.learn, "recorder", None)
            if self._active and recorder is not None and self.epoch < len(self._history):
                recorder.log = L(self.epoch, *self._history[self.epoch])
        if self._checkpointing:
            object.__setattr__(self, "_trained", False)
            self._manager.check()
        elif topology.world_size() >= 2 and not hasattr(self.learn, "gather_preds"):
            barrier("fastai: epoch start")

    def before_train(self) -> None:
        """Note that this epoch trains (a validate-only pass saves nothing)."""
        object.__setattr__(self, "_trained", True)

    def before_step(self) -> None:
        """Hold the write side of :attr:`state_lock` during the optimizer step (async saves only).

        Once: the lock is re-entrant, and a second hold would outlive the single release of the batch.
        """
        if self._checkpointing and self.async_save and not self._holding:
            self.state_lock.acquire_write()
            object.__setattr__(self, "_holding", True)

    def after_step(self) -> None:
        """Release the write side: a background snapshot may read the weights again."""
        self._release()

    def after_batch(self) -> None:
        """Release the write side if ``after_step`` did not run.

        A callback before this one that cancels the batch in its ``after_step`` makes fastai skip the rest
        of ``after_step``; ``after_batch`` runs for a cancelled batch too.
        """
        self._release()

    def _release(self) -> None:
        """Give back the write side if this thread holds it for the optimizer step."""
        if self._holding:
            object.__setattr__(self, "_holding", False)
            self.state_lock.release_write()

    def after_epoch(self) -> None:
        """Every rank takes rank 0's record of this epoch, before any tracker reads it; then the checkpoint.

        The write side is released first: a train or epoch cancelled in an earlier callback's ``after_step``
        skips both ``after_step`` and ``after_batch``, and no optimizer step runs from here to the next batch.
        """
        self._release()
        recorder = getattr(self.learn, "recorder", None)
        checkpointing = self._checkpointing
        if checkpointing and not self._trained and self.epoch != len(self._history) - 1:
            self._quiet_trackers(bookkeeping=self.epoch < len(self._history))
        shared = topology.world_size() >= 2 and not hasattr(self.learn, "gather_preds")
        if shared and recorder is not None and recorder.values:
            agreed = broadcast(list(recorder.values[-1]), name="fastai: epoch record")
            recorder.values[-1] = self.learn.final_record = L(agreed)
        if checkpointing and self._trained and (self.epoch + 1) % self.every == 0:
            state = training_state(self.learn, fit=self._ordinal, step_base=self._base)
            with self._manager.saving(self._base + self.epoch, {STATE: state}) as tx:
                tx.save(rank_state(self.learn), rng_file(topology.rank()))

    def _quiet_trackers(self, bookkeeping: bool) -> None:
        """An epoch a resume skips, before the saved one: the trackers (SaveModelCallback, EarlyStopping,
        ReduceLROnPlateau) acted on it in the run that saved it, and what they did is in the restored state (the
        best model on disk, the reduced learning rate). They update what they track (the best value, the epochs
        without improvement) and do nothing else: run again, they saved the restored weights as the best of an
        old epoch and reduced the learning rate twice. The saved epoch itself was checkpointed before its
        trackers ran, so they run for it as usual. Epochs of a fit skipped whole (no history): nothing runs."""
        quieted = []
        for cb in self.learn.cbs:
            if not isinstance(cb, TrackerCallback) or not cb.run:
                continue
            if bookkeeping:
                TrackerCallback.after_epoch(cb)
                if isinstance(cb, (EarlyStoppingCallback, ReduceLROnPlateau)):
                    cb.wait = 0 if cb.new_best else cb.wait + 1
                    if isinstance(cb, ReduceLROnPlateau) and cb.wait >= cb.patience:
                        cb.wait = 0  # the reduction it made then is in the restored hypers
            cb.__dict__["after_epoch"] = _skipped_event
            quieted.append(cb)
        object.__setattr__(self, "_quieted", tuple(quieted))

    def _unquiet_trackers(self) -> None:
        for cb in self._quieted:
            cb.__dict__.pop("after_epoch", None)
        object.__setattr__(self, "_quieted", ())

    def after_fit(self) -> None:
        """At the end of the outermost fit: wait for the last checkpoint and raise its failure on every rank."""
        if opens_fit(self.learn):
            object.__setattr__(self, "_fitting", False)
            object.__setattr__(self, "_ended_unwrapped", not inside_wrapped_fit())
        if not self._active:
            return
        object.__setattr__(self, "_depth", self._depth - 1)
        if self._depth >= 1:  # a validate inside this fit ended; fastai's TrainEvalCallback set learn.epoch to 0
            self.learn.epoch = self._epoch
        if self._depth == 0:
            self._end_fit()
            self._manager.close()  # collective: waits for the write in flight, raises its failure everywhere

    def _end_fit(self) -> None:
        object.__setattr__(self, "_active", False)
        self._unquiet_trackers()
        self._release()
        if self._skip is not None:
            self.learn.remove_cb(self._skip)
            object.__setattr__(self, "_skip", None)

    def fit_failed(self) -> None:
        """``fit`` raised: no lock stays held, no write stays in flight, no callback keeps a wrapped event (local;
        the ranks are failing)."""
        object.__setattr__(self, "_fitting", False)  # taken off the Learner later, it posts no error again
        for cb in self.learn.cbs:
            _unwrap_events(cb)
        if self._active:
            self._end_fit()
            self._manager.shutdown()
