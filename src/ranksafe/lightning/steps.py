"""``RankSafe(checkpoint_dir=...)``: the Trainer's full checkpoint kept as the numbered steps of a
:class:`~ranksafe.CheckpointManager`.

:class:`TrainerSteps` decides nothing itself: the manager says when to save (its schedule, asked on every rank once
per optimizer step) and when a preemption stops the fit. It turns those answers into Lightning's terms: the
Trainer's checkpoint as a step's state (its weights and optimizer states through DCP when they are sharded), a stop
request (and SLURM's requeue) after the preemption step, and a step loaded back in place of a file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import Strategy

from .. import remote
from ..checkpoint import STATE, CheckpointManager
from ..checkpoint_file import load_file
from ..collectives import agree, together
from ..lock import StateDictLock
from ..preemption import requeue_slurm_job
from ..sharded import METADATA, for_dcp
from . import compat


class TrainerSteps:
    """The manager steps of one :class:`~ranksafe.lightning.RankSafe`: what its hooks call, on every rank.

    ``every_n_epochs``: save at the end of every this many epochs (``None``: no epoch saves); the manager's
    arguments (``root``, ``keep``, the step and time intervals, ``preemption``...) say the rest.
    """

    def __init__(self, lock: StateDictLock, every_n_epochs: int | None, **manager_args: Any):
        self.manager = CheckpointManager(**manager_args, lock=lock)
        # the manager installs its signal handlers at once; RankSafe's are in place only while a fit runs
        self.manager.schedule.uninstall()
        self.every_n_epochs = every_n_epochs
        self._requeue: signal.Signals | None = None  # the run's SLURMEnvironment requeues the job after this signal
        self.stopped = False  # this fit's preemption step is saved: only stop requests from now on (same on every rank)
        self._saved_step: int | None = None  # the global step last saved: a step and an epoch rule may both fall on it
        self._resuming: int | None = None  # the step resume=True chose, until it is loaded (it may fall back)

    def latest_checkpoint(self) -> str | None:
        """The file of the newest step committed on every node (its directory for a step of sharded state), or
        None; collective."""
        step = self.manager.latest()
        if step is None:
            return None
        step_dir = self.manager.step_dir(step)
        return step_dir if self._sharded(step) else os.path.join(step_dir, STATE)

    @contextlib.contextmanager
    def resuming(self) -> Iterator[str | None]:
        """For ``resume=True``: :meth:`latest_checkpoint`, whose load inside the block falls back to the newest older
        step that verifies where that one is damaged (with a warning; the Trainer's ``ckpt_path`` still names the
        damaged one). A load of that step after the block, named by the user, does not. Collective."""
        path = self.latest_checkpoint()
        self._resuming = None if path is None else self.manager.step_of(path)
        try:
            yield path
        finally:
            self._resuming = None

    def _sharded(self, step: int) -> bool:
        """Whether ``step`` holds sharded state (DCP's ``.metadata``), decided alike on every rank: a file one rank
        does not see yet is there for all. A plain step that lost its ``state.pt`` is still plain: its load says
        so, or falls back. Collective."""
        metadata = os.path.join(self.manager.step_dir(step), METADATA)
        seen = remote.exists(metadata, self.manager.storage_options)
        return bool(agree(seen, "any", name=f"sharded step {step}", timeout=self.manager.timeout))

    # -- a fit -----------------------------------------------------------------------------------------------

    def start_fit(self) -> None:
        """At ``setup`` of a fit: nothing of it is saved or stopped yet (a RankSafe may serve several fits)."""
        self.stopped, self._saved_step = False, None

    def prepare_preemption(self, trainer: pl.Trainer) -> None:
        """At ``setup`` of a fit with preemption: this fit may stop once, and SLURM's requeue, if the run's environment
        asks for one, follows the preemption step's commit. Installs nothing (the manager's schedule does, in place of
        Lightning's ``register_signal_handlers``)."""
        self._requeue = compat.slurm_requeue_signal(trainer)
        handled = self.manager.schedule.signals.signals  # type: ignore[union-attr]
        if self._requeue is not None and self._requeue not in handled:  # else nobody would handle it: the job ends
            raise ValueError(
                f"SLURMEnvironment requeues on {self._requeue.name}, but RankSafe(preemption=...) handles "
                f"{', '.join(s.name for s in handled)}: add signal.{self._requeue.name} to preemption"
            )

    def end_step(self, trainer: pl.Trainer) -> None:
        """At the end of an optimizer step, on every rank: save this step if the manager says so, and stop after a
        preemption."""
        if self.manager.should_save(trainer.global_step) and not self.stopped:
            self.save(trainer)
        if self.manager.preempted:
            self._stop(trainer)

    def end_epoch(self, trainer: pl.Trainer) -> None:
        """Every ``every_n_epochs``-th epoch's save; none after a preemption (its step is saved, and a checkpoint of
        the epoch cut short would resume at the next one, skipping the rest of this one)."""
        if self.every_n_epochs is None or self.manager.preempted:
            return
        if (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer)

    def save(self, trainer: pl.Trainer) -> None:
        """The Trainer's full checkpoint as step ``trainer.global_step``, once: a step interval that ends an epoch
        saves at the batch's end, and the epoch's save then skips it, as ModelCheckpoint skips a step it has saved.
        Collective."""
        if trainer.global_step == self._saved_step:
            return
        self._saved_step = trainer.global_step
        checkpoint = compat.checkpoint_connector(trainer).dump_checkpoint(weights_only=False)
        sharded = for_dcp(checkpoint)
        if sharded is None:
            self.manager.save(trainer.global_step, checkpoint)
            return
        # sharded (ModelParallelStrategy): the weights and optimizer states through DCP, every rank its part, and
        # the rest in one file, as Lightning lays out its own sharded checkpoints
        shards = {"state_dict": sharded.pop("state_dict")}
        shards.update({f"optimizer_{i}": s for i, s in enumerate(sharded.pop("optimizer_states", []))})
        self.manager.save(trainer.global_step, shards, extra_files={compat.SHARDED_METADATA: sharded})

    def _stop(self, trainer: pl.Trainer) -> None:
        """After the preemption step's save, on every rank: wait for its commit, requeue the SLURM job if asked,
        and stop. Asked again (a loop that ``min_epochs`` or ``min_steps`` keeps going), only the stop request."""
        if not self.stopped:
            self.stopped = True
            if self.manager.async_save:
                self.manager.wait()  # this writer's commit; check() hears of every writer's
                self.manager.check()
            if self._requeue is not None and self._requeue_asked() and trainer.is_global_zero:
                requeue_slurm_job()
        trainer.should_stop = True

    def _requeue_asked(self) -> bool:
        """Whether any rank received the requeue signal (as in Lightning, a SIGTERM alone stops without requeue:
        ``scancel`` sends it); collective."""
        received = self.manager.schedule.signals.received  # type: ignore[union-attr]
        asked = received is not None and received == self._requeue
        return bool(agree(asked, "any", name="SLURM requeue", timeout=self.manager.timeout))

    # -- loading ---------------------------------------------------------------------------------------------

    def load(
        self,
        trainer: pl.Trainer,
        step: int,
        checkpoint_path: Any,
        weights_only: bool | None,
        original: Callable[..., Any] | None = None,
    ) -> Any:
        """Step ``step``, named by ``checkpoint_path`` (its ``state.pt`` or its directory), verified against its
        manifest on every node; what the strategy's ``load_checkpoint`` (``original``) returns. A strategy with a
        ``load_checkpoint`` of its own (FSDP, ModelParallel, DeepSpeed) puts the weights and optimizer states in place
        there, and its ``load_model_state_dict`` does nothing: it reads the verified ``state.pt`` itself. Collective."""
        fallback, self._resuming = step == self._resuming, None
        if remote.canonical(checkpoint_path) == self.manager.step_dir(step) and self._sharded(step):
            return self._load_sharded(trainer, step, weights_only, fallback)  # named by its directory, as resumed
        own_loader = original is not None and type(trainer.strategy).load_checkpoint is not Strategy.load_checkpoint
        read = functools.partial(original, weights_only=weights_only) if own_loader else None
        return self.manager.load(None if fallback else step, fallback, weights_only=weights_only, read=read)

    def _load_sharded(
        self, trainer: pl.Trainer, step: int, weights_only: bool | None, fallback: bool
    ) -> dict[str, Any]:
        """A step of sharded state into the strategy's model and optimizers, in place, resharded to this run; returns
        the rest of the checkpoint (what the strategy's own ``load_checkpoint`` returns). ``fallback``: ``step`` is the
        newest, which a resume may fall back from."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        model, optimizers = trainer.strategy.model, trainer.strategy.optimizers
        into = {"state_dict": get_model_state_dict(model)}
        into.update({f"optimizer_{i}": get_optimizer_state_dict(model, opt) for i, opt in enumerate(optimizers)})
        self.manager.load(None if fallback else step, fallback, weights_only=weights_only, into=into)
        step = self.manager.loaded_step  # type: ignore[assignment]  # the step loaded, after any fallback
        strict = StateDictOptions(strict=trainer.lightning_module.strict_loading)
        set_model_state_dict(model, into["state_dict"], options=strict)
        for i, opt in enumerate(optimizers):
            set_optimizer_state_dict(model, opt, into[f"optimizer_{i}"])
        rest = os.path.join(self.manager.step_dir(step), compat.SHARDED_METADATA)
        with together("Trainer.load_checkpoint: the rest", self.manager.timeout):
            return load_file(rest, weights_only=weights_only)
