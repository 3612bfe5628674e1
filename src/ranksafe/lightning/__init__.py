"""ranksafe for Lightning: ``Trainer(callbacks=[RankSafe(), ModelCheckpoint(...)], plugins=[RankSafeCheckpointIO()])``.

:class:`RankSafeCheckpointIO` writes atomic, fsynced, checksummed files (in the background with
``async_save=True``) and refuses torn ones. :class:`RankSafe` shares the writer's outcome with every rank and agrees
monitored metrics, so that a failure is one error everywhere within seconds instead of a hang; with
``checkpoint_dir=...`` it also keeps the Trainer's full state in a :class:`~ranksafe.CheckpointManager`, resumes from
it, and turns a preemption signal into one committed step of every rank.
"""

from ..monitor import MonitorAgreement, MonitorOp, UnsyncedMetricWarning
from .callback import RankSafe
from .io import RankSafeCheckpointIO

__all__ = ["MonitorAgreement", "MonitorOp", "RankSafe", "RankSafeCheckpointIO", "UnsyncedMetricWarning"]
