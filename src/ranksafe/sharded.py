"""Sharded state: tensors whose values are spread over several ranks (``DTensor`` sharded by FSDP2 or tensor
parallelism).

A sharded ``DTensor`` holds only this rank's part of the tensor. Saved by one writer, a checkpoint would keep that
writer's shard and drop every other rank's, silently; loaded, it would hand rank 0's shard to every rank. Until
such state is saved through a per-rank format, the single-writer saves refuse it, on every rank (every rank holds
the same structure, so every rank finds the same tensors).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

try:  # DTensor exists wherever torch.distributed is built in; keep the module importable without it
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)})


def _holds_dtensor(obj: Any) -> bool:
    """Whether nested dicts, lists and tuples hold a ``DTensor``. Called on every save, so a container of plain
    values (a model's state dict) is looked at in one C loop over its values' types."""
    values = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else None
    if values is None:
        return isinstance(obj, DTensor)
    return not _PLAIN.issuperset(map(type, values)) and any(map(_holds_dtensor, values))


def _leaves(obj: Any, key: str) -> Iterator[tuple[str, Any]]:
    """``(key path, value)`` of every value in nested dicts, lists and tuples (``"model.w"``, ``"groups[0]"``)."""
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{key}[{i}]")
    else:
        yield key, obj


def sharded_tensors(state: Any) -> dict[str, Any]:
    """The ``DTensor`` objects in ``state`` that are not replicated on every rank of their mesh, by key path, with
    their placements (``{"model.w": (Shard(dim=0),)}``)."""
    if DTensor is None or not _holds_dtensor(state):
        return {}
    return {
        key: tuple(t.placements)
        for key, t in _leaves(state, "")
        if isinstance(t, DTensor) and t.device_mesh.size() > 1 and not all(p.is_replicate() for p in t.placements)
    }


def refuse_sharded(state: Any, what: str) -> None:
    """Raise ``ValueError`` when ``state`` holds sharded tensors (:func:`sharded_tensors`): ``what`` would keep one
    rank's shards only."""
    found = sharded_tensors(state)
    if not found:
        return
    shown = ", ".join(f"{k!r} {', '.join(map(repr, p))}" for k, p in list(found.items())[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    raise ValueError(
        f"{what}: the state holds sharded DTensors ({shown}{more}); one writer would save its own shards only and "
        "drop the other ranks'. Gather them into full tensors first (torch.distributed.checkpoint.state_dict."
        "get_state_dict with StateDictOptions(full_state_dict=True)), or save every rank's shard with "
        "CheckpointManager.save(..., sharded=True)"
    )
