"""Make fastai's distributed path follow the process group, and run on CPU with gloo.

fastai learns its rank only from environment variables (``rank_distrib()`` reads ``RANK``, ``num_distrib()``
reads ``WORLD_SIZE``), and its distributed path is written for CUDA:

* under ``mp.spawn`` there is no ``RANK``: ``distrib_ctx()`` silently does nothing and every process
  believes it is rank 0 (every rank writes every file);
* with only ``WORLD_SIZE`` exported, accelerate fills in ``RANK=0`` in every process, so every rank trains
  on data shard 0;
* on a machine without CUDA, accelerate picks non-distributed mode unless told ``cpu=True`` (the model is
  never wrapped), and ``DistributedDL._broadcast`` calls ``.cuda()`` whatever the backend.

:func:`follow_process_group` writes the process group's truth into the launcher variables that fastai and
accelerate read (the same variables torchrun exports), and :func:`enable_cpu_distributed` removes the two
CUDA assumptions. Both are idempotent and change nothing in a single process, nor under a launcher whose
variables already agree with the process group.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from fastai.distributed import DistributedDL
from fastai.learner import Learner
from fastcore.basics import patch_to

from .. import topology

_PATCHED = "_ranksafe_any_backend"


def follow_process_group() -> bool:
    """Export ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` from the initialised process group.

    Returns whether a multi-process group was found. A launcher variable that contradicts the process group
    is overwritten (the process group is what the collectives use) with a warning, because a script that
    set it by hand has a bug that would otherwise shard data or pick writers wrongly.
    """
    if not topology.is_distributed() or dist.get_world_size() < 2:
        return False
    truth = {"RANK": dist.get_rank(), "WORLD_SIZE": dist.get_world_size()}
    for name, value in truth.items():
        old = os.environ.get(name)
        if old not in (None, "", str(value)):
            warnings.warn(
                f"{name}={old} in the environment contradicts the process group ({value}); using {value}",
                stacklevel=2,
            )
        os.environ[name] = str(value)
    # mp.spawn on one node: local rank is the global rank (topology refines it after its host exchange)
    os.environ.setdefault("LOCAL_RANK", str(topology.local_rank()))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(truth["WORLD_SIZE"]))
    return True


def _broadcast(self: DistributedDL, t: list, rank: int) -> list:
    """``DistributedDL._broadcast`` for any backend: a CUDA tensor only where the backend needs one (nccl)."""
    t = torch.tensor(t, dtype=torch.long)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.broadcast(t, rank)
    return t.cpu().tolist()


def enable_cpu_distributed() -> None:
    """Let ``learn.distrib_ctx()`` / ``DistributedTrainer`` train with gloo on CPU; idempotent.

    Replaces ``DistributedDL._broadcast`` by a backend-aware version (same result under nccl), and, when
    the process group runs without CUDA, sets ``ACCELERATE_USE_CPU=1`` so that the ``Accelerator`` fastai
    creates chooses multi-CPU mode and wraps the model in ``DistributedDataParallel``. Models with
    BatchNorm need ``distrib_ctx(sync_bn=False)`` on CPU: PyTorch's ``SyncBatchNorm`` has no CPU kernel.
    """
    if not getattr(DistributedDL, _PATCHED, False):
        patch_to(DistributedDL)(_broadcast)  # fastcore keeps the original as DistributedDL._orig__broadcast
        setattr(DistributedDL, _PATCHED, True)
    if topology.is_distributed() and dist.get_backend() == "gloo" and not torch.cuda.is_available():
        os.environ.setdefault("ACCELERATE_USE_CPU", "1")


def prepare_distributed() -> bool:
    """Both fixes at once: what a ranksafe-enabled Learner does when it is created or attached, and what
    ``Learner.distrib_ctx`` does on entry once ranksafe.fastai is imported (:func:`follow_in_distrib_ctx`)."""
    found = follow_process_group()
    if found:
        enable_cpu_distributed()
    return found


def follow_in_distrib_ctx() -> None:
    """Make ``Learner.distrib_ctx`` call :func:`prepare_distributed` on entry; idempotent.

    ``with learn.distrib_ctx(): learn.fit(n, cbs=[RankSafe()])`` enters the context before the callback exists:
    under ``mp.spawn`` (no ``RANK``) fastai then saw no distributed job and trained each rank on its own, without
    ``DistributedDataParallel``, while the callback went on as if it were one job.
    """
    stock = Learner.distrib_ctx
    if getattr(stock, _PATCHED, False):
        return

    @functools.wraps(stock)
    @contextlib.contextmanager
    def distrib_ctx(self: Learner, *args: Any, **kwargs: Any) -> Iterator[Learner]:
        prepare_distributed()
        with stock(self, *args, **kwargs) as learn:
            yield learn

    setattr(distrib_ctx, _PATCHED, True)
    Learner.distrib_ctx = distrib_ctx


follow_in_distrib_ctx()  # on import: distrib_ctx follows the process group, whether RankSafe is attached yet or not
