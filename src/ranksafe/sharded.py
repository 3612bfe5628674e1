"""Sharded state: tensors whose values are spread over several ranks (``DTensor`` sharded by FSDP2 or tensor
parallelism, FSDP1's ``ShardedTensor``), saved and loaded through ``torch.distributed.checkpoint`` (DCP) inside a
step's commit.

A sharded ``DTensor`` holds only this rank's part of the tensor. Saved by one writer, a checkpoint would keep that
writer's shard and drop every other rank's, silently; so the single-writer saves (``ranksafe.save``,
``AsyncSaver.save``) refuse it, on every rank (every rank holds the same structure, so every rank finds the same
tensors). :class:`~ranksafe.CheckpointManager` saves it with DCP's own file format instead:

* every rank writes its shards with DCP's ``FileSystemWriter`` into the step's temporary directory, each file
  counted and CRC'd on its way to disk; DCP gathers every rank's write results to its coordinator (rank 0, the
  step's writer), and with them each rank's files (:class:`~ranksafe.shards.StepShardWriter`), so the manifest
  covers them all;
* no rank enters DCP's collectives before every rank said, in the step's "written" exchange, that it can (its
  block done, its snapshot taken): :class:`~ranksafe.shards.StepShards`, the sharded part of a step's save;
* a failure on any rank is shared by DCP's own collectives: every rank raises the same
  :class:`~ranksafe.RankFailure`, naming the rank and its error (:func:`~ranksafe.shards.write_shards`,
  :func:`~ranksafe.shards.read_shards`);
* loading verifies the step with the work split among the ranks (:func:`verify_shares`), then reads in place with
  ``dcp.load``, which reshards to the current world size and placements.

Every rank reads every shard when it reshards, so the directory must be one that every rank sees
(:func:`require_shared`). The step is plain DCP plus ``MANIFEST.json``: ``dcp.load`` reads it without ranksafe.

This module finds sharded state and checks where it may go; :mod:`ranksafe.shards` writes and reads it through DCP,
and is imported only where a step holds some.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from . import remote, topology
from .commit import Place, verify_step
from .flatten import dtensor_type
from .remote import Remote
from .storage import Placement, StorageKind
from .torch_compat import sharded_tensor_type

METADATA = ".metadata"  # DCP's own index of a checkpoint, written last by its coordinator
_DCP_FILE = re.compile(r"__\d+_\d+\.distcp|\.metadata(\.tmp)?")  # what DCP's FileSystemWriter names its files


def dcp_files(names: Iterable[str]) -> list[str]:
    """The ``names`` that DCP writes in a step of sharded state (``__0_0.distcp``, ``.metadata``), sorted: another
    file of that name would be replaced by DCP's, or replace it."""
    return sorted({name for name in names if _DCP_FILE.fullmatch(name)})


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)})


# -- what is sharded -----------------------------------------------------------------------------------


_PICKLED_WHOLE = (torch.nn.Module, torch.optim.Optimizer)  # hold their tensors: a pickle of one holds them too


def _sharded_kinds() -> tuple[type, ...]:
    """The types of tensors spread over ranks that some state may hold by now: ``DTensor`` (FSDP2, tensor
    parallelism) and FSDP1's ``ShardedTensor``, each once its module is imported (a state can hold one only then)."""
    return tuple(kind for kind in (dtensor_type(), sharded_tensor_type()) if kind is not None)


def _holds(obj: Any, kinds: tuple[type, ...], in_objects: bool = False, seen: set[int] | None = None) -> bool:
    """Whether nested dicts, lists and tuples hold a tensor of one of ``kinds`` (``in_objects``: also inside a module
    or an optimizer among them). Called on every save, so a container of plain values (a model's state dict) is looked
    at in one C loop over its values' types. ``seen``: the containers looked into already (one may hold itself)."""
    values = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else None
    if values is None:
        if in_objects and isinstance(obj, _PICKLED_WHOLE):
            return any(isinstance(t, kinds) for _, t in _tensors_of(obj))
        return isinstance(obj, kinds)
    if _PLAIN.issuperset(map(type, values)):
        return False
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    return any(_holds(v, kinds, in_objects, seen) for v in values)


def _tensors_of(obj: torch.nn.Module | torch.optim.Optimizer) -> Iterator[tuple[str, Any]]:
    """A module's parameters and buffers, or an optimizer's parameters, by name."""
    if isinstance(obj, torch.nn.Module):
        yield from obj.named_parameters()
        yield from obj.named_buffers()
        return
    for i, group in enumerate(obj.param_groups):
        for j, param in enumerate(group["params"]):
            yield f"param_groups[{i}]['params'][{j}]", param


def _leaves(obj: Any, key: str, seen: set[int] | None = None) -> Iterator[tuple[str, Any]]:
    """``(key path, value)`` of every value in nested dicts, lists and tuples (``"model.w"``, ``"groups[0]"``), and of
    every tensor of a module or an optimizer among them; a container met again (one that holds itself) is skipped."""
    seen = set() if seen is None else seen
    if isinstance(obj, (Mapping, list, tuple)):
        if id(obj) in seen:
            return
        seen.add(id(obj))
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k), seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{key}[{i}]", seen)
    elif isinstance(obj, _PICKLED_WHOLE):
        for name, t in _tensors_of(obj):
            yield f"{key}.{name}" if key else name, t
    else:
        yield key, obj


def _spread(t: Any, dtensor: type | None) -> tuple[str, ...] | None:
    """How ``t`` is spread over ranks, described (``DTensor`` placements, or a ``ShardedTensor``'s shards); None for a
    tensor whole on every rank (a plain one, or a ``DTensor`` replicated on its whole mesh). A ``ShardedTensor`` is
    spread even in one shard when there are several ranks: its pickle holds the saving rank's shards and loads on
    that rank only."""
    if dtensor is not None and isinstance(t, dtensor):
        if t.device_mesh.size() > 1 and not all(p.is_replicate() for p in t.placements):
            return tuple(map(repr, t.placements))
        return None
    sharded_tensor = sharded_tensor_type()
    if sharded_tensor is not None and isinstance(t, sharded_tensor) and topology.world_size() > 1:
        shards = len(t.metadata().shards_metadata)
        return (f"ShardedTensor in {shards} shard{'s' if shards > 1 else ''}",)
    return None


def sharded_tensors(state: Any) -> dict[str, tuple[str, ...]]:
    """The tensors in ``state`` that are spread over ranks, by key path, described (:func:`_spread`:
    ``{"model.w": ("Shard(dim=0)",)}``), also those of a module or an optimizer in ``state``, which a pickle of it
    holds."""
    kinds = _sharded_kinds()
    if not kinds or not _holds(state, kinds, in_objects=True):
        return {}
    dtensor = dtensor_type()
    return {key: spread for key, t in _leaves(state, "") if (spread := _spread(t, dtensor)) is not None}


def refuse_sharded(state: Any, what: str) -> None:
    """Raise ``ValueError`` when ``state`` holds sharded tensors (:func:`sharded_tensors`): ``what`` would keep one
    rank's shards only."""
    found = sharded_tensors(state)
    if not found:
        return
    shown = ", ".join(f"{k!r} {', '.join(p)}" for k, p in list(found.items())[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    raise ValueError(
        f"{what}: the state holds sharded tensors ({shown}{more}); one writer would save its own shards only and "
        "drop the other ranks'. Save it in a dict with CheckpointManager.save(step, {'model': ..., 'optim': ...}), "
        "where every rank writes its shards (torch.distributed.checkpoint), or gather full tensors first "
        "(torch.distributed.checkpoint.state_dict.get_state_dict with StateDictOptions(full_state_dict=True))"
    )


def for_dcp(state: Any) -> dict[str, Any] | None:
    """``state`` as DCP saves it when it holds a ``DTensor`` (top-level ``Stateful`` objects, such as an app state
    wrapping a model and its optimizer, replaced by their ``state_dict()``, as ``dcp.save`` does); else None."""
    kinds = _sharded_kinds()
    if not kinds or not isinstance(state, Mapping):
        return None
    from torch.distributed.checkpoint.stateful import Stateful  # imported with DTensor by now: see dtensor_type

    flat = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
    return flat if _holds(flat, kinds) else None


def require_shared(where: Placement, root: str) -> None:
    """Refuse a root that not every rank sees whole: to reshard, every rank reads every rank's shards. ``where``:
    the root's placement, agreed by every rank, so every rank raises alike."""
    if remote.is_url(root):
        why = "remote storage is not supported for sharded state. Use a shared file system (NFS, Lustre)"
    elif where.kind is not StorageKind.SHARED:
        why = (
            f"this one is {where.kind} (each node sees its own copy). Use a shared file system (NFS, Lustre), or "
            "pass storage='shared' if it is one"
        )
    else:
        return
    raise ValueError(
        f"{root} (rank {topology.rank()}): sharded state needs a directory every rank shares, since every rank "
        f"reads every shard to reshard at load; {why}"
    )


# -- loading ------------------------------------------------------------------------------------------------


def verify_shares(step_dir: Place) -> dict[str, Any]:
    """Every rank: check this rank's share of the step's files against the manifest (the files split among the
    ranks, so no rank reads them all), and that the step holds DCP's state; return the manifest.

    Raises :class:`~ranksafe.CorruptCheckpoint` naming a bad file, ``ValueError`` for a step saved without
    sharded state."""
    manifest = verify_step(step_dir, share=(topology.rank(), topology.world_size()))
    if METADATA not in manifest["files"]:
        where = step_dir.url if isinstance(step_dir, Remote) else step_dir
        raise ValueError(f"{where} holds no sharded state (no {METADATA}): load it without into=")
    return manifest
