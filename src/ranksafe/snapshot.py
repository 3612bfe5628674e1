"""A consistent copy of training state, taken fast enough that training does not notice.

Two pieces, both local (no collectives):

* :class:`StateDictLock`, a writer-preferring reader/writer lock. The optimizer step holds the *write* side;
  a snapshot holds the *read* side, so it never copies weights that are half-way through an update, and a
  waiting step is never starved by a stream of snapshots.
* :class:`StagingBuffers`, the destination of a snapshot: one host buffer (and one pinned buffer per dtype
  for CUDA tensors) allocated once and reused by every later snapshot, so thousands of small tensors cost
  one allocation, not thousands. Tensors that lie next to each other in memory are copied as one byte
  range. CUDA tensors go to pinned memory with non-blocking copies and a single synchronisation per device.
  A ``DTensor`` contributes its local shard and keeps its placements. Everything that is not a tensor is
  deep-copied at call time.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import mmap
import operator
import threading
from collections import UserDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

try:  # DTensor exists wherever torch.distributed is built in; keep the module importable without it
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

try:  # torch.compile's guard on tensor metadata, checked in C: see _layout_guard
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover
    TensorGuards = None


class StateDictLock:
    """Reader/writer lock between the optimizer step (writer) and snapshots (readers).

    *Writer-preferring*: once a writer waits, new readers queue behind it, so a step is delayed by at most
    the snapshot already running, never by a stream of them. Re-entrant for the thread that holds the write
    side (including taking the read side inside it: that thread is the only one that could change the
    weights), and for nested reads. Upgrading a read to a write would deadlock, so it raises instead.

    Use the context managers ``write()`` / ``read()``, or the ``acquire_*`` / ``release_*`` pairs where the
    two ends live in different callbacks (``before_step`` / ``after_step``).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer: int | None = None  # ident of the thread holding the write side
        self._write_depth = 0
        self._writers_waiting = 0
        self._local = threading.local()  # this thread's read depth

    def _reads(self) -> int:
        return getattr(self._local, "reads", 0)

    def acquire_write(self, timeout: float | None = None) -> bool:
        """Take the write side; False if ``timeout`` seconds passed first."""
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._write_depth += 1
                return True
            if self._reads():
                raise RuntimeError(
                    "StateDictLock: this thread holds the read side; taking the write side would deadlock"
                )
            self._writers_waiting += 1
            try:
                ok = self._cond.wait_for(lambda: self._writer is None and self._readers == 0, timeout)
            finally:
                self._writers_waiting -= 1
            if not ok:
                self._cond.notify_all()  # readers queued behind this writer may go now
                return False
            self._writer, self._write_depth = me, 1
            return True

    def release_write(self) -> None:
        """Give back the write side (once per acquire); wakes waiting snapshots when the last one is released."""
        with self._cond:
            if self._writer != threading.get_ident():
                raise RuntimeError("StateDictLock: release_write() by a thread that does not hold the write side")
            self._write_depth -= 1
            if self._write_depth == 0:
                self._writer = None
                self._cond.notify_all()

    def acquire_read(self, timeout: float | None = None) -> bool:
        """Take the read side; False if ``timeout`` seconds passed first."""
        with self._cond:
            reentrant = self._writer == threading.get_ident() or self._reads() > 0
            if not reentrant:
                free = lambda: self._writer is None and self._writers_waiting == 0  # noqa: E731
                if not self._cond.wait_for(free, timeout):
                    return False
            self._readers += 1
            self._local.reads = self._reads() + 1
            return True

    def release_read(self) -> None:
        """Give back the read side (once per acquire); wakes a waiting step when the last reader leaves."""
        with self._cond:
            if not self._reads():
                raise RuntimeError("StateDictLock: release_read() by a thread that does not hold the read side")
            self._local.reads -= 1
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    @contextlib.contextmanager
    def write(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the write side for the block (around ``optimizer.step()``)."""
        if not self.acquire_write(timeout):
            raise TimeoutError(f"StateDictLock: write side not acquired within {timeout}s")
        try:
            yield
        finally:
            self.release_write()

    @contextlib.contextmanager
    def read(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the read side for the block (around a snapshot)."""
        if not self.acquire_read(timeout):
            raise TimeoutError(f"StateDictLock: read side not acquired within {timeout}s")
        try:
            yield
        finally:
            self.release_read()


# A byte range at least this long is copied by torch's intra-op threads: torch splits a copy of at least 32,768
# elements (at::internal::GRAIN_SIZE) across them, counted here in float32 elements. A shorter one is copied by
# one thread either way, and memmove does that without torch's per-call overhead.
_BULK_BYTES = 4 * 32768
# torch copies a range as words of this many bytes (int64), not as bytes: its copy of a uint8 tensor is ~10% slower
# than the same bytes as int64 or float32 (measured here right after a stand-in step: 7.4 against 6.7 ms, 100 MiB)
_WORD = 8
# Tensors whose bytes are closer than this are copied as one range with the bytes between them. Less than a
# page: every byte in between shares a page with a byte of a live tensor, so it is mapped and safe to read.
_GAP = 1024
_PAGE = mmap.PAGESIZE
_ALIGN = 64  # a staged range keeps its source address modulo this, which keeps every dtype in it aligned
# A tensor this small that is somewhere else at the next snapshot (a score, a counter: a new tensor at every save)
# becomes loose, copied on its own wherever it is, instead of costing a new plan at every save; at most this many.
_LOOSE_BYTES = 64 * 1024
_LOOSE_MAX = 64

Segment = tuple[int, int, int]  # (dst address, src address, nbytes)


def _plain_bytes(src: torch.Tensor) -> bool:
    """Whether ``src`` can be copied as raw bytes: dense CPU memory in order, no lazy conjugate/negation."""
    return src.device.type == "cpu" and src.is_contiguous() and not src.is_conj() and not src.is_neg()


# memmove for the small tensors, called holding the GIL: ctypes.memmove releases it for every call, which costs
# more than a small copy, and if another thread (the writer of the previous checkpoint, a data loader thread)
# takes the GIL in between, the caller waits for it. Same C function as ctypes.memmove.
_memmove_holding_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr
)


def copy_small(segments: list[Segment]) -> None:
    """Copy byte ranges in the calling thread, holding the GIL (for ranges shorter than :data:`_BULK_BYTES`)."""
    memmove = _memmove_holding_gil
    for dst, src, n in segments:
        memmove(dst, src, n)


def _runs(tensors: list[torch.Tensor], indices: list[int]) -> list[tuple[int, int, list[int]]]:
    """``(start, end, members)`` byte ranges covering the given tensors: by address, a tensor starting less
    than :data:`_GAP` bytes after the range so far (or inside it: overlapping views) joins it, and so does a
    long one separated from a long range by no whole page (:data:`_PAGE`)."""
    runs: list[tuple[int, int, list[int]]] = []
    for i in sorted(indices, key=lambda i: tensors[i].data_ptr()):
        start = tensors[i].data_ptr()
        end = start + tensors[i].numel() * tensors[i].element_size()
        if runs and _joins(*runs[-1][:2], start, end):
            first, last, members = runs[-1]
            members.append(i)
            runs[-1] = (first, max(last, end), members)
        else:
            runs.append((start, end, [i]))
    return runs


def _joins(first: int, last: int, start: int, end: int) -> bool:
    """Whether bytes ``[start, end)`` join the range ``[first, last)`` that ends before or over them. Near:
    less than :data:`_GAP` apart. Or both long and no whole page between them: large tensors each get a mapping
    of their own from malloc, one page apart (measured: 4,096 bytes between 1-4 MiB tensors), and one range for
    all costs one of torch's parallel copies instead of one per tensor; every byte between them is on the last
    page of the one or the first page of the other, so it is mapped while they are alive."""
    if start - last < _GAP:
        return True
    return start // _PAGE - (last - 1) // _PAGE <= 1 and last - first >= _BULK_BYTES and end - start >= _BULK_BYTES


def _bytes_at(address: int, nbytes: int) -> torch.Tensor:
    """A byte tensor over memory it does not own: valid only while the tensors there are alive."""
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)


def _check_in_storage(t: torch.Tensor, i: int) -> None:
    """Refuse a tensor whose storage is smaller than its view (a storage resized under it, as FSDP frees
    parameters): copying it would read memory it does not own, or crash."""
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    need = (t.storage_offset() + extent) * t.element_size()
    have = t.untyped_storage().nbytes()
    if have < need:
        raise ValueError(
            f"tensor #{i} of the state ({tuple(t.shape)}, {t.dtype}) spans {need} bytes of a storage of {have}: "
            "its storage was resized under it (freed?); snapshot it once it holds its data again"
        )


def _layout_guard(tensors: list[torch.Tensor]) -> Any:
    """A check, in C, that a list of tensors has the types, dtypes, devices, dispatch keys (layout, quantized,
    lazy conjugate or negation), ``requires_grad``, sizes and strides of ``tensors``: what torch.compile guards a
    compiled graph with. None where this torch has no such check, or it cannot be built; then every snapshot
    takes the full walk. Only for plain CPU or CUDA tensors, which all have sizes and strides: the check reads
    them first, and a tensor without them (a nested one) aborts the process. None too if the check rejects the
    very tensors it was built from (another torch, other semantics): it would only add a walk to every save."""
    if TensorGuards is None:
        return None
    try:
        guard = TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except (TypeError, RuntimeError):  # another torch, another signature: the full walk is still right
        return None
    return guard if guard.check(*tensors) else None


def _is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_PLAIN_KINDS = frozenset(_PLAIN_TENSORS)
_IS_NESTED, _DATA_PTR = operator.attrgetter("is_nested"), torch.Tensor.data_ptr
_COMPRESSED = frozenset({torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})
# Immutable leaves: deepcopy would return them unchanged, at the price of a function call each.
_ATOMS = frozenset({int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size})


class _Slot:
    """Where the staged copy of tensor number ``index`` goes in a captured structure. Immutable, so one per
    index serves every capture: :func:`_slot`."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


_SLOTS: list[_Slot] = []
_GROW = threading.Lock()  # two threads capturing at once must not append slots out of order


def _slot(i: int) -> _Slot:
    """The slot for tensor number ``i`` (a list lookup: making one per tensor per capture costs more)."""
    if i >= len(_SLOTS):
        with _GROW:
            while len(_SLOTS) <= i:
                _SLOTS.append(_Slot(len(_SLOTS)))
    return _SLOTS[i]


class _NotQuick(Exception):
    """The quick walk met a tensor it leaves to the full walk (a DTensor, a subclass, a nested tensor)."""


class _Walk:
    """One walk over the state: containers copied, leaves deep-copied, stageable tensors replaced by slots.

    Every tensor met is a source, a tensor met twice too: telling them apart by identity costs a lookup per tensor,
    and the plan stages tensors with the same address and layout once anyway (:meth:`StagingBuffers._plan`), so a
    tied weight is copied and saved once. ``sources`` are what is copied (a DTensor's local shard), ``clothes`` how
    the staged copy is dressed again (Parameter's ``requires_grad`` or DTensor's spec, read now, not later), and
    ``sig`` what decides the copy plan: dtype, shape, strides, address and flags of every source. The walk is the
    one cost of a snapshot that grows with the number of tensors, so its hot path is inlined.

    ``quick=True`` reads none of the signature: it takes every plain tensor (or Parameter) as a source, raises
    :class:`_NotQuick` at a nested one or any other kind of tensor (RuntimeError at one without storage), and
    leaves ``sig`` empty. Its sources are staged by the previous plan only once
    :meth:`StagingBuffers._still_planned` has checked them against it.
    """

    def __init__(self, state: Any, quick: bool = False) -> None:
        self.sources: list[torch.Tensor] = []
        self.sig: list[tuple] = []
        self.clothes: dict[int, Any] = {}
        self.memo: dict = {}
        self.ptrs: list[int] = []  # (quick walk) the sources' addresses
        self.repeats: list[tuple[int, int]] = []  # (full walk) (i, j): source i is the very object source j is
        self._seen: dict[int, int] = {}  # (full walk) id -> the first source index of that object
        self.all_plain = True  # (full walk) every tensor is a plain CPU or CUDA one: the quick walk could take it
        self._mapping = self._mapping_quick if quick else self._mapping_full
        self._tensor = self._tensor_quick if quick else self._tensor_full
        self.skeleton = self._walk(state)

    def _add(self, t: torch.Tensor, local: torch.Tensor) -> _Slot:
        i = len(self.sources)
        if (first := self._seen.setdefault(id(t), i)) != i:
            self.repeats.append((i, first))
        self.sources.append(local)
        self.sig.append(
            (local.dtype, local.shape, local.stride(), local.data_ptr(), local.is_cpu, local.is_conj(), local.is_neg())
        )
        return _slot(i)

    def _tensor_full(self, t: torch.Tensor) -> Any:
        local = t._local_tensor if _is_dtensor(t) else t
        if local is t and type(t) not in _PLAIN_TENSORS:
            self.all_plain = False
            return copy.deepcopy(t, self.memo)  # an unknown tensor subclass: no flat buffer can hold it
        if local.is_nested or local.layout in _COMPRESSED:  # no layout to copy by, and deepcopy fails: clone it
            self.all_plain = False
            if id(t) not in self.memo:
                self.memo[id(t)] = t.detach().clone()
            return self.memo[id(t)]
        if local.layout is not torch.strided or local.is_quantized or local.is_meta:
            self.all_plain = False
            return copy.deepcopy(t, self.memo)
        slot = self._add(t, local)
        if local is not t or local.device.type not in ("cpu", "cuda"):
            self.all_plain = False
        clothes = t._spec if local is not t else _plain_clothes(t)
        if clothes is not None:
            self.clothes[slot.index] = clothes
        return slot

    def _tensor_quick(self, t: torch.Tensor) -> Any:
        return self._mapping_quick({0: t}, {})[0]  # a tensor outside a mapping (in a list): rare

    def _walk(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _ATOMS:
            return obj
        if kind is dict:
            return self._mapping(obj, {})
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if kind is list:
            return [self._walk(v) for v in obj]
        if kind is memoryview:  # raw bytes (a checkpoint's extra file): deepcopy cannot, a copy of its bytes can
            return obj.tobytes()
        if isinstance(obj, (dict, UserDict)):
            # copy.copy keeps the mapping's type (OrderedDict from state_dict(), defaultdict) and attributes, and
            # gives these two kinds contents of their own; one that refuses assignment (torch.fx's immutable_dict)
            # is copied whole, before any of its tensors is counted
            try:
                out = copy.copy(obj)
                for k in out:
                    out[k] = out[k]
                    break
            except TypeError:
                return copy.deepcopy(obj, self.memo)
            return self._mapping(obj, out)
        if isinstance(obj, Mapping):  # another mapping: its copy.copy may share its contents with it (and be
            return copy.deepcopy(obj, self.memo)  # written into), or refuse assignment: copied whole
        if isinstance(obj, tuple):
            items = [self._walk(v) for v in obj]
            return kind(*items) if hasattr(obj, "_fields") else kind(items)
        return copy.deepcopy(obj, self.memo)

    def _mapping_full(self, obj: Mapping, out: Any) -> Any:
        """Copy a mapping; its plain CPU tensors (the bulk of any state dict) take an inlined path: ``_add``
        without the call and without a new slot object, measured 1.28 -> 1.07 us per tensor."""
        walk, sources, sig, seen = self._walk, self.sources, self.sig, self._seen
        slots, strided, clothes = _SLOTS, torch.strided, self.clothes
        for k, v in obj.items():
            if type(v) is torch.Tensor and v.is_cpu and v.layout is strided and not v.is_quantized:
                try:
                    found = (v.dtype, v.shape, v.stride(), v.data_ptr(), True, v.is_conj(), v.is_neg())
                except RuntimeError:  # no sizes or strides (a nested tensor): the general path decides
                    out[k] = walk(v)
                    continue
                i = len(sources)
                if (first := seen.setdefault(id(v), i)) != i:
                    self.repeats.append((i, first))
                sources.append(v)
                sig.append(found)
                if v.requires_grad:  # a leaf such as SAC's log_alpha: torch.save keeps the flag, so do we
                    clothes[i] = _REQUIRES_GRAD
                out[k] = slots[i] if i < len(slots) else _slot(i)
            else:
                out[k] = walk(v)
        return out

    def _mapping_quick(self, obj: Mapping, out: Any) -> Any:
        """:meth:`_mapping_full` reading a flag and the address of each tensor instead of ten attributes, and no
        clothes: the guard that admits these tensors checks their types, devices and ``requires_grad``, so the
        planned clothes fit.

        A mapping of tensors only (a model's or an optimizer's state dict) is read in C loops (``map`` over the
        getters), not in Python: 0.80 -> 0.47 ms for 1,040 tensors right after a stand-in step (median of 30)."""
        walk, sources, slots, ptrs = self._walk, self.sources, _SLOTS, self.ptrs
        plain, parameter = torch.Tensor, torch.nn.Parameter
        values = list(obj.values())
        if values and _PLAIN_KINDS.issuperset(map(type, values)):
            if any(map(_IS_NESTED, values)):  # no sizes or strides: the guard reads them first, and would abort
                raise _NotQuick
            ptrs.extend(map(_DATA_PTR, values))  # RuntimeError where there is no storage (sparse): see _walk
            first = len(sources)
            sources.extend(values)
            _slot(len(sources) - 1)  # every slot exists
            pairs = zip(obj.keys(), slots[first : len(sources)], strict=True)
            if isinstance(out, dict):
                out.update(pairs)
            else:  # another mutable mapping, item by item
                for k, slot in pairs:
                    out[k] = slot
            return out
        for k, v in obj.items():
            kind = type(v)
            if kind is plain or kind is parameter:
                if v.is_nested:  # no sizes or strides: the guard reads them first, and would abort the process
                    raise _NotQuick
                i = len(sources)
                sources.append(v)
                ptrs.append(v.data_ptr())  # RuntimeError where there is no storage (sparse): see StagingBuffers._walk
                out[k] = slots[i] if i < len(slots) else _slot(i)
            elif isinstance(v, torch.Tensor):
                raise _NotQuick
            else:
                out[k] = walk(v)
        return out


def _fill(obj: Any, staged: list[torch.Tensor]) -> Any:
    """Put the staged tensors into the slots of a captured structure (its containers are ours to change)."""
    kind = type(obj)
    if kind is _Slot:
        return staged[obj.index]
    if isinstance(obj, (dict, list)) or (isinstance(obj, Mapping) and hasattr(obj, "__setitem__")):
        for k, v in obj.items() if isinstance(obj, Mapping) else enumerate(obj):
            if type(v) is _Slot or isinstance(v, (Mapping, list, tuple)):
                obj[k] = _fill(v, staged)
        return obj
    if isinstance(obj, tuple):
        items = [_fill(v, staged) for v in obj]
        return kind(*items) if hasattr(obj, "_fields") else kind(items)
    return obj


_REQUIRES_GRAD = object()  # the clothes of a plain tensor that requires grad


def _small(t: torch.Tensor) -> bool:
    """Whether ``t`` may be loose (:data:`_LOOSE_BYTES`)."""
    return t.numel() * t.element_size() <= _LOOSE_BYTES


def _plain_clothes(t: torch.Tensor) -> Any:
    """The clothes of a plain tensor or Parameter (None: none)."""
    if type(t) is not torch.Tensor:
        return t.requires_grad
    return _REQUIRES_GRAD if t.requires_grad else None


def _dress(view: torch.Tensor, clothes: Any) -> torch.Tensor:
    """The staged copy in the original's clothes: a DTensor keeps its spec, a Parameter stays one, a tensor
    that requires grad still does (a new tensor object each time: the staged view is reused by every snapshot)."""
    if clothes is None:
        return view
    if clothes is _REQUIRES_GRAD:
        return view.detach().requires_grad_()
    if isinstance(clothes, bool):
        return torch.nn.Parameter(view, requires_grad=clothes)
    return DTensor(view, clothes, requires_grad=False)


class Captured:
    """A snapshot as :meth:`StagingBuffers.capture` leaves it: the values are copied, the structure is not
    assembled yet. :meth:`assemble` builds it; the background writer does that, off the caller's clock."""

    def __init__(self, skeleton: Any, views: list[torch.Tensor], clothes: dict[int, Any]) -> None:
        self._skeleton, self._views, self._clothes = skeleton, views, clothes

    def assemble(self) -> Any:
        """The captured structure holding the staged copies. Once: the skeleton is filled in place."""
        dressed: dict[tuple[int, int], torch.Tensor] = {}  # one object per staged tensor and clothes: ties stay
        staged = []
        for i, v in enumerate(self._views):
            clothes = self._clothes.get(i)
            key = (id(v), id(clothes))
            if key not in dressed:
                dressed[key] = _dress(v, clothes)
            staged.append(dressed[key])
        return _fill(self._skeleton, staged)


class StagingBuffers:
    """Reusable destination of snapshots: one host buffer for every CPU tensor, one pinned buffer per dtype for
    CUDA tensors, allocated once and reused while the state fits.

    Tensors whose bytes lie within :data:`_GAP` of each other in memory (the small tensors of a model, allocated one
    after another; views into one flat buffer), or long ones with no whole page between them (:func:`_joins`), are
    copied as one byte range, the few bytes between them included; every staged tensor is then given a storage of
    its own bytes only, so what is saved is exactly the tensors, never the bytes between them. The copy plan (which
    ranges go where) is kept, keyed by every tensor's dtype, shape, strides and address: saving the same model again
    costs one walk over the state and the copy, nothing else. That walk is a quick one while the state's tensors
    keep their types, layouts and addresses: it reads a flag and the address of each tensor in Python, and
    torch.compile's guard checks the rest in C (:meth:`_walk`); 0.9 ms instead of 3.0 ms for 1,040 tensors right
    after a training step here. The snapshot's tensors stay valid until the next capture, so the caller must not
    take a new snapshot while the previous one is being written.

    Who copies: ranges of at least :data:`_BULK_BYTES` go to torch in one ``_foreach_copy_`` call, which runs
    them on torch's intra-op threads, the ones the training step has just used (awake, their caches warm): the
    same copy as the floor the benchmark compares with. Shorter ranges are copied with memmove by the calling
    thread. CUDA tensors are copied first, without blocking, so they overlap with the CPU copies.
    """

    def __init__(self) -> None:
        self._host: mmap.mmap | None = None  # an anonymous mapping: pages cost memory once written, not before
        self._host_bytes: torch.Tensor | None = None  # the whole mapping as bytes, to cut destination ranges from
        self._pinned: dict[torch.dtype, torch.Tensor] = {}
        self._views: list[torch.Tensor] = []
        self._sig: list | None = None
        self._guard: Any = None  # _layout_guard of the planned sources: the quick walk's check
        self._ptrs: list[int] = []  # their addresses, which the guard does not check
        self._planned_at: frozenset[int] = frozenset()  # the planned addresses, while some tensors are loose
        self._clothes: dict[int, Any] = {}  # and their clothes (Parameter, requires_grad), which it does
        self._loose: set[int] = set()  # tensors copied one by one into the loose area, wherever they are
        self._repeats: list[tuple[int, int]] = []  # (i, j): source i was the very object source j was, not loose
        self._guarded: list[int] | None = None  # the sources the guard checks, when not all: no loose, no repeat
        self._loose_at = self._loose_room = 0  # the loose area: where it starts in the host buffer, its bytes
        self._planned_nbytes = 0
        self._bulk_dst: list[torch.Tensor] = []  # byte ranges for torch's threads: one call
        self._bulk_src: list[torch.Tensor] = []
        self._small: list[Segment] = []  # shorter byte ranges: memmove
        self._others: list[int] = []  # copied one by one (CUDA, strided, lazy conjugate or negation)
        self.nbytes = 0  # bytes one snapshot holds (what a checkpoint of it needs on disk, give or take pickle)
        self.allocations = 0  # buffers allocated over this object's life: proves reuse in tests

    @property
    def buffers(self) -> dict[Any, torch.Tensor]:
        """The buffers snapshots are copied into: ``"host"`` (bytes) and one pinned buffer per CUDA dtype."""
        host = {} if self._host_bytes is None else {"host": self._host_bytes}
        return host | {(dtype, "pinned"): b for dtype, b in self._pinned.items()}

    def _reserve_host(self, nbytes: int) -> None:
        """A host buffer of at least ``nbytes``: the current one if it fits and is not far too big. An eighth
        more than asked, so a plan that moves a few tensors (new addresses, other gaps) keeps the buffer, and
        :data:`_LOOSE_BYTES` more, so does the plan that makes a small one loose (pages unwritten cost nothing)."""
        size = 0 if self._host is None else len(self._host)
        if nbytes <= size and nbytes >= (size - _LOOSE_BYTES) // 4:
            return
        self._host = self._host_bytes = None  # free the old mapping first (snapshots holding views keep it alive)
        if nbytes:
            # private: a forked child's snapshots must not write into the parent's (mmap's default is shared)
            self._host = mmap.mmap(-1, nbytes + nbytes // 8 + _LOOSE_BYTES, flags=mmap.MAP_PRIVATE)
            self._host_bytes = torch.frombuffer(self._host, dtype=torch.uint8)
            self.allocations += 1

    def _reserve_pinned(self, sizes: dict[torch.dtype, int]) -> None:
        """Pinned buffers of exactly these sizes (elements per dtype): saved whole, they must hold no slack."""
        if {d: b.numel() for d, b in self._pinned.items()} != sizes:
            self._pinned = {}  # free the old ones first
            self._pinned = {d: torch.empty(n, dtype=d, pin_memory=True) for d, n in sizes.items()}
            self.allocations += len(sizes)

    def _host_view(self, t: torch.Tensor, offset: int) -> torch.Tensor:
        """A tensor shaped like ``t`` over the host buffer's bytes at ``offset``, with a storage of its own: saved,
        it writes these bytes only."""
        return torch.frombuffer(self._host, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)

    def _plan(self, tensors: list[torch.Tensor], sig: list) -> None:
        self._sig = self._guard = None  # a plan that fails half-way must not be taken for the old one
        plain, others = [], []
        first: dict[tuple, int] = {}  # a signature (bytes and layout) -> the first tensor with it
        same: dict[int, int] = {}  # a tensor -> the earlier one it duplicates (tied weights from state_dict())
        for i, t in enumerate(tensors):
            if t.numel() and i not in self._loose:  # loose ones: _lay_loose
                _check_in_storage(t, i)
                if sig[i] in first:
                    same[i] = first[sig[i]]
                    continue
                first[sig[i]] = i
                (plain if _plain_bytes(t) else others).append(i)
        runs = _runs(tensors, plain)
        cuda = [i for i in others if tensors[i].device.type == "cuda"]
        host_others = [i for i in others if tensors[i].device.type != "cuda"]
        # host layout: each range keeps its source address modulo _ALIGN (so every dtype in it stays aligned),
        # then the tensors copied one by one, _ALIGN-aligned
        where, pos = [], 0
        for start, end, _ in runs:
            pos += (start - pos) % _ALIGN
            where.append(pos)
            pos += end - start
        offsets = {}
        for i in host_others:
            pos += -pos % _ALIGN
            offsets[i] = pos
            pos += tensors[i].numel() * tensors[i].element_size()
        # then the loose area: at least twice the loose tensors of now (their sizes may change), and whatever the
        # buffer has beyond that (its slack: _reserve_host), for tensors that become loose later without a plan
        self._loose_at = pos = pos + -pos % _ALIGN
        pos += 2 * sum(_ALIGN + tensors[i].numel() * tensors[i].element_size() for i in self._loose)
        self._reserve_host(pos)
        self._loose_room = (0 if self._host is None else len(self._host)) - self._loose_at
        pinned = {}
        for i in cuda:
            offsets[i] = pinned.get(tensors[i].dtype, 0)
            pinned[tensors[i].dtype] = offsets[i] + tensors[i].numel()
        self._reserve_pinned(pinned)

        views: list[torch.Tensor | None] = [None] * len(tensors)
        self._bulk_dst, self._bulk_src, self._small = [], [], []
        for (start, end, members), at in zip(runs, where, strict=True):
            for i in members:
                views[i] = self._host_view(tensors[i], at + tensors[i].data_ptr() - start)
            if end - start >= _BULK_BYTES:  # as 8-byte words (aligned alike: at = start mod _ALIGN), ends by memmove
                head = -start % _WORD
                body = (end - start - head) // _WORD * _WORD
                self._bulk_dst.append(self._host_bytes[at + head : at + head + body].view(torch.int64))
                self._bulk_src.append(_bytes_at(start + head, body).view(torch.int64))
                base = self._host_bytes.data_ptr() + at
                for offset, n in ((0, head), (head + body, end - start - head - body)):
                    if n:
                        self._small.append((base + offset, start + offset, n))
            else:
                self._small.append((self._host_bytes.data_ptr() + at, start, end - start))
        for i in host_others:
            views[i] = self._host_view(tensors[i], offsets[i])
        for i in cuda:
            t = tensors[i]
            views[i] = self._pinned[t.dtype][offsets[i] : offsets[i] + t.numel()].view(t.shape)
        for i, j in same.items():  # one staged tensor for both: saved once, and tied again when loaded
            views[i] = views[j]
        for i, t in enumerate(tensors):
            if views[i] is None:  # no elements: nothing to copy
                views[i] = torch.empty(t.shape, dtype=t.dtype)
        self._views, self._others = views, others
        self._planned_nbytes = self.nbytes = sum(tensors[i].numel() * tensors[i].element_size() for i in first.values())
        if not self._lay_loose(tensors):  # cannot be: the area was sized for these very tensors
            raise AssertionError("StagingBuffers: loose tensors do not fit the area planned for them")
        self._sig = sig

    def _lay_loose(self, tensors: list[torch.Tensor]) -> bool:
        """Give each loose tensor its place in the loose area, as it is now; False if one no longer fits there
        (or is no longer a dense tensor): the caller makes a new plan."""
        pos, end, nbytes = self._loose_at, self._loose_at + self._loose_room, 0
        laid: dict[tuple, torch.Tensor] = {}  # one tensor met twice (a score kept as the best and the current)
        for i in self._loose:
            t = tensors[i]
            n = t.numel() * t.element_size()
            pos += -pos % _ALIGN
            if t.layout is not torch.strided or t.is_quantized or not _small(t) or pos + n > end:
                return False
            if not n:
                self._views[i] = torch.empty(t.shape, dtype=t.dtype)
                continue
            key = (t.data_ptr(), t.dtype, t.shape, t.stride(), t.is_conj(), t.is_neg())
            if key in laid:
                self._views[i] = laid[key]
                continue
            _check_in_storage(t, i)
            self._views[i] = laid[key] = self._host_view(t, pos)
            pos, nbytes = pos + n, nbytes + n
        self.nbytes = self._planned_nbytes + nbytes
        return True

    def _settle(self, tensors: list[torch.Tensor], sig: list) -> None:
        """Make the plan fit the full walk's tensors, matched to the planned ones by signature (dtype, shape,
        strides, address, flags), not by position: a tensor added before others (a growing list of scores, such
        as Lightning's ``best_k_models`` with ``save_top_k=-1``) shifts the positions of all that follow.

        The plan is kept while every planned tensor is still there, as planned, and the others are a few small
        ones: those become loose (a monitored score: Lightning's ModelCheckpoint puts a new tensor in every
        checkpoint), copied on their own. A planned tensor that is gone or moved forces a new plan (its bytes
        are in the copied ranges, and its memory may be freed), with the small newcomers loose; anything else
        (a large newcomer, many) a new plan with none loose.
        """
        if self._sig is not None:
            planned: dict[tuple, int] = {}  # a planned signature -> the first planned tensor with it
            for j, s in enumerate(self._sig):
                if j not in self._loose:
                    planned.setdefault(s, j)
            found = [planned.get(s) for s in sig]
            new = {i for i, j in enumerate(found) if j is None}
            if len(new) > _LOOSE_MAX or not all(_small(tensors[i]) for i in new):
                self._loose = set()
            else:
                self._loose = new
                try:
                    kept = len(planned) == len(set(found) - {None}) and self._renumber(found, tensors)
                except BaseException:  # a plan renumbered half-way must not be taken for the old one
                    self._sig = self._guard = None
                    raise
                if kept:
                    self._sig = sig
                    return
        else:
            self._loose = set()
        self._plan(tensors, sig)

    def _renumber(self, found: list[int | None], tensors: list[torch.Tensor]) -> bool:
        """Keep the plan for tensors numbered anew: ``found[i]`` is the planned number of tensor ``i``, None
        for a loose one, which is laid out again; False if those do not fit the loose area."""
        others, first = set(self._others), {}
        for i, j in enumerate(found):  # tied tensors: copied once, at the first position (as _settle numbers them)
            if j in others:
                first.setdefault(j, i)
        self._views = [torch.empty(0) if j is None else self._views[j] for j in found]
        self._others = list(first.values())
        return self._lay_loose(tensors)

    def _walk(self, state: Any) -> _Walk:
        """Walk ``state`` and make sure the plan is the one for its tensors.

        The quick walk and a check in C first: they cost a third of the full walk (which reads ten attributes
        of every tensor in Python), and pass while the state's tensors keep the planned types, layouts and
        addresses (loose ones aside), as a model's do from one save to the next. Otherwise the full walk, a new
        plan if :meth:`_settle` needs one, and a guard for the next snapshot."""
        if self._guard is not None:
            try:
                walk = _Walk(state, quick=True)
            except (_NotQuick, RuntimeError):  # RuntimeError: a tensor without storage (sparse) has no address
                pass
            else:
                if self._still_planned(walk):
                    return walk
        walk = _Walk(state)
        self._settle(walk.sources, walk.sig)
        loose, sources = self._loose, walk.sources
        # the guard checks each object once (it rejects one passed twice); a repeat must be the same object again
        self._repeats = [(i, j) for i, j in walk.repeats if i not in loose and j not in loose]
        skip = loose | {i for i, _ in self._repeats}
        self._guarded = [i for i in range(len(sources)) if i not in skip] if skip else None
        guarded = sources if self._guarded is None else [sources[i] for i in self._guarded]
        self._guard = _layout_guard(guarded) if walk.all_plain else None
        self._ptrs = [0 if i in loose else t.data_ptr() for i, t in enumerate(sources)]
        self._planned_at = frozenset(self._ptrs) - {0} if loose else frozenset()
        self._clothes = walk.clothes
        return walk

    def _still_planned(self, walk: _Walk) -> bool:
        """Whether the quick walk's sources are laid out as the planned ones were (addresses, the planned repeats
        of one object, then the guard), the loose ones aside, which are laid out again and dressed as they are
        now."""
        ptrs, sources = walk.ptrs, walk.sources
        if len(ptrs) != len(self._ptrs):
            return False
        if self._guarded is None:
            walk.clothes = self._clothes
            return ptrs == self._ptrs and self._guard.check(*sources)
        planned_at = self._planned_at
        for i in self._loose:
            if ptrs[i] in planned_at:  # a planned tensor where a loose one was (the same object twice): tie them
                return False
            ptrs[i] = 0
        if ptrs != self._ptrs or any(sources[i] is not sources[j] for i, j in self._repeats):
            return False
        if not self._guard.check(*[sources[i] for i in self._guarded]):
            return False
        if not self._loose:  # repeats only: the planned layout and clothes hold as they are
            walk.clothes = self._clothes
            return True
        if not self._lay_loose(sources):
            return False
        walk.clothes = clothes = {i: c for i, c in self._clothes.items() if i not in self._loose}
        for i in self._loose:
            if (c := _plain_clothes(sources[i])) is not None:
                clothes[i] = c
        return True

    def capture(self, state: Any) -> Captured:
        """Copy every tensor of ``state`` into the buffers and deep-copy the rest, now; assemble later."""
        walk = self._walk(state)
        tensors = walk.sources
        # The plan's source ranges are raw addresses: valid because every tensor is where the plan found it
        # (the signature, or the guard and addresses, say so) and the state keeps them alive for this call.
        devices = set()
        with torch.no_grad():
            for i in self._others:
                src = tensors[i]
                cuda = src.device.type == "cuda"
                self._views[i].copy_(src, non_blocking=cuda)
                if cuda:
                    devices.add(src.device)
            if self._bulk_src:
                torch._foreach_copy_(self._bulk_dst, self._bulk_src)
            for i in self._loose:
                self._views[i].copy_(tensors[i])
        copy_small(self._small)
        for d in devices:  # one synchronisation per device for all the non-blocking copies
            torch.cuda.synchronize(d)
        return Captured(walk.skeleton, self._views, walk.clothes)

    def take(self, state: Any) -> Any:
        """Copy ``state`` into the buffers; return the same structure holding the copies."""
        return self.capture(state).assemble()
