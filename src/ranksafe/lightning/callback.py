"""``RankSafe``: the Lightning callback that makes a failed or diverging checkpoint step one error on every rank.

From ``setup`` to ``teardown`` (or ``on_exception``) it wraps a few methods of the Trainer's strategy, checkpoint
connector and monitoring callbacks, and with ``checkpoint_dir`` and no monitoring callback the LightningModule's
``on_train_epoch_end`` (:mod:`.wrapped`); the private ones are named in :mod:`.compat`. In a single
process nothing is shared: only what the plugin, the manager and ``save_last="link"`` need is wrapped.
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, Checkpoint, EarlyStopping, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from .. import remote, topology
from ..checkpoint import CheckpointManager
from ..checkpoint_file import probe_write
from ..collectives import abort, checked_timeout
from ..errors import naming_target
from ..files import clean_orphans
from ..lock import StateDictLock
from ..monitor import MonitorAgreement, MonitorOp
from ..options import needs_checkpoint_dir, positive_int, positive_number
from ..saver_failures import poll_savers
from ..storage import Storage
from . import compat
from .io import RankSafeCheckpointIO
from .shared_io import SharedCheckpointIO, checkpoint_dirs, shared_outcome
from .steps import TrainerSteps
from .wrapped import unwrap, wrap

UNAGREED_REQUEUE = (
    "SLURMEnvironment(auto_requeue=True): Lightning's requeue handler saves a checkpoint from inside the signal "
    "handler, where the ranks cannot meet; a signal that reaches them at different points fails or hangs the job. "
    "RankSafe(checkpoint_dir=..., preemption=True) saves at a step every rank agrees on, then requeues"
)
"""The warning of a multi-rank fit that leaves SLURM's requeue signal to Lightning's handler."""
PREEMPTED_BEFORE = (
    "an earlier fit of this process was preempted and its step is committed: this fit stops before its first step "
    "(unless min_steps or min_epochs keep it going, as they keep a stopped fit going) and saves nothing. End the "
    "process (check rank_safe.manager.preempted) and go on in the next job with resume=True"
)
"""The warning of a fit that a RankSafe starts after it saw a preemption."""


def _seconds(interval: timedelta | float | None) -> float | None:
    """``train_time_interval`` in seconds: a ``timedelta``, as ModelCheckpoint takes it, or a number of seconds."""
    seconds = interval.total_seconds() if isinstance(interval, timedelta) else interval
    positive_number("train_time_interval (in seconds)", seconds)
    return seconds


def _monitors(trainer: pl.Trainer) -> list[Callback]:
    """The Trainer's monitoring callbacks (checkpoints, early stopping), in the order the Trainer runs them."""
    return [cb for cb in trainer.callbacks if isinstance(cb, (EarlyStopping, Checkpoint))]


def _async_io(trainer: pl.Trainer) -> RankSafeCheckpointIO | None:
    """The strategy's RankSafeCheckpointIO if it saves in the background, also inside ``AsyncCheckpointIO``."""
    io = trainer.strategy.checkpoint_io
    for _ in range(8):  # wrappers keep the plugin they wrap as ``checkpoint_io``
        if isinstance(io, RankSafeCheckpointIO):
            return io if io.async_save else None
        io = getattr(io, "checkpoint_io", None)
    return None


class RankSafe(SharedCheckpointIO, Callback):
    """Make Lightning checkpointing safe under DDP: ``Trainer(callbacks=[RankSafe(), ModelCheckpoint(...)])``.

    During ``fit``, ``validate``, ``test`` and ``predict`` (from ``setup`` to ``teardown``):

    * the strategy's ``save_checkpoint`` / ``remove_checkpoint`` / ``load_checkpoint`` share their outcome: a
      failed write on rank 0 is a :class:`~ranksafe.RankFailure` on every rank, not a hang in a barrier;
    * every rank loads the path rank 0 chose (``ckpt_path="last"`` is resolved per rank), and a corrupt file
      raises :class:`~ranksafe.CorruptCheckpoint` on every rank;
    * ModelCheckpoint and EarlyStopping read their metrics through :class:`MonitorAgreement`: one decision and one
      file name on every rank, even without ``sync_dist=True`` or where a metric was logged on some ranks only;
    * an exception on one rank is posted with :func:`ranksafe.abort`, so the others raise within seconds at their
      next ranksafe collective; a ModelCheckpoint ``save_on_exception`` waits at most
      :data:`.shared_io.EXCEPTION_SAVE_WAIT` for ranks that did not fail (stock Lightning waits for the process
      group's timeout there);
    * with ``RankSafeCheckpointIO(async_save=True)``: the optimizer step holds the write side of the plugin's
      lock, a background failure is raised on every rank at the end of the step, loads wait for the write.

    Args:
        overwrite: empty every ModelCheckpoint directory before training (collectively, by rank 0 only,
            via :func:`ranksafe.prepare_dir`), unless the fit resumes from a checkpoint or an earlier ``fit`` of this
            Trainer saved there (its ``best_model_path`` names a file there). With the default
            False the directory is left to Lightning, which creates it at the first save on rank 0.
        monitor_op: how a monitored metric that differs across ranks becomes one value: ``"mean"`` (what
            ``sync_dist=True`` would log), ``"main"`` (rank 0's), ``"max"`` or ``"min"``.
        timeout: seconds a rank waits for the others in a shared save/load (default: ranksafe's,
            ``RANKSAFE_TIMEOUT`` or 30 minutes); past it every rank raises :class:`~ranksafe.BarrierTimeout`.
        checkpoint_dir: save the Trainer's full checkpoint (what ``trainer.save_checkpoint`` writes) as step
            ``trainer.global_step`` of a :class:`~ranksafe.CheckpointManager` under this directory, at the
            intervals below and at a preemption. A save comes right after the last ModelCheckpoint's or
            EarlyStopping's hook of the same name (Lightning runs those last), so their state is the step's.
        keep: committed steps to keep under ``checkpoint_dir`` (``None``: all).
        every_n_epochs: save every this many epochs. ``None``: every epoch, unless ``every_n_train_steps`` or
            ``train_time_interval`` is given (then no epoch saves, as with ModelCheckpoint).
        storage: ``"auto"`` probes whether ``checkpoint_dir`` is shared by every rank or local to each node
            (then every node keeps its own copy); ``"shared"`` / ``"local"`` say so.
        storage_options: for a ``checkpoint_dir`` on remote storage (``s3://bucket/run``): the options of its fsspec
            file system (``endpoint_url``, ``profile``...); without them it is configured from the environment.
        resume: ``trainer.fit(model)`` without ``ckpt_path``, on a Trainer that has not trained yet, starts from the
            latest step committed on every node (:meth:`latest_checkpoint`), or from scratch when there is none. A
            damaged step (a file that does not match its manifest) is fallen back over, with a warning, to the newest
            older one that verifies. An explicit ``ckpt_path`` wins. ``None``: resume when ``preemption`` is on (a
            requeued job resumes where it stopped).
        async_save: the manager commits each step in the background; a failed commit is raised on every rank
            at the end of the next training step, and ``on_fit_end`` waits for the last one.
        every_n_train_steps: save when ``trainer.global_step`` is a multiple of it, at the end of the training
            batch whose optimizer step made it so (as ModelCheckpoint does). Every rank counts the same steps.
        train_time_interval: save at the end of the first optimizer step after this much time (a ``timedelta``, or
            seconds) since the start of training or the last save, by rank 0's clock (the other ranks' clocks
            may differ: every rank saves at the end of the step after the one where rank 0 found the time over).
        preemption: during ``fit``, handle SIGTERM and SIGUSR1 (or the signals given) instead of Lightning: a signal
            to any rank makes every rank save at the same optimizer step, then stop (``trainer.should_stop``), so
            that ``fit`` returns and the process ends normally, without validating the epoch the stop cut short (the
            resumed run validates it). Under SLURM's requeue signal
            (``SLURMEnvironment(auto_requeue=True)``, Lightning's default there), rank 0 then runs
            ``scontrol requeue <job id>`` once the step is committed (:func:`ranksafe.preemption.requeue_slurm_job`).

    Every save decision is the checkpoint manager's (:meth:`~ranksafe.CheckpointManager.should_save`), asked on
    every rank once per optimizer step.
    """

    def __init__(
        self,
        overwrite: bool = False,
        monitor_op: MonitorOp | str = MonitorOp.MEAN,
        timeout: float | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        keep: int | None = 3,
        every_n_epochs: int | None = None,
        storage: Storage | str = Storage.AUTO,
        resume: bool | None = None,
        async_save: bool = False,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | float | None = None,
        preemption: bool | Iterable[int] = False,
        storage_options: dict[str, Any] | None = None,
    ):
        seconds = _seconds(train_time_interval)
        positive_int("every_n_epochs", every_n_epochs)
        positive_int("every_n_train_steps", every_n_train_steps)
        # ModelCheckpoint's rule: every epoch, unless steps or time decide
        no_interval = every_n_epochs is None and every_n_train_steps is None and seconds is None
        self.every_n_epochs = 1 if no_interval else every_n_epochs
        if not isinstance(preemption, bool):
            preemption = tuple(preemption)
        self.resume = bool(preemption) if resume is None else resume
        storage = Storage(storage)  # refused now also without a checkpoint_dir
        needs_checkpoint_dir(
            checkpoint_dir, preemption=preemption, every_n_train_steps=every_n_train_steps,
            train_time_interval=seconds, resume=self.resume, async_save=async_save, every_n_epochs=every_n_epochs,
            storage=storage is not Storage.AUTO, storage_options=storage_options,
        )  # fmt: skip
        self.overwrite = overwrite
        self.monitors = MonitorAgreement(monitor_op)
        self.timeout = checked_timeout(timeout)
        self._steps_args = None
        if checkpoint_dir is not None:
            self._steps_args = dict(
                every_n_epochs=self.every_n_epochs, root=checkpoint_dir, keep=keep, storage=storage, timeout=timeout,
                async_save=async_save, save_interval_steps=every_n_train_steps, save_interval_seconds=seconds,
                preemption=preemption, storage_options=storage_options,
            )  # fmt: skip
        self.lock = StateDictLock()  # the manager's snapshots take its read side; optimizer steps its write side
        self.steps = self._new_steps()
        self._io: RankSafeCheckpointIO | None = None  # the async plugin of the current run, if any
        self._after_monitors = False  # the step's and the epoch's saves come after the last monitoring callback's
        self._polled_step = -1  # the optimizer step whose end was last checked (savers, schedule)
        self._failed = False  # Lightning is handling an exception of this stage: its saves wait less for the others
        self._stopping_read = None
        self._saving_for: weakref.ref[pl.Trainer] | None = None  # the fit whose epoch ends the module's wrapper saves

    def _new_steps(self) -> TrainerSteps | None:
        return None if self._steps_args is None else TrainerSteps(self.lock, **self._steps_args)

    @property
    def manager(self) -> CheckpointManager | None:
        """The :class:`~ranksafe.CheckpointManager` of ``checkpoint_dir``, or None without one."""
        return None if self.steps is None else self.steps.manager

    def __getstate__(self) -> dict[str, Any]:
        """``ddp_spawn`` pickles the callbacks with the Trainer: locks and threads are made anew in the worker."""
        return {**self.__dict__, "lock": None, "steps": None, "_io": None, "_saving_for": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = StateDictLock()
        self.steps = self._new_steps()

    def latest_checkpoint(self) -> str | None:
        """The file of the newest step committed on every node, the same on every rank, or None; collective.

        Under Lightning's own ``ddp`` launcher the process group exists only inside ``fit``: use
        ``resume=True`` there. With ``torchrun`` (the group initialised before the Trainer) you may pass
        ``ckpt_path=rank_safe.latest_checkpoint()`` yourself.
        """
        if self.steps is None:
            raise ValueError("latest_checkpoint() needs RankSafe(checkpoint_dir=...)")
        return self.steps.latest_checkpoint()

    # -- hooks ----------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Runs on every rank once the process group exists, before any checkpoint is loaded or saved."""
        self._failed, self._stopping_read = False, None
        self._io = _async_io(trainer)
        if self._io is not None:
            self._io._attach(self.timeout)
        self._wrap_strategy(trainer, topology.with_other_ranks())
        self._wrap_callbacks(trainer, topology.with_other_ranks())
        if trainer.state.fn == TrainerFn.FITTING:
            if self.steps is not None:
                self.steps.start_fit()
            self._take_over_signals(trainer)

    def _take_over_signals(self, trainer: pl.Trainer) -> None:
        """With preemption, for this fit: the manager's signal handlers replace Lightning's (:class:`TrainerSteps`),
        and once the stop is committed nothing validates the epoch it cut short, nor acts on a validation
        (:meth:`_scheduled_validation`, :meth:`_unless_stopped`). Without, a warning when Lightning's SLURM requeue
        handler would save with other ranks."""
        if self.steps is not None and self.manager.schedule.signals is not None:
            self.steps.prepare_preemption(trainer)
            wrap(compat.signal_connector(trainer), "register_signal_handlers", self._install_signals)
            validation_due = functools.partial(self._scheduled_validation, trainer)
            wrap(compat.epoch_loop(trainer), compat.VALIDATION_DUE, validation_due)
            monitors = _monitors(trainer)
            for cb in (cb for cb in monitors if isinstance(cb, (ModelCheckpoint, EarlyStopping))):
                last = self._after_monitors and cb is monitors[-1]  # its batch and epoch ends skip themselves
                hooks = ["on_validation_end", *(() if last else ("on_train_batch_end", "on_train_epoch_end"))]
                if isinstance(cb, ModelCheckpoint):
                    hooks.append("on_train_end")  # saves the last file
                for hook in hooks:
                    wrap(cb, hook, self._unless_stopped)
        elif compat.slurm_requeue_signal(trainer) is not None and topology.with_other_ranks() and topology.is_main():
            warnings.warn(UNAGREED_REQUEUE, stacklevel=3)

    def _wrap_strategy(self, trainer: pl.Trainer, shared: bool) -> None:
        strategy = trainer.strategy
        if shared:
            wrap(strategy, "save_checkpoint", functools.partial(self._together, "Trainer.save_checkpoint"))
            wrap(strategy, "remove_checkpoint", functools.partial(self._together, "Trainer.remove_checkpoint"))
        if shared or self.steps is not None:
            wrap(strategy, "load_checkpoint", functools.partial(self._load, trainer))
        if self._locks():
            wrap(strategy, "optimizer_step", self._holding_locks)
        if shared or self.resume or self.overwrite:
            wrap(compat.checkpoint_connector(trainer), "resume_start", functools.partial(self._resume_start, trainer))

    def _wrap_callbacks(self, trainer: pl.Trainer, shared: bool) -> None:
        monitors = _monitors(trainer)
        self._after_monitors = self.steps is not None and bool(monitors)
        if self._after_monitors:
            wrap(monitors[-1], "on_train_batch_end", functools.partial(self._hook_then, self._end_step))
            wrap(monitors[-1], "on_train_epoch_end", functools.partial(self._hook_then, self._end_epoch))
        elif self.steps is not None:  # Lightning runs the module's epoch end after every callback but the monitors'
            self._saving_for = weakref.ref(trainer)  # not in a copy of the module (or of this callback)
            wrap(trainer.lightning_module, "on_train_epoch_end", self._module_epoch_end_then_step)
        for cb in monitors:
            monitor = getattr(cb, "monitor", None)  # a stand-in (a Mock with a spec) may have none
            if isinstance(cb, ModelCheckpoint):
                wrap(cb, compat.LINK_CHECKPOINT, self._link)
                if self._io is not None:
                    wrap(cb, "file_exists", self._file_exists)
                if shared:  # also without a monitor: metrics may name the file
                    wrap(cb, compat.MONITOR_CANDIDATES, functools.partial(self._agreed_candidates, cb))
            elif isinstance(cb, EarlyStopping) and shared:
                wrap(cb, compat.CONDITION_METRIC, functools.partial(self._agreed_condition, monitor))
                wrap(cb, compat.STOPPING_CRITERIA, self._agreed_criteria)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write a probe into every ModelCheckpoint directory (resolved in their ``setup``): a directory, bucket or
        credentials that cannot be written fail every rank now instead of after the first epoch."""
        dirpaths = list(checkpoint_dirs(trainer))
        with shared_outcome("checkpoint directories: warmup", self.timeout):
            if topology.is_main():
                for dirpath in dirpaths:
                    with naming_target("cannot write checkpoints to", dirpath):
                        probe_write(dirpath)
                    if not remote.is_url(dirpath):  # temporaries of writers that crashed go before new ones appear
                        clean_orphans(dirpath)
        if self.manager is not None:
            self.manager.warmup()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The first step boundary is the end of the first optimizer step, and ``train_time_interval`` counts from
        now (not from this callback's construction, before the processes, the data and the model were set up). After a
        preemption in an earlier fit, this one stops before its first step: the job is about to end."""
        self._polled_step = trainer.global_step
        if self.manager is not None:
            self.manager.schedule.saved()
        if self.steps is not None and self.manager.preempted:  # as fastai's RankSafe: a preempted process stops
            self.steps.stopped = trainer.should_stop = True
            if topology.is_main():
                warnings.warn(PREEMPTED_BEFORE, RuntimeWarning, stacklevel=2)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """The end of an optimizer step (:meth:`_end_step`): here when no monitoring callback runs after this one,
        else right after the last of them (see ``setup``)."""
        if not self._after_monitors:
            self._end_step(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The plugin's teardown (before this hook) waited for the last write: report its outcome everywhere."""
        if self._io is not None:
            if self._io is not trainer.strategy.checkpoint_io:  # inside a wrapper, which does not pass teardown on
                self._io.teardown()
            self._io.check()
        if self.manager is not None and self.manager.async_save:  # the last commit's failure raised everywhere
            self.manager.close(keep_signal=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A rank failing alone stops the others at their current or next ranksafe collective, within seconds.
        Lightning skips ``teardown`` after an exception: the wrappers go here."""
        abort(exception)
        self._failed = True
        if self.manager is not None:
            self.manager.shutdown()  # a step committing in the background is not lost, and no thread stays
        last = trainer.callbacks[-1]
        if last is self:
            self._undo(trainer)
        else:  # a ModelCheckpoint(save_on_exception=True) after this one saves through the shared wrappers
            wrap(last, "on_exception", self._then_undo)

    def _then_undo(self, original: Callable[..., Any], trainer: pl.Trainer, *args: Any) -> None:
        """The last callback's ``on_exception``, then :meth:`_undo`. A save in it (ModelCheckpoint's
        ``save_on_exception``) goes through the wrapped strategy: if other ranks never join it (they did not fail),
        it gives up (:data:`.shared_io.EXCEPTION_SAVE_WAIT`), naming them, where Lightning's barrier after the save
        would wait until the process group's timeout."""
        try:
            original(trainer, *args)
        finally:
            self._undo(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The strategy, connectors, callbacks and signal handlers are what they were before ``setup``."""
        self._undo(trainer)

    def _undo(self, trainer: pl.Trainer) -> None:
        self._saving_for = None
        connectors = (compat.checkpoint_connector(trainer), compat.signal_connector(trainer))
        module = trainer.lightning_module
        for obj in (trainer.strategy, *connectors, compat.epoch_loop(trainer), *trainer.callbacks, module):
            if obj is not None:
                unwrap(obj)
        if self.manager is not None:
            self.manager.schedule.uninstall()
            self.manager.schedule.pass_on_unanswered(keep=True)  # a signal after the last step: the next fit stops

    def _end_step(self, trainer: pl.Trainer) -> None:
        """Once per optimizer step on every rank, not per micro-batch (only after an optimizer step are the ranks'
        weights the same): raise a failed background write on every rank, then ask the manager whether to save
        this step and whether to stop here."""
        step = trainer.global_step
        if step == self._polled_step:
            return
        self._polled_step = step
        savers = [self._io.saver] if self._io is not None else []
        if self.manager is not None and self.manager.saver is not None:
            savers.append(self.manager.saver)
        if savers:
            poll_savers(savers)
        if self.steps is not None:
            self.steps.end_step(trainer)

    def _end_epoch(self, trainer: pl.Trainer) -> None:
        """The end of a training epoch: its manager step, if one is due (:meth:`TrainerSteps.end_epoch`)."""
        if self.steps is not None:
            self.steps.end_epoch(trainer)

    # -- what the hooks of the last monitoring callback run, and the fit with preemption --------------------
    def _hook_then(
        self, end: Callable[[pl.Trainer], None], original: Callable[..., Any], trainer: pl.Trainer, *args: Any
    ) -> None:
        """The last monitoring callback's batch or epoch end (none after a preemption stop, as :meth:`_unless_stopped`
        says), then ``end``: this optimizer step's end, or this epoch's manager step."""
        self._unless_stopped(original, trainer, *args)
        end(trainer)

    def _module_epoch_end_then_step(self, original: Callable[..., Any], *args: Any) -> None:
        """The LightningModule's ``on_train_epoch_end``, then this epoch's manager step (without a monitoring
        callback): the step holds what the module and every callback did at the epoch's end, as a step saved after
        the last monitoring callback does. In a copy of the module taken during the fit (an EMA's, a pickle), whose
        copy of this callback belongs to no fit, only the module's hook."""
        original(*args)
        trainer = None if self._saving_for is None else self._saving_for()
        if trainer is not None:
            self._end_epoch(trainer)

    def _unless_stopped(self, original: Callable[..., Any], trainer: pl.Trainer, *args: Any) -> None:
        """A monitoring callback's hook (a batch's, an epoch's or a validation's end, the end of training), skipped once
        a preemption stop is saved: it would act after the commit, whose state the next run resumes from. A
        ModelCheckpoint save or removal then left a file that run never tracks (a last file saying the cut epoch was
        done, the steps Lightning trains on to reach ``min_steps``), or removed the best file that state names.
        EarlyStopping would read the metric of a validation that no longer runs (:meth:`_scheduled_validation`): with
        ``strict``, a missing one raises."""
        if not (self.steps is not None and self.steps.stopped):
            original(trainer, *args)

    def _scheduled_validation(self, trainer: pl.Trainer, original: Callable[..., Any], *args: Any) -> bool:
        """The epoch loop's question after each training batch: validate now? Lightning says yes whenever
        ``trainer.should_stop`` is set. Once a preemption step is committed, only the validations Lightning's schedule
        runs at this batch anyway (an epoch's last, ``val_check_interval``) still run: one the stop alone asks for
        would validate the epoch it cut short after the commit, in the grace time before the kill, and the resumed
        job validates that epoch at its end. A scheduled one stays: the resumed job starts after it and never runs
        it. The same answer on every rank (they stopped at the same step)."""
        if not (self.steps is not None and self.steps.stopped):
            return original(*args)
        stop = trainer.should_stop
        trainer.should_stop = False  # the schedule's answer without the stop request; nothing else runs meanwhile
        try:
            return original(*args)
        finally:
            trainer.should_stop = stop

    def _install_signals(self, original: Callable[..., Any]) -> None:
        """The signal connector's ``register_signal_handlers``, for a fit with preemption: the manager's handlers
        instead of Lightning's (which ``original`` would install). A method of RankSafe, not of its steps: what is
        installed on Lightning's objects must pickle, and RankSafe pickles without them."""
        self.manager.schedule.install(fit=True)  # type: ignore[union-attr]
