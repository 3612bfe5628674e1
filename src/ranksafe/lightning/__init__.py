"""ranksafe for Lightning: ``Trainer(callbacks=[RankSafe(), ModelCheckpoint(...)], plugins=[RankSafeCheckpointIO()])``.

:class:`RankSafeCheckpointIO` writes atomic, fsynced, checksummed files and refuses torn ones;
:class:`RankSafe` shares the writer's outcome with every rank and agrees monitored metrics, so that a
failure is one error everywhere within seconds instead of a hang.
"""

from .callback import RankSafe
from .io import RankSafeCheckpointIO
from .monitor import MonitorAgreement, UnsyncedMetricWarning

__all__ = ["MonitorAgreement", "RankSafe", "RankSafeCheckpointIO", "UnsyncedMetricWarning"]
