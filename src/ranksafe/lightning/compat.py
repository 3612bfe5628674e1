"""The private names of Lightning that ranksafe.lightning uses: each one here, once, with why no public API does.

``tests/test_lightning_compat.py`` fails, naming it, when a Lightning release renames or removes one of them.
"""

from __future__ import annotations

import signal
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment

LINK_CHECKPOINT = "_link_checkpoint"
"""``ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)``, a staticmethod: ``save_last="link"`` makes
``last.ckpt`` here, then waits in a barrier. The one place to make the link after a background write's commit,
atomically, and to share rank 0's outcome instead of leaving the other ranks in the barrier when it fails."""

MONITOR_CANDIDATES = "_monitor_candidates"
"""``ModelCheckpoint._monitor_candidates(trainer)``: the read of the monitored metric behind every ModelCheckpoint
decision (file name, top-k, last). ``trainer.callback_metrics`` cannot be agreed beforehand: each read recomputes
it from the rank's own logged values."""

CONDITION_METRIC = "_validate_condition_metric"
"""``EarlyStopping._validate_condition_metric(logs)``: whether the monitored metric was logged, which decides whether
the check goes on to the stop decision that every rank reduces. A rank that did not log it skips that reduction while
the others wait for it; the value every rank agreed is put in ``logs`` here, before Lightning reads it."""

STOPPING_CRITERIA = "_evaluate_stopping_criteria"
"""``EarlyStopping._evaluate_stopping_criteria(current)``: where the monitored value moves the patience counter,
which must move alike on every rank (its stop decision is reduced, the counter is not). Called right after Lightning
read the agreed value from ``logs``: the trainer's metrics get each rank's own value back here."""

CHECKPOINT_CONNECTOR = "_checkpoint_connector"
"""``Trainer._checkpoint_connector``: its ``resume_start(checkpoint_path, weights_only)`` is where every stage loads
its checkpoint, after the process group exists (``resume=True`` picks the path there, and every rank takes rank 0's);
its ``dump_checkpoint(weights_only)`` builds the dict that ``trainer.save_checkpoint`` writes (for
``RankSafe(checkpoint_dir=...)``). No hook offers either."""


SHARDED_METADATA = "meta.pt"
"""``lightning.fabric.utilities.load._METADATA_FILENAME``: in a sharded checkpoint of Lightning's (a directory of
DCP files), the file holding everything but the weights and optimizer states. RankSafe's steps of sharded state use
the same name, so the layout is Lightning's own."""


def checkpoint_connector(trainer: pl.Trainer) -> Any:
    """The Trainer's checkpoint connector (see :data:`CHECKPOINT_CONNECTOR`)."""
    return getattr(trainer, CHECKPOINT_CONNECTOR)


SIGNAL_CONNECTOR = "_signal_connector"
"""``Trainer._signal_connector``: its ``register_signal_handlers()``, called by every stage right before it runs,
installs Lightning's SIGTERM handler and, with ``SLURMEnvironment(auto_requeue=True)``, the requeue handler that saves
from inside the signal handler. No flag turns either off; ``RankSafe(preemption=True)`` replaces the call for one
``fit``, so that the checkpoint manager's handlers are the only ones."""

ACCELERATOR_CONNECTOR = "_accelerator_connector"
"""``Trainer._accelerator_connector.cluster_environment``: the environment Lightning's signal connector reads to
decide on a SLURM requeue. The strategy offers it only when it is a parallel one; a one-process SLURM job has it here
alone."""


VALIDATION_DUE = "_should_check_val_fx"
"""``_TrainingEpochLoop._should_check_val_fx(data_fetcher)``, of ``trainer.fit_loop.epoch_loop``: whether validation
runs after this training batch. It says yes whenever ``trainer.should_stop`` is set (so that early stopping sees the
epoch's metrics): after a preemption stop, a validation of the epoch cut short, run after the step's commit, in the
grace time before the kill, and run again by the resumed job. ``RankSafe(preemption=True)`` asks it as if no stop were
requested. No public API skips that one validation: ``limit_val_batches=0`` would also skip one Lightning's schedule
runs at that batch (an epoch's last), which the resumed job does not run again."""


def epoch_loop(trainer: pl.Trainer) -> Any:
    """The fit's training epoch loop, whose :data:`VALIDATION_DUE` RankSafe wraps."""
    return trainer.fit_loop.epoch_loop


def trained_batches(trainer: pl.Trainer) -> int:
    """The training batches this Trainer has completed, over all its fits (restored from a checkpoint it resumed
    from). ``trainer.global_step`` counts optimizer steps, which stay 0 under manual optimization without Lightning's
    optimizer wrapper."""
    return epoch_loop(trainer).batch_progress.total.completed


def signal_connector(trainer: pl.Trainer) -> Any:
    """The Trainer's signal connector (see :data:`SIGNAL_CONNECTOR`)."""
    return getattr(trainer, SIGNAL_CONNECTOR)


def cluster_environment(trainer: pl.Trainer) -> Any:
    """The cluster environment Lightning's signal handling reads (see :data:`ACCELERATOR_CONNECTOR`)."""
    return getattr(trainer, ACCELERATOR_CONNECTOR).cluster_environment


def slurm_requeue_signal(trainer: pl.Trainer) -> signal.Signals | None:
    """The signal after which ``SLURMEnvironment(auto_requeue=True)`` asks for a requeue of the job, or None when
    the Trainer's cluster environment asks for none."""
    environment = cluster_environment(trainer)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return signal.Signals(environment.requeue_signal)
    return None
