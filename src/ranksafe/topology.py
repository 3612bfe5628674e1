"""Who am I: rank, world size, local rank and node of this process.

Truth comes from the initialised process group first: a process started by ``torch.multiprocessing.spawn``
has no ``RANK`` variable, and reading the environment there makes every process believe it is rank 0
(the root of "every rank writes the same file"). Without a process group, the launchers' variables are
read (torchrun, SLURM, Open MPI, MPICH/Intel MPI), and without those this is the only process.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
# Open MPI's OMPI_COMM_WORLD_NODE_RANK is not one: it numbers the processes on a node. Open MPI and MPICH say no
# node index, which the host-name exchange then learns.
_NODE_VARS = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")

# Filled by the collectives layer on the first collective of a process group, when the launcher set no
# local-rank variable: (process group id, local rank, node index) from an exchange of host names.
_exchanged: tuple[int, int, int] | None = None


def _env_int(names: tuple[str, ...]) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                continue
    return None


def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def with_other_ranks() -> bool:
    """True when a process group of two or more ranks exists to share outcomes with (never in a ``ddp_spawn``
    parent, nor before the launcher's group is initialised)."""
    return is_distributed() and dist.get_world_size() > 1


def rank() -> int:
    """Global rank of this process: 0 .. world_size()-1."""
    if is_distributed():
        return dist.get_rank()
    return _env_int(_RANK_VARS) or 0


def world_size() -> int:
    """Number of processes in the job (1 without a launcher or process group)."""
    if is_distributed():
        return dist.get_world_size()
    return _env_int(_WORLD_VARS) or 1


def _exchanged_for_current_group() -> tuple[int, int] | None:
    if _exchanged is not None and is_distributed() and _exchanged[0] == _group_id():
        return _exchanged[1], _exchanged[2]
    return None


def local_rank() -> int:
    """Rank of this process among the processes of its node.

    From the launcher's variable when there is one; otherwise from the host-name exchange that ranksafe
    runs at the first collective of a process group; before that, a process group without launcher
    variables (``mp.spawn``) is taken to live on one node, so the local rank is the global rank.
    """
    value = _env_int(_LOCAL_RANK_VARS)
    if value is not None:
        return value
    exchanged = _exchanged_for_current_group()
    return exchanged[0] if exchanged else rank()


def node_rank() -> int:
    """Index of this process's node (0 for a single-node job)."""
    value = _env_int(_NODE_VARS)
    if value is not None:
        return value
    exchanged = _exchanged_for_current_group()
    return exchanged[1] if exchanged else 0


def hostname() -> str:
    return socket.gethostname()


def is_main() -> bool:
    """True on global rank 0: the one writer for files on storage that every rank shares."""
    return rank() == 0


def is_local_main() -> bool:
    """True on local rank 0 of each node: the writer for node-local storage."""
    return local_rank() == 0


def needs_host_exchange() -> bool:
    """Whether local rank or node must be learned from the other ranks (no launcher variable says one of them)."""
    unsaid = _env_int(_LOCAL_RANK_VARS) is None or _env_int(_NODE_VARS) is None
    return unsaid and _exchanged_for_current_group() is None


def record_host_exchange(hosts: list[str]) -> None:
    """Derive this rank's local rank and node index from every rank's host name, in rank order."""
    global _exchanged
    me = rank()
    nodes = list(dict.fromkeys(hosts))  # first-seen order: node 0 holds rank 0
    mine = hosts[me]
    _exchanged = (_group_id(), sum(1 for h in hosts[:me] if h == mine), nodes.index(mine))


def _group_id() -> int:
    return id(dist.group.WORLD)
