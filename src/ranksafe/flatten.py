"""A state taken apart for a snapshot: its structure, with a slot where each tensor was, and those tensors.

:class:`Flattened` walks a state once. Containers are copied, each tensor that a flat copy can hold is replaced by
a slot, everything else is deep-copied at once (what the caller changes later never reaches the snapshot).
:meth:`Flattened.assemble` puts copies of the tensors back into the slots, dressed as the originals were (a
Parameter, a DTensor, ``requires_grad``), one object again where the state held one object twice. Local.
"""

from __future__ import annotations

import copy
import sys
from collections import UserDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .torch_compat import sharded_tensor_type


def dtensor_type() -> type | None:
    """``DTensor``, once something has imported it; else None, and then no state holds one (a DTensor is made only
    through its module). Not imported here: ``torch.distributed.tensor`` costs most of a second at import, in every
    process of a job, and most jobs never make a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


# Immutable leaves: deepcopy would return them unchanged, at the price of a call each.
_ATOMS = frozenset({int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size})
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_COMPRESSED = frozenset({torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})


class _Slot:
    """Where staged tensor number ``index`` goes in a captured structure."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass(frozen=True)
class _AsPlain:
    """How a staged copy becomes what ``torch.save`` keeps of a plain tensor or a Parameter: a Parameter stays one; a
    plain tensor that requires grad (a leaf such as SAC's ``log_alpha``) still does; Python attributes set on it
    (Megatron's ``partition_dim``) come along, as they were when the snapshot was taken."""

    parameter: bool
    requires_grad: bool
    attributes: dict[str, Any] | None = None

    def dress(self, staged: torch.Tensor) -> torch.Tensor:
        if self.parameter:
            dressed = torch.nn.Parameter(staged, requires_grad=self.requires_grad)
        else:
            dressed = staged.detach().requires_grad_(self.requires_grad)  # a new object: the staged one is reused
        if self.attributes:
            vars(dressed).update(self.attributes)
        return dressed


@dataclass(frozen=True)
class _AsDTensor:
    """A DTensor rebuilt around the staged copy of its local shard, with the original's mesh, placements, global
    shape and strides, by DTensor's own flatten/unflatten protocol (``DTensor.from_local`` would move the staged
    shard back to the mesh's device)."""

    inner: dict[str, Any]  # what __tensor_flatten__ names, the local shard under ``local``
    local: str
    context: Any
    shape: torch.Size
    stride: tuple[int, ...]

    def dress(self, staged: torch.Tensor) -> torch.Tensor:
        unflatten = dtensor_type().__tensor_unflatten__  # type: ignore[union-attr]  # loaded: a DTensor was met
        return unflatten({**self.inner, self.local: staged}, self.context, self.shape, self.stride)


Clothes = _AsPlain | _AsDTensor
_REQUIRES_GRAD = _AsPlain(parameter=False, requires_grad=True)


def _dtensor_parts(t: Any) -> tuple[torch.Tensor, _AsDTensor]:
    """A DTensor's local shard, and how to make its staged copy that DTensor again."""
    names, context = t.__tensor_flatten__()
    inner = {name: getattr(t, name) for name in names}
    (local,) = [name for name, value in inner.items() if isinstance(value, torch.Tensor)]
    return inner[local], _AsDTensor(inner, local, context, t.shape, t.stride())


def _stageable(t: torch.Tensor) -> tuple[torch.Tensor, Clothes | None] | None:
    """The tensor whose values a snapshot stages for ``t`` (a DTensor's local shard) and how to dress the staged
    copy; None where no flat copy can hold ``t``: an unknown subclass, or a sparse, nested, quantized or meta one."""
    kind = type(t)
    if kind is torch.Tensor:
        local, clothes = t, (_REQUIRES_GRAD if t.requires_grad else None)
    elif kind is torch.nn.Parameter:
        local, clothes = t, _AsPlain(parameter=True, requires_grad=t.requires_grad)
    elif kind is dtensor_type():
        local, clothes = _dtensor_parts(t)
        if type(local) not in _PLAIN:
            return None
    else:
        return None
    if local.layout is not torch.strided or local.is_quantized or local.is_nested or local.is_meta:
        return None
    return local, clothes


class Flattened:
    """``state`` after one walk: :attr:`skeleton`, a copy of its structure with a slot for each tensor to stage, and
    :attr:`sources`, those tensors (a DTensor's local shard for the DTensor).

    Walked: dicts (and their subclasses), UserDicts, lists, tuples and namedtuples. Every other leaf, and any other
    container, is deep-copied now. A tensor met twice gets two slots, made one object again by :meth:`assemble`; a
    container met twice (or inside itself) is copied once, as pickle keeps it one object."""

    def __init__(self, state: Any) -> None:
        self.sources: list[torch.Tensor] = []  # the tensors to stage, in slot order
        self.originals: list[torch.Tensor] = []  # the tensor each source stands for (a DTensor for its shard)
        self._clothes: dict[int, Clothes] = {}  # by slot: how a staged copy is dressed, read now, not at assembly
        self._containers: set[int] = set()  # ids of the containers this walk made: the ones assembly fills in
        self._memo: dict[int, Any] = {}  # deepcopy's: an object met twice is copied once
        # the same for the containers walked: (original, copy) by the original's id; the original is kept alive, or
        # a temporary (a mapping may hand out a new container per lookup) could free its id for the next one
        self._walked: dict[int, tuple[Any, Any]] = {}
        self._kept: list[torch.Tensor] = []  # the tensors copied whole, whose ids key their copies in _memo
        self.skeleton = self.walk(state)
        # which slots hold one object: ids taken while every original is alive, compared once assembled
        self._ids = list(map(id, self.originals))

    def walk(self, obj: Any) -> Any:
        """The copy of ``obj``, tensors replaced by slots."""
        kind = type(obj)
        if kind in _ATOMS:
            return obj
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if (walked := self._walked.get(id(obj))) is not None:
            return walked[1]
        if kind is dict:
            out = self._made(obj, {})  # known before its contents are walked: one that holds itself meets it
            tensor = torch.Tensor  # the bulk of a state: tensors in dicts, taken without the general path
            out.update({k: self._tensor(v) if isinstance(v, tensor) else self.walk(v) for k, v in obj.items()})
            return out
        if kind is list:
            out = self._made(obj, [])
            out.extend([self.walk(v) for v in obj])
            return out
        if kind is tuple:
            return self._made(obj, tuple([self.walk(v) for v in obj]))
        if isinstance(obj, tuple) and hasattr(kind, "_fields"):  # a namedtuple
            return self._made(obj, kind(*[self.walk(v) for v in obj]))
        if isinstance(obj, (dict, UserDict)):
            return self._mapping(obj)
        if kind is memoryview:  # raw bytes (a checkpoint's extra file): deepcopy cannot copy one
            return obj.tobytes()
        return copy.deepcopy(obj, self._memo)

    def _mapping(self, obj: dict | UserDict) -> Any:
        """``copy.copy`` keeps the mapping's type and attributes (OrderedDict from ``state_dict()``, defaultdict)
        and gives these kinds contents of their own, which are then walked. One that refuses assignment (torch.fx's
        ``immutable_dict``) is deep-copied whole, before any of its tensors is counted. (Any other mapping is too:
        its copy may share its contents, and filling it would write into the live state.)"""
        try:
            out = copy.copy(obj)
            for k in out:  # can it be filled?
                out[k] = out[k]
                break
        except TypeError:
            return copy.deepcopy(obj, self._memo)
        self._made(obj, out)
        for k, v in obj.items():
            out[k] = self.walk(v)
        return out

    def _made(self, original: Any, copied: Any) -> Any:
        """``copied``, the walk's copy of ``original``: assembly may fill it in place, and ``original`` met again
        is this copy."""
        self._containers.add(id(copied))
        self._walked[id(original)] = (original, copied)
        return copied

    def _tensor(self, t: torch.Tensor) -> Any:
        parts = _stageable(t)
        if parts is None:
            if (sharded_tensor := sharded_tensor_type()) is not None and isinstance(t, sharded_tensor):
                raise ValueError(
                    f"a ShardedTensor of shape {tuple(t.size())} (FSDP1's sharded state) cannot be snapshotted for a "
                    "background write: save it with a synchronous CheckpointManager (async_save=False), or shard "
                    "with FSDP2, whose DTensors can be"
                )
            # Copied now: deep-copied, which keeps its type and flags, or cloned where deepcopy cannot reach the
            # storage. A tensor met again is the same copy.
            if id(t) not in self._memo:
                unreachable = t.is_nested or t.layout in _COMPRESSED
                self._memo[id(t)] = t.detach().clone() if unreachable else copy.deepcopy(t, self._memo)
                self._kept.append(t)  # its id keys the copy: alive until the walk ends (deepcopy keeps its own so)
            return self._memo[id(t)]
        slot = _Slot(len(self.sources))
        self.sources.append(parts[0])
        self.originals.append(t)
        clothes = parts[1]
        if type(t) in _PLAIN and (attributes := vars(t)):  # copied now, as the values are
            parameter = type(t) is torch.nn.Parameter
            clothes = _AsPlain(parameter, t.requires_grad, copy.deepcopy(attributes, self._memo))
        if clothes is not None:
            self._clothes[slot.index] = clothes
        return slot

    def _aliases(self) -> dict[int, int]:
        """Slots whose tensor is the very object of an earlier slot (their first): one object in the state stays
        one object in the snapshot. Worked out at assembly, off the caller's clock, not with a lookup per tensor
        during the walk."""
        if len(set(self._ids)) == len(self._ids):
            return {}
        first: dict[int, int] = {}
        return {i: first[x] for i, x in enumerate(self._ids) if first.setdefault(x, i) != i}

    def let_go(self) -> None:
        """Once the sources are copied: drop every reference to the live state (the sources, the originals, and
        deepcopy's memo, which keeps alive what it copied), so that a snapshot waiting for its writer keeps no
        tensor of training alive."""
        self.sources, self.originals, self._memo, self._walked, self._kept = [], [], {}, {}, []

    def assemble(self, staged: list[torch.Tensor]) -> Any:
        """The skeleton holding ``staged`` (one copy per source, in slot order), dressed as the originals were.
        Once: the skeleton is filled in place."""
        values = list(staged)
        for i, clothes in self._clothes.items():
            values[i] = clothes.dress(values[i])
        for i, first in self._aliases().items():
            values[i] = values[first]
        return _fill(self.skeleton, values, self._containers, {})

    def where(self, source: int) -> str:
        """Where source number ``source`` is in the state, as ``state['model']['w']``; for error messages."""
        return _key_path(self.skeleton, source) or "a tensor of the state"


def _fill(obj: Any, values: list[torch.Tensor], made: set[int], filled: dict[int, Any]) -> Any:
    """``obj`` with its slots replaced by ``values``, in place in the containers the walk made (ours to change);
    what the walk deep-copied holds no slot and is left alone. ``filled``: the containers done so far, by id, so that
    one met twice (or inside itself) is filled once and stays one object."""
    if type(obj) is _Slot:
        return values[obj.index]
    if id(obj) not in made:
        return obj
    if id(obj) in filled:
        return filled[id(obj)]
    if isinstance(obj, tuple):
        items = [_fill(v, values, made, filled) for v in obj]
        filled[id(obj)] = type(obj)(*items) if hasattr(type(obj), "_fields") else tuple(items)
        return filled[id(obj)]
    filled[id(obj)] = obj
    for k, v in list(obj.items() if isinstance(obj, (dict, UserDict)) else enumerate(obj)):
        obj[k] = _fill(v, values, made, filled)
    return obj


def _key_path(obj: Any, index: int, path: str = "state", seen: set[int] | None = None) -> str | None:
    """Where the slot numbered ``index`` is in the walked containers of ``obj``."""
    if type(obj) is _Slot:
        return path if obj.index == index else None
    if isinstance(obj, (Mapping, UserDict)):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    seen = set() if seen is None else seen
    if id(obj) in seen:  # met before (a container inside itself): searched there
        return None
    seen.add(id(obj))
    for k, v in items:
        if (found := _key_path(v, index, f"{path}[{k!r}]", seen)) is not None:
            return found
    return None
