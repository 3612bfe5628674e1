"""A consistent copy of training state, taken fast enough that training does not notice.

Two pieces, both local (no collectives):

* :class:`StateDictLock`, a writer-preferring reader/writer lock. The optimizer step holds the *write* side;
  a snapshot holds the *read* side, so it never copies weights that are half-way through an update, and a
  waiting step is never starved by a stream of snapshots.
* :class:`StagingBuffers`, the destination of a snapshot: every tensor is copied into a few large buffers (one
  per dtype) allocated once and reused by every later snapshot of the same structure. Thousands of small
  tensors cost one allocation per dtype, not thousands. CUDA tensors go to pinned buffers with non-blocking
  copies and a single synchronisation per device. A ``DTensor`` contributes its local shard and keeps its
  placements. Everything that is not a tensor is deep-copied at call time.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

try:  # DTensor exists wherever torch.distributed is built in; keep the module importable without it
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


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


_PARALLEL_MIN = 16 << 20  # bytes; below this one thread copies everything (starting threads costs more)


def _plain_bytes(src: torch.Tensor) -> bool:
    """Whether ``src`` can be copied as raw bytes: dense CPU memory in order, no lazy conjugate/negation."""
    return src.device.type == "cpu" and src.is_contiguous() and not src.is_conj() and not src.is_neg()


def _run(segments: list[tuple[int, int, int]]) -> None:
    for dst, src, n in segments:
        ctypes.memmove(dst, src, n)  # a C call: releases the GIL


def _split(segments: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """Cut the byte ranges into ``parts`` lists of about equal bytes, splitting a range where needed."""
    share = -(-sum(n for _, _, n in segments) // parts)
    out: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for dst, src, n in segments:
        while n:
            take = min(n, room)
            out[-1].append((dst, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
            if room == 0 and len(out) < parts:
                out.append([])
                room = share
    return out


def copy_bytes(segments: list[tuple[int, int, int]], workers: int) -> None:
    """Copy ``(dst address, src address, nbytes)`` ranges, split evenly over ``workers`` threads.

    One split per snapshot, not one per tensor: torch's ``copy_`` opens a parallel region per tensor, and
    with a thousand tensors on a busy machine (data loader workers) each region waits for its slowest
    thread; measured 5-10x slower than one large copy of the same bytes.
    """
    if workers <= 1 or sum(n for _, _, n in segments) < _PARALLEL_MIN:
        _run(segments)
        return
    first, *rest = _split(segments, workers)
    threads = [threading.Thread(target=_run, args=(part,), name="ranksafe-snapshot-copy") for part in rest]
    for t in threads:
        t.start()
    _run(first)
    for t in threads:
        t.join()


def _is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _stageable(t: Any) -> bool:
    """A tensor whose values can go into a flat buffer: dense, not quantized, and not an unknown subclass."""
    if not isinstance(t, torch.Tensor):
        return False
    if _is_dtensor(t):
        t = t._local_tensor
    elif type(t) not in (torch.Tensor, torch.nn.Parameter):
        return False
    return t.layout == torch.strided and not t.is_quantized and t.device.type != "meta"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if _is_dtensor(t) else t


def _collect(obj: Any, out: dict[int, torch.Tensor]) -> None:
    """Every stageable tensor in ``obj``, unique by identity (a tied weight is staged once), in walk order."""
    if _stageable(obj):
        out.setdefault(id(obj), obj)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _collect(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, out)


def _rebuild(obj: Any, staged: dict[int, torch.Tensor], memo: dict) -> Any:
    """``obj`` with each staged tensor replaced by its copy and everything else deep-copied."""
    if id(obj) in staged:
        return staged[id(obj)]
    if isinstance(obj, Mapping):
        try:
            out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, defaultdict) and attributes
            for k, v in obj.items():
                out[k] = _rebuild(v, staged, memo)
            return out
        except TypeError:  # an immutable mapping: copy it whole
            return copy.deepcopy(obj, memo)
    if isinstance(obj, list):
        return [_rebuild(v, staged, memo) for v in obj]
    if isinstance(obj, tuple):
        items = [_rebuild(v, staged, memo) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj, memo)


class StagingBuffers:
    """Reusable destination of snapshots: one flat buffer per (dtype, pinned), views for every tensor.

    The layout is keyed by the structure (dtype, shape and device type of each tensor, in walk order); a
    snapshot of the same structure reuses the buffers, a changed structure frees them and allocates anew.
    The returned snapshot's tensors are views into the buffers: they stay valid until the next
    :meth:`take`, so the caller must not take a new snapshot while the previous one is being written.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._views: list[torch.Tensor] = []
        self.buffers: dict[tuple[torch.dtype, bool], torch.Tensor] = {}
        self.allocations = 0  # buffers allocated over this object's life: proves reuse in tests

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def _layout(self, tensors: list[torch.Tensor], key: tuple) -> None:
        self.buffers, self._views, self._key = {}, [], None  # free the old buffers before allocating
        pin = torch.cuda.is_available()
        sizes: dict[tuple[torch.dtype, bool], int] = {}
        for t in tensors:
            k = (t.dtype, pin and t.device.type == "cuda")
            sizes[k] = sizes.get(k, 0) + t.numel()
        self.buffers = {k: torch.empty(n, dtype=k[0], pin_memory=k[1]) for k, n in sizes.items()}
        self.allocations += len(self.buffers)
        offsets = dict.fromkeys(sizes, 0)
        for t in tensors:
            k = (t.dtype, pin and t.device.type == "cuda")
            self._views.append(self.buffers[k][offsets[k] : offsets[k] + t.numel()].view(t.shape))
            offsets[k] += t.numel()
        self._key = key

    def take(self, state: Any) -> Any:
        """Copy ``state`` into the buffers; return the same structure holding the copies."""
        found: dict[int, torch.Tensor] = {}
        _collect(state, found)
        originals = list(found.values())
        tensors = [_local(t) for t in originals]
        key = tuple((t.dtype, tuple(t.shape), t.device.type) for t in tensors)
        if key != self._key:
            self._layout(tensors, key)
        devices, segments = set(), []
        with torch.no_grad():
            for src, dst in zip(tensors, self._views, strict=True):
                if _plain_bytes(src):
                    if src.numel():
                        segments.append((dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size()))
                    continue
                cuda = src.device.type == "cuda"
                dst.copy_(src, non_blocking=cuda)
                if cuda:
                    devices.add(src.device)
        copy_bytes(segments, torch.get_num_threads())
        for d in devices:  # one synchronisation per device for all the non-blocking copies
            torch.cuda.synchronize(d)
        staged = {id(o): _wrap(o, v) for o, v in zip(originals, self._views, strict=True)}
        return _rebuild(state, staged, {})


def _wrap(original: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The staged copy in the original's clothes: a DTensor keeps its spec, a Parameter stays one."""
    if _is_dtensor(original):
        return DTensor(view, original._spec, requires_grad=False)
    if isinstance(original, torch.nn.Parameter):
        return torch.nn.Parameter(view, requires_grad=original.requires_grad)
    return view
