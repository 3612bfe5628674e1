"""ranksafe: saving and loading that stay correct on 1 or 1,000 processes.

One writer, a barrier inside load, decisions every rank agrees on, atomic files, and an error on one
rank raised on every rank instead of a hang.
"""

from .async_save import AsyncSaver, BusyPolicy
from .checkpoint import CheckpointManager
from .checkpoint_file import atomic_save, load_file, verify_file
from .collectives import AgreeOp, abort, abort_on_error, agree, all_gather, barrier, broadcast, main_first, together
from .commit import verify_step
from .errors import (
    BarrierTimeout,
    CollectiveMismatch,
    CorruptCheckpoint,
    EmptyCheckpoint,
    RankFailure,
    RankSafeError,
    UntrustedCheckpoint,
)
from .files import atomic_write
from .lock import StateDictLock
from .retention import BestMode
from .saving import Writer, load, prepare_dir, save
from .snapshot import Captured, StagingBuffers
from .steps import StepStatus, list_steps
from .storage import Storage, StorageKind
from .topology import is_local_main, is_main, local_rank, node_rank, rank, world_size

__version__ = "0.1.0"

__all__ = [
    "AgreeOp",
    "AsyncSaver",
    "BarrierTimeout",
    "BestMode",
    "BusyPolicy",
    "Captured",
    "CheckpointManager",
    "CollectiveMismatch",
    "CorruptCheckpoint",
    "EmptyCheckpoint",
    "RankFailure",
    "RankSafeError",
    "StagingBuffers",
    "StateDictLock",
    "StepStatus",
    "Storage",
    "StorageKind",
    "UntrustedCheckpoint",
    "Writer",
    "abort",
    "abort_on_error",
    "agree",
    "all_gather",
    "atomic_save",
    "atomic_write",
    "barrier",
    "broadcast",
    "is_local_main",
    "is_main",
    "list_steps",
    "load",
    "load_file",
    "local_rank",
    "main_first",
    "node_rank",
    "prepare_dir",
    "rank",
    "save",
    "together",
    "verify_file",
    "verify_step",
    "world_size",
]
