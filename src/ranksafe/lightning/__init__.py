"""ranksafe for Lightning: ``Trainer(callbacks=[RankSafe(), ModelCheckpoint(...)], plugins=[RankSafeCheckpointIO()])``.

:class:`RankSafeCheckpointIO` writes atomic, fsynced, checksummed files and refuses torn ones;
:class:`RankSafe` shares the writer's outcome with every rank and agrees monitored metrics, so that a
failure is one error everywhere within seconds instead of a hang.

``RankSafeCheckpointIO(async_save=True)`` writes in the background: old checkpoints are removed only once the
new one is committed, and a failed write is raised on every rank at the end of the next training step.
``RankSafe(checkpoint_dir=..., keep=3, resume=True)`` also keeps the Trainer's full state in a
:class:`~ranksafe.CheckpointManager` (atomic step directories, a copy on every node) and resumes from the
latest step every node has: every epoch, every ``every_n_train_steps`` or ``train_time_interval`` (rank 0's clock),
the same steps on every rank. With ``preemption=True`` a SIGTERM or SIGUSR1 to any rank becomes one committed step of
every rank and a normal end of ``fit`` (then, under SLURM, the requeue Lightning would have made).
"""

from ..monitor import MonitorAgreement, MonitorOp, UnsyncedMetricWarning
from .callback import RankSafe
from .io import RankSafeCheckpointIO

__all__ = ["MonitorAgreement", "MonitorOp", "RankSafe", "RankSafeCheckpointIO", "UnsyncedMetricWarning"]
