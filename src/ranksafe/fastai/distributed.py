"""Point fastai's distributed path at the process group, and let it run under gloo on CPU.

fastai learns its rank only from ``RANK``/``WORLD_SIZE``: under ``mp.spawn`` there are none, and ``distrib_ctx()``
does nothing (every process believes it is rank 0); with only ``WORLD_SIZE``, accelerate sets ``RANK=0`` everywhere
(every rank trains on shard 0). Without CUDA, accelerate picks non-distributed mode unless told ``cpu=True``, and
``DistributedDL`` sends its sample order through a CUDA tensor whatever the backend. :func:`prepare_distributed`
exports the process group's ranks as torchrun would; :func:`any_backend` fixes one loader's broadcast, without
changing fastai's class; :func:`refuse_training_alone` stops a fit in which fastai would train each rank alone.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from fastai.callback.core import Callback
from fastai.distributed import DistributedDL, DistributedTrainer
from torch.nn.parallel import DistributedDataParallel

from .. import topology
from . import compat


def follow_process_group() -> bool:
    """Export ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` from the initialised process group.

    Returns whether ``RANK`` or ``WORLD_SIZE`` had to be written: fastai could not have seen the job before. A
    launcher variable that contradicts the process group is overwritten, with a warning: a script that set it by
    hand would otherwise shard data or pick writers wrongly.
    """
    if not topology.with_other_ranks():
        return False
    written = False
    for name, value in (("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size())):
        old = os.environ.get(name)
        if old not in (None, "", str(value)):
            warnings.warn(f"{name}={old} in the environment contradicts the process group ({value})", stacklevel=2)
        written |= old != str(value)
        os.environ[name] = str(value)
    # mp.spawn on one node: the local rank is the global rank (topology refines it after its host exchange)
    os.environ.setdefault("LOCAL_RANK", str(topology.local_rank()))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(dist.get_world_size()))
    return written


def prepare_distributed() -> bool:
    """:func:`follow_process_group`, and under gloo without CUDA ``ACCELERATE_USE_CPU=1``, so that the Accelerator
    ``distrib_ctx()`` creates wraps the model in ``DistributedDataParallel`` (multi-CPU mode). Idempotent; returns
    what :func:`follow_process_group` returns."""
    written = follow_process_group()
    if topology.with_other_ranks() and dist.get_backend() == "gloo" and not torch.cuda.is_available():
        os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    return written


def trains_as_one_job(learn: Any) -> bool:
    """Whether the ranks train one model: fastai's ``DistributedTrainer`` is on (``distrib_ctx``), or the model is
    wrapped in ``DistributedDataParallel`` or FSDP by hand. (FSDP is looked for only once its module is imported.)"""
    if any(isinstance(cb, DistributedTrainer) for cb in learn.cbs):
        return True
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kinds = (DistributedDataParallel, *((fsdp.FSDPModule, fsdp.FullyShardedDataParallel) if fsdp else ()))
    return any(isinstance(module, kinds) for module in learn.model.modules())


def refuse_training_alone(learn: Any, late: bool) -> None:
    """At the start of a fit on several ranks: raise if fastai trains each rank alone because the ranks were exported
    too ``late`` for it (under ``mp.spawn``, no ``RANK``: ``distrib_ctx`` was entered before the process group's
    ranks were exported, and added no ``DistributedTrainer``; every rank lacked ``RANK``, so every rank raises). Warn
    where the launcher gave the ranks (torchrun) but no ``distrib_ctx`` was entered, as stock fastai trains each rank
    alone then."""
    if trains_as_one_job(learn):
        return
    if late:
        raise RuntimeError(
            f"rank {topology.rank()}: fastai sees no distributed job: RANK and WORLD_SIZE were not in the "
            "environment when learn.distrib_ctx() was entered (or it was not), so the model is not wrapped in "
            "DistributedDataParallel and each rank would train alone. Initialise the process group, then make "
            "RankSafe (or its Learner) before entering distrib_ctx, or call ranksafe.fastai.prepare_distributed() "
            "right after init_process_group."
        )
    warnings.warn(
        f"rank {topology.rank()}: {topology.world_size()} ranks, but the model is not wrapped in "
        "DistributedDataParallel: each rank trains alone, on all the data. Fit inside learn.distrib_ctx()",
        RuntimeWarning,
        stacklevel=3,
    )


def _broadcast(t: list, rank: int) -> list:
    """``DistributedDL``'s broadcast for any backend: a CUDA tensor only where the backend needs one (nccl)."""
    tensor = torch.tensor(t, dtype=torch.long)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.broadcast(tensor, rank)
    return tensor.cpu().tolist()


def any_backend(loaders: Iterable[Any]) -> None:
    """Let the ``DistributedDL`` among ``loaders`` broadcast under any backend. ``DistributedTrainer`` makes them for
    one pass and drops them after it, so what is set goes with them (a module-level function: they still pickle)."""
    for dl in loaders:
        if isinstance(dl, DistributedDL):
            compat.set_broadcast(dl, _broadcast)


class CPUDistributed(Callback):
    """Let ``learn.distrib_ctx()`` train under gloo on CPU, for a Learner without ``RankSafe`` (which does this too);
    call :func:`prepare_distributed` before ``distrib_ctx``. BatchNorm needs ``distrib_ctx(sync_bn=False)`` on CPU."""

    order = DistributedTrainer.order + 1  # right after it has wrapped the loaders

    def before_fit(self) -> None:
        """Fix the loaders ``DistributedTrainer`` has just wrapped."""
        any_backend(self.learn.dls.loaders)

    def before_train(self) -> None:
        """Fix the loader of this pass (``DistributedTrainer`` wraps a loader it has not seen yet)."""
        any_backend([self.learn.dl])

    before_validate = before_train
