"""A consistent copy of training state, taken fast enough that training does not notice. Local: no collectives.

:class:`StagingBuffers` is the destination of snapshots. A capture walks the state once: containers are copied,
each tensor is replaced by a slot, everything else is deep-copied. Then torch copies the tensors into staged
tensors allocated for the state's *layout* (every tensor's dtype, shape and device, and which of them are tied)
and reused while the layout stays. CUDA tensors go to pinned memory with non-blocking copies and one
synchronisation per device. The writer thread puts the staged tensors into the slots (:meth:`Captured.assemble`).
The caller holds the read side of a :class:`~ranksafe.lock.StateDictLock` meanwhile, so the copy never sees weights
half-way through an optimizer step.
"""

from __future__ import annotations

import copy
from collections import UserDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

try:  # DTensor exists wherever torch.distributed is built in; keep the module importable without it
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


# --------------------------------------------------------------------------------------------------- the walk

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
class _Grad:
    """How a staged copy carries the original's autograd flags, as ``torch.save`` keeps them: a Parameter stays
    one; a plain tensor that requires grad (a leaf such as SAC's ``log_alpha``) still does."""

    parameter: bool
    requires_grad: bool

    def dress(self, staged: torch.Tensor) -> torch.Tensor:
        if self.parameter:
            return torch.nn.Parameter(staged, requires_grad=self.requires_grad)
        return staged.detach().requires_grad_(self.requires_grad)  # a new object: the staged one is reused


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
        return DTensor.__tensor_unflatten__({**self.inner, self.local: staged}, self.context, self.shape, self.stride)


Clothes = _Grad | _AsDTensor
_REQUIRES_GRAD = _Grad(parameter=False, requires_grad=True)


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
        local, clothes = t, _Grad(parameter=True, requires_grad=t.requires_grad)
    elif DTensor is not None and kind is DTensor:
        local, clothes = _dtensor_parts(t)
        if type(local) not in _PLAIN:
            return None
    else:
        return None
    if local.layout is not torch.strided or local.is_quantized or local.is_nested or local.is_meta:
        return None
    return local, clothes


class _Flattener:
    """One walk over a state: a copy of its structure with a slot for each tensor to stage, and those tensors.

    Walked: dicts (and their subclasses), UserDicts, lists, tuples and namedtuples. Every other leaf, and any other
    container, is deep-copied now: what the caller changes in the state after the capture never reaches the
    snapshot. A tensor met twice gets two slots, made one object again at assembly (:meth:`aliases`)."""

    def __init__(self) -> None:
        self.sources: list[torch.Tensor] = []  # the tensors to stage, in slot order
        self.originals: list[torch.Tensor] = []  # the tensor each source stands for (a DTensor for its shard)
        self.clothes: dict[int, Clothes] = {}  # by slot: how a staged copy is dressed, read now, not at assembly
        self.made: set[int] = set()  # ids of the containers this walk made: the ones assembly fills in
        self._memo: dict[int, Any] = {}  # deepcopy's: an object met twice is copied once

    def walk(self, obj: Any) -> Any:
        """The copy of ``obj``, tensors replaced by slots."""
        kind = type(obj)
        if kind in _ATOMS:
            return obj
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if kind is dict:
            tensor = torch.Tensor  # the bulk of a state: tensors in dicts, taken without the general path
            return self._made({k: self._tensor(v) if isinstance(v, tensor) else self.walk(v) for k, v in obj.items()})
        if kind is list:
            return self._made([self.walk(v) for v in obj])
        if kind is tuple:
            return self._made(tuple([self.walk(v) for v in obj]))
        if isinstance(obj, tuple) and hasattr(kind, "_fields"):  # a namedtuple
            return self._made(kind(*[self.walk(v) for v in obj]))
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
        for k, v in obj.items():
            out[k] = self.walk(v)
        return self._made(out)

    def _made(self, container: Any) -> Any:  # a container of ours: assembly may fill it in place
        self.made.add(id(container))
        return container

    def _tensor(self, t: torch.Tensor) -> Any:
        parts = _stageable(t)
        if parts is None:
            # Copied now: deep-copied, which keeps its type and flags, or cloned where deepcopy cannot reach the
            # storage. A tensor met again is the same copy.
            if id(t) not in self._memo:
                unreachable = t.is_nested or t.layout in _COMPRESSED
                self._memo[id(t)] = t.detach().clone() if unreachable else copy.deepcopy(t, self._memo)
            return self._memo[id(t)]
        slot = _Slot(len(self.sources))
        self.sources.append(parts[0])
        self.originals.append(t)
        if parts[1] is not None:
            self.clothes[slot.index] = parts[1]
        return slot

    def aliases(self) -> dict[int, int]:
        """Slots whose tensor is the very object of an earlier slot (their first): one object in the state stays
        one object in the snapshot. Telling them apart as they come would cost a lookup per tensor."""
        ids = list(map(id, self.originals))
        if len(set(ids)) == len(ids):
            return {}
        first: dict[int, int] = {}
        return {i: first[x] for i, x in enumerate(ids) if first.setdefault(x, i) != i}


def _fill(obj: Any, values: list[torch.Tensor], made: set[int]) -> Any:
    """``obj`` with its slots replaced by ``values``, in place in the containers the walk made (ours to change);
    what the walk deep-copied holds no slot and is left alone."""
    if type(obj) is _Slot:
        return values[obj.index]
    if id(obj) not in made:
        return obj
    if isinstance(obj, tuple):
        items = [_fill(v, values, made) for v in obj]
        return type(obj)(*items) if hasattr(type(obj), "_fields") else tuple(items)
    for k, v in list(obj.items() if isinstance(obj, (dict, UserDict)) else enumerate(obj)):
        obj[k] = _fill(v, values, made)
    return obj


def _key_path(obj: Any, target: Any, path: str = "state") -> str | None:
    """Where ``target`` is in the walked containers of ``obj``, as ``state['model']['w']``; for error messages."""
    if obj is target:
        return path
    if isinstance(obj, (Mapping, UserDict)):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for k, v in items:
        if (found := _key_path(v, target, f"{path}[{k!r}]")) is not None:
            return found
    return None


# ------------------------------------------------------------------------------------------------- the layout


def _fits_its_storage(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` lies inside its storage. Not so when the storage was resized under it (as
    FSDP frees parameters): any copy of ``t`` would then read memory it does not own, or crash the process."""
    if t.is_contiguous():
        span = t.nbytes
    else:
        span = (1 + sum((n - 1) * abs(step) for n, step in zip(t.shape, t.stride(), strict=True))) * t.element_size()
    return t.storage_offset() * t.element_size() + span <= t.untyped_storage().nbytes()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors that start at one address hold the same values."""
    return (a.device, a.dtype, a.shape, a.stride(), a.is_conj(), a.is_neg()) == (
        b.device, b.dtype, b.shape, b.stride(), b.is_conj(), b.is_neg()
    )  # fmt: skip


def _layout_key(sources: list[torch.Tensor]) -> list[tuple]:
    """Each source's dtype, shape and device, and the number of the first source it is tied to (its own if none):
    what a layout is built for, and what the next snapshot must match to reuse it.

    Tied: a view of the same memory with the same dtype, shape and strides (tied weights, for which ``state_dict()``
    gives a tensor object per key over one storage). Addresses serve to find them; none is read through."""
    key = []
    first_at: dict[int, int] = {}  # address -> the first source that starts there
    for i, t in enumerate(sources):
        ptr = t.data_ptr()
        owner = first_at.setdefault(ptr, i)
        if owner != i and not _same_view(sources[owner], t):  # several views start there: an earlier one like t?
            like = (j for j in range(owner, i) if key[j][3] == j and sources[j].data_ptr() == ptr)
            owner = next((j for j in like if _same_view(sources[j], t)), i)
        key.append((t.dtype, t.shape, t.device, owner))
    return key


class _Layout:
    """Staged tensors for one layout key (:func:`_layout_key`), and which sources are copied into which."""

    def __init__(self, key: list[tuple], staged: list[torch.Tensor]) -> None:
        self.key, self.staged = key, staged  # one staged tensor per source; tied ones over the same bytes
        self.untied = [i for i, (_, _, _, owner) in enumerate(key) if owner == i]
        self.host = [i for i in self.untied if key[i][2].type == "cpu"]  # copied by one torch._foreach_copy_
        self.host_staged = [staged[i] for i in self.host]
        self.devices = [i for i in self.untied if key[i][2].type != "cpu"]  # copied first, one by one
        self.cuda = {key[i][2] for i in self.devices if key[i][2].type == "cuda"}  # synchronised once each
        self.nbytes = sum(staged[i].nbytes for i in self.untied)


class Captured:
    """A snapshot as :meth:`StagingBuffers.capture` leaves it: the values are copied, the structure is not
    assembled yet. :meth:`assemble` builds it; the background writer does that, off the caller's clock."""

    def __init__(self, flat: _Flattener, skeleton: Any, staged: list[torch.Tensor]) -> None:
        self._skeleton, self._staged, self._made = skeleton, staged, flat.made
        self._clothes, self._aliases = flat.clothes, flat.aliases()

    def assemble(self) -> Any:
        """The captured structure holding the staged copies, dressed as the originals were. Once: the skeleton is
        filled in place."""
        values = list(self._staged)
        for i, clothes in self._clothes.items():
            values[i] = clothes.dress(values[i])
        for i, first in self._aliases.items():
            values[i] = values[first]
        return _fill(self._skeleton, values, self._made)


class StagingBuffers:
    """Reusable destination of snapshots: staged tensors allocated for the state's layout and reused while it stays.

    The layout is every tensor's dtype, shape and device, and which tensors are tied (views of one memory with one
    dtype, shape and strides: staged once, tied again in the file, as ``torch.save`` of the state writes them). A
    snapshot whose tensors match it copies into the same staged tensors; one that does not builds a new layout,
    which takes over every staged tensor of the old one that still fits. Each staged tensor has a storage of its own
    bytes: a checkpoint holds exactly the tensors. The snapshot's tensors stay valid until the next capture, so the
    caller must not take a new snapshot while the previous one is being written (:class:`AsyncSaver` does not).
    """

    def __init__(self) -> None:
        self._layout: _Layout | None = None
        self.allocations = 0  # layouts that allocated staging memory over this object's life: proves reuse in tests

    @property
    def nbytes(self) -> int:
        """Bytes one snapshot stages: what a checkpoint of it needs on disk, give or take pickle."""
        return 0 if self._layout is None else self._layout.nbytes

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The staged tensors snapshots are copied into, one per tensor of the state (tied ones share bytes)."""
        return [] if self._layout is None else list(self._layout.staged)

    def _build(self, key: list[tuple]) -> _Layout:
        """A layout for ``key``, taking over the current layout's staged tensors where one fits."""
        spare: dict[tuple, list[torch.Tensor]] = {}  # (dtype, shape, pinned) -> staged tensors free to take
        for i in [] if self._layout is None else self._layout.untied:
            dtype, shape, device, _ = self._layout.key[i]
            spare.setdefault((dtype, shape, device.type == "cuda"), []).append(self._layout.staged[i])
        self._layout = None
        staged: list[Any] = [None] * len(key)
        for i, (dtype, shape, device, owner) in enumerate(key):
            if owner == i and (free := spare.get((dtype, shape, device.type == "cuda"))):
                staged[i] = free.pop()
        for untaken in spare.values():  # freed before anything is allocated
            untaken.clear()
        allocated = False
        for i, (dtype, shape, device, owner) in enumerate(key):
            if owner != i:  # another tensor object over the same bytes, as state_dict() gives tied weights
                staged[i] = staged[owner].detach()
            elif staged[i] is None:  # pinned for a GPU tensor, so that its copy need not block
                staged[i] = torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
                allocated = True
        self.allocations += allocated
        return _Layout(key, staged)

    def capture(self, state: Any) -> Captured:
        """Copy every tensor of ``state`` into the staged tensors and deep-copy the rest, now; assemble later.

        Raises ``ValueError`` naming a tensor whose storage is smaller than its view, before reading anything."""
        flat = _Flattener()
        skeleton = flat.walk(state)
        sources = flat.sources
        for t, original in zip(sources, flat.originals, strict=True):
            if not _fits_its_storage(t):
                where = _key_path(state, original) or "a tensor of the state"
                raise ValueError(
                    f"{where} ({tuple(t.shape)}, {t.dtype}) lies beyond its storage of {t.untyped_storage().nbytes()} "
                    "bytes: the storage was resized under it (freed, as FSDP frees parameters); snapshot it once it "
                    "holds its data again"
                )
        key = _layout_key(sources)
        if self._layout is None or key != self._layout.key:
            self._layout = self._build(key)
        layout = self._layout
        with torch.no_grad():
            for i in layout.devices:  # first: the copies from GPUs overlap with the host copies
                layout.staged[i].copy_(sources[i], non_blocking=sources[i].is_cuda)
            if layout.host:
                torch._foreach_copy_(layout.host_staged, [sources[i] for i in layout.host])
        for device in layout.cuda:  # one synchronisation per device for all its non-blocking copies
            torch.cuda.synchronize(device)
        return Captured(flat, skeleton, layout.staged)

    def take(self, state: Any) -> Any:
        """Copy ``state`` into the staged tensors; return the same structure holding the copies."""
        return self.capture(state).assemble()
