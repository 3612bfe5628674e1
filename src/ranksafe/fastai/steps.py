"""``RankSafe(checkpoint_dir=...)``: a fastai fit's training state kept as the numbered steps of a
:class:`~ranksafe.CheckpointManager`.

:class:`FitSteps` decides nothing itself: the manager says when to save inside epochs (its schedule, asked on every
rank at each step boundary) and when a preemption stops the fit. It turns those answers into fastai's terms: the
training state (:mod:`.training_state`) and each rank's generators as a step, at the end of an epoch
and inside epochs; each fit's steps numbered after the newest committed one; and a resume that skips what the
checkpoint had trained, whole epochs through fastai's ``SkipToEpoch`` and the batches of an epoch saved inside it
through :mod:`.mid_epoch`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from fastai.callback.core import Callback
from fastai.learner import Learner, SkipToEpoch
from fastcore.foundation import L

from .. import remote, topology
from ..checkpoint import STATE, CheckpointManager
from ..checkpoint_file import load_file
from ..collectives import together
from .mid_epoch import Resumption, restore_epoch_start, skip_done_batches
from .training_state import (
    BATCHES,
    EPOCH_START,
    FIT,
    PCT_TRAIN,
    STEP_BASE,
    STEPS,
    TRAIN_ITER,
    generators,
    rank_state,
    restore,
    rng_file,
    set_rank_state,
    training_state,
)


class StepBoundary(Callback):
    """The step boundary, after every callback's ``after_batch`` (RankSafe's own comes before the trackers' and
    loggers'): a checkpoint there holds what each one did with the batch, and a fit stopped there ends after a
    batch every callback saw whole. One fit's: RankSafe adds it at the fit's start and takes it off at its end."""

    order = 1000

    def __init__(self, owner: Callback) -> None:
        self.owner = owner

    def after_batch(self) -> None:
        """At the boundary, ``RankSafe._step_boundary``."""
        self.owner._step_boundary()


def fit_callbacks(learn: Learner) -> list[Callback]:
    """The callbacks in ``learn.cbs`` that belong to the fit in progress: RankSafe's step boundary, and fastai's
    ``SkipToEpoch`` (a resume's; fastai's own ``fit(start_epoch=)`` adds one for one fit too)."""
    return [cb for cb in learn.cbs if isinstance(cb, (StepBoundary, SkipToEpoch))]


@dataclass
class Fit:
    """What RankSafe holds for the fit in progress: made at the fit's ``before_fit``, dropped when it is over."""

    # RankSafe's own
    guarded: list[tuple[Callback, str]]  # other callbacks' events made rank-safe for this fit (guards.guard)
    quiet: list[tuple[Callback, str]] = field(default_factory=list)  # trackers' events kept quiet (quiet_trackers)
    epoch: int = 0  # the fit's epoch: a validate pass inside the fit sets learn.epoch to 0
    handled: BaseException | None = None  # what the caller was handling when the fit began: not the fit's error
    # checkpointing, mostly FitSteps': a training fit with checkpoint_dir (not lr_find). Set by FitSteps.start, cleared
    # first thing when RankSafe stops checkpointing (so that a stop that raised is not run again at the fit's end)
    checkpointing: bool = False
    ordinal: int = 0  # which checkpointing fit of the process this is: a re-run script finds its place with it
    base: int = 0  # the step number of the fit's epoch 0
    skip_to: int = 0  # the epochs before it are skipped (a resume's, or every one after a preemption): no saves
    holding: bool = False  # RankSafe's: the optimizer step holds the write side of the state lock
    # resuming: the epochs before the checkpoint are skipped
    skip: SkipToEpoch | None = None  # fastai's epoch skipper
    history: list = field(default_factory=list)  # the recorded values of the epochs skipped
    tracked_epoch: int | None = None  # the skipped epoch saved before its trackers ran: they run for it as usual
    # saves inside epochs
    boundary: Callback | None = None  # the step boundary after each training batch (RankSafe's)
    cancelled: bool = False  # the batch in progress was cancelled: not a step boundary
    epoch_start: dict | None = None  # this rank's generators when this epoch's training started
    resumption: Resumption | None = None  # the epoch a checkpoint taken inside it goes on from, until it starts


class FitSteps:
    """The manager steps of one :class:`~ranksafe.fastai.RankSafe`: what its events call in a checkpointing fit, on
    every rank. ``open_manager`` makes the manager at the first such fit (the Learner's path is known then). When to
    save at an epoch's end, and whether to keep each epoch's generators for saves inside it, the callback decides.
    """

    def __init__(self, open_manager: Callable[[], CheckpointManager]) -> None:
        self._open_manager = open_manager
        self.manager: CheckpointManager | None = None
        self.fits = 0  # the checkpointing fits of this process so far
        self.optimizer_steps = 0  # of the run, counted at step boundaries (a resume takes the checkpoint's)

    def start(self, learn: Learner, fit: Fit, preempted: bool, resume: bool) -> bool:
        """At ``before_fit``: number this fit's steps after the newest committed one and, with ``resume``, go on from
        it. After a preemption the process trains nothing more: the fit is skipped. Returns whether a resume is still
        pending (this fit was skipped: the next one resumes). Collective."""
        fit.checkpointing, fit.ordinal, self.fits = True, self.fits, self.fits + 1
        if preempted:
            skip_to(learn, fit, learn.n_epoch)
            return resume
        if self.manager is None:
            self.manager = self._open_manager()
        self.manager.schedule.install(fit=True)  # again after an earlier fit, whose end put the handlers back
        self.manager.warmup()  # a root that cannot be written (a bucket, credentials) fails every rank now
        newest = self.manager.latest()  # agreed: every rank numbers this fit's steps alike
        fit.base = 0 if newest is None else newest + 1
        return resume and newest is not None and self._resume(learn, fit)

    def _resume(self, learn: Learner, fit: Fit) -> bool:
        """Continue this fit from the newest step every node holds, or from the newest older one that verifies where
        that one is damaged (with a warning: training then saves over it). A re-run script runs its fits from the
        first: if a later fit wrote that step, this one had finished, and is skipped whole (True: the resume waits for
        that fit). If an earlier fit wrote it (``learn.resume()`` after a failed fit, in the same process), this fit
        takes that one's place."""
        mgr = self.manager
        state = mgr.load(fallback=True)
        writer = state.get(FIT, fit.ordinal)  # a checkpoint without the ordinal counts as this fit's
        if writer > fit.ordinal:
            warnings.warn(
                f"resume: the checkpoint resumed from (step {mgr.loaded_step}) was written by fit #{writer} of the run "
                f"and this is fit #{fit.ordinal}: skipping this fit, which that run had finished (resuming fit "
                f"#{writer} needs the fits before it to run first, as when the script is run again from its start)",
                RuntimeWarning,
                stacklevel=2,
            )
            skip_to(learn, fit, learn.n_epoch)
            return True
        if writer < fit.ordinal:
            fit.ordinal, self.fits = writer, writer + 1
        step_dir = mgr.step_dir(mgr.loaded_step)
        rng, mine = os.path.join(step_dir, rng_file(topology.rank())), None
        with together("fastai: resume", what=f"resume from {step_dir}"):
            restore(learn, state)
            if remote.exists(rng, mgr.storage_options):  # absent when the world grew since: new generators there
                mine = load_file(rng, storage_options=mgr.storage_options)
                set_rank_state(learn, mine)
            else:
                warnings.warn(f"{rng} does not exist: random generators not restored", RuntimeWarning, stacklevel=2)
        self.optimizer_steps, fit.history = state.get(STEPS, 0), state["recorder"]
        if BATCHES in state:  # taken inside epoch `epoch`: it goes on from its next batch (before_train)
            epoch_start = None if mine is None else mine[EPOCH_START]
            fit.resumption = Resumption(
                state["epoch"], state[BATCHES], state[PCT_TRAIN], state[TRAIN_ITER], epoch_start, generators=mine
            )
            fit.base = state[STEP_BASE] + 1  # as after that save, in the run that made it
            skip_to(learn, fit, state["epoch"])
            return False
        fit.base = state.get(STEP_BASE, mgr.loaded_step - state["epoch"])
        fit.tracked_epoch = state["epoch"]
        learn.train_iter = state.get(TRAIN_ITER, 0)
        skip_to(learn, fit, state["epoch"] + 1)
        return False

    def start_epoch(self, learn: Learner, fit: Fit) -> None:
        """At ``before_epoch``: an epoch a resume skips gets its saved record, for the Recorder to log as the run that
        trained it did; then every rank meets, and a failed background write is raised on every rank. Collective
        (no manager: a fit skipped after a preemption by a callback unpickled from another process)."""
        if fit.resumption is not None and fit.resumption.epoch == learn.epoch:
            skip_done_batches(learn, fit.resumption)
        recorder = getattr(learn, "recorder", None)
        if recorder is not None and learn.epoch < len(fit.history):
            recorder.log = L(learn.epoch, *fit.history[learn.epoch])
        if self.manager is not None:
            self.manager.check()

    def start_training(self, learn: Learner, fit: Fit, keep_epoch_start: bool) -> None:
        """At ``before_train``: in the epoch a checkpoint was taken inside, go on from the batch after the saved one;
        in another, with ``keep_epoch_start`` (saves may come inside it), keep the generators of the epoch's start."""
        if fit.resumption is not None and fit.resumption.epoch == learn.epoch:
            at, fit.resumption = fit.resumption, None
            restore_epoch_start(learn, at)
            fit.epoch_start = at.epoch_start
        elif keep_epoch_start:
            fit.epoch_start = generators(learn)

    def step_boundary(self, learn: Learner, fit: Fit) -> bool:
        """After a training batch that was not cancelled: save when the manager says so; whether the ranks reached a
        preemption (the fit stops after this batch). Collective."""
        self.optimizer_steps += 1
        if self.manager.should_save(self.optimizer_steps):
            self.save(learn, fit, inside_epoch=True)
        return self.manager.preempted

    def save(self, learn: Learner, fit: Fit, inside_epoch: bool) -> None:
        """Save step ``base + epoch``, at the epoch's end or after the training batch ``learn.iter``. A save inside an
        epoch takes the number of the epoch's end, so every step after it is numbered one further. Collective."""
        state = training_state(learn, fit.ordinal, fit.base, self.optimizer_steps, inside_epoch)
        mine = rank_state(learn)
        if inside_epoch:
            mine[EPOCH_START] = fit.epoch_start
        with self.manager.saving(fit.base + learn.epoch, {STATE: state}) as tx:
            tx.save(mine, rng_file(topology.rank()))
        if inside_epoch:
            fit.base += 1

    def stop(self, learn: Learner, fit: Fit, failed: bool) -> None:
        """At the fit's end: take off the epoch skipper; wait for the write in flight and raise its failure on every
        rank (collective), or after a failure just stop the writer and the signal handlers."""
        if fit.skip is not None:
            learn.remove_cb(fit.skip)
        if self.manager is None:  # making it failed: that error is the one to see
            return
        if failed:
            self.manager.schedule.uninstall()
            self.manager.schedule.pass_on_unanswered(keep=True)  # a signal of this fit: the next fit stops
            self.manager.shutdown()
        else:
            self.manager.close(keep_signal=True)


def skip_to(learn: Learner, fit: Fit, epoch: int) -> None:
    """Have fastai skip this fit's epochs before ``epoch`` (undone at the end of the fit)."""
    fit.skip, fit.skip_to = SkipToEpoch(epoch), epoch
    learn.add_cb(fit.skip)
