"""A consistent copy of training state, taken fast enough that training does not notice. Local: no collectives.

:class:`StagingBuffers` is the destination of snapshots. A capture takes the state apart in one walk
(:class:`~ranksafe.flatten.Flattened`: containers copied, a slot for each tensor, the rest deep-copied). Then
torch copies the tensors into staged tensors allocated for the state's *layout* (every tensor's dtype, shape,
strides and device, and which of them are tied) and reused while the layout stays. CUDA tensors go to pinned memory with
non-blocking copies and one synchronisation per device. The writer thread puts the staged tensors into the slots
(:meth:`Captured.assemble`). The caller holds the read side of a :class:`~ranksafe.lock.StateDictLock` meanwhile,
so the copy never sees weights half-way through an optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch

from .flatten import Flattened


def _span(t: torch.Tensor, stride: tuple[int, ...] | None) -> int:
    """Bytes from the first element of ``t`` to the end of its last (``stride``: None where ``t`` is contiguous)."""
    if stride is None:
        return t.nbytes
    return (1 + sum((n - 1) * abs(step) for n, step in zip(t.shape, stride, strict=True))) * t.element_size()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors that start at one address hold the same values."""
    return (a.device, a.dtype, a.shape, a.stride(), a.is_conj(), a.is_neg()) == (
        b.device, b.dtype, b.shape, b.stride(), b.is_conj(), b.is_neg()
    )  # fmt: skip


def _layout_key(flat: Flattened) -> list[tuple]:
    """For each source: its dtype, shape, the strides it is staged with and its device, and the number of the first
    source it is tied to (its own if none). What a layout is built for, and what the next snapshot must match to
    reuse it; one pass, as it runs on the caller's clock for every tensor of the state.

    Staged with the source's strides where they cover its elements and nothing else (channels_last, a transpose:
    kept as ``torch.save`` keeps them, and copied straight), else contiguous (None), also for a view with gaps, whose
    staged tensor holds its elements only.

    Tied: a view of the same memory with the same dtype, shape and strides (tied weights, for which ``state_dict()``
    gives a tensor object per key over one storage). Addresses serve to find them; none is read through.

    Raises ``ValueError`` naming a source that lies beyond its storage, before anything is read: the storage was
    resized under it (as FSDP frees parameters), and any copy of it would read memory it does not own, or crash."""
    sources = flat.sources
    key: list[tuple] = []
    first_at: dict[int, int] = {}  # address -> the first source that starts there
    for i, t in enumerate(sources):
        stride = None if t.is_contiguous() else t.stride()
        span = _span(t, stride)
        if t.storage_offset() * t.element_size() + span > (storage := t.untyped_storage().nbytes()):
            raise ValueError(
                f"{flat.where(i)} ({tuple(t.shape)}, {t.dtype}) lies beyond its storage of {storage} bytes: the "
                "storage was resized under it (freed, as FSDP frees parameters); snapshot it once it holds its data "
                "again"
            )
        if span != t.nbytes:  # gaps between its elements (or elements that overlap): staged contiguous
            stride = None
        ptr = t.data_ptr()
        owner = first_at.setdefault(ptr, i)
        if owner != i and not _same_view(sources[owner], t):  # several views start there: an earlier one like t?
            like = (j for j in range(owner, i) if key[j][4] == j and sources[j].data_ptr() == ptr)
            owner = next((j for j in like if _same_view(sources[j], t)), i)
        key.append((t.dtype, t.shape, stride, t.device, owner))
    return key


class _Layout:
    """Staged tensors for one layout key (:func:`_layout_key`), and which sources are copied into which."""

    def __init__(self, key: list[tuple], staged: list[torch.Tensor]) -> None:
        self.key, self.staged = key, staged  # one staged tensor per source; tied ones over the same bytes
        self.untied = [i for i, entry in enumerate(key) if entry[4] == i]
        devices = {i: key[i][3] for i in self.untied}
        self.host = [i for i, device in devices.items() if device.type == "cpu"]  # copied by one torch._foreach_copy_
        self.host_staged = [staged[i] for i in self.host]
        self.devices = [i for i, device in devices.items() if device.type != "cpu"]  # copied first, one by one
        self.cuda = {devices[i] for i in self.devices if devices[i].type == "cuda"}  # synchronised once each
        self.nbytes = sum(staged[i].nbytes for i in self.untied)


class Captured:
    """A snapshot as :meth:`StagingBuffers.capture` leaves it: the values are copied, the structure is not
    assembled yet. :meth:`assemble` builds it; the background writer does that, off the caller's clock."""

    def __init__(self, flat: Flattened, staged: list[torch.Tensor]) -> None:
        self._flat, self._staged = flat, staged

    def assemble(self) -> Any:
        """The captured structure holding the staged copies, dressed as the originals were. Once: the skeleton is
        filled in place."""
        return self._flat.assemble(self._staged)


class StagingBuffers:
    """Reusable destination of snapshots: staged tensors allocated for the state's layout and reused while it stays.

    The layout is every tensor's dtype, shape, strides and device, and which tensors are tied (views of one memory
    with one dtype, shape and strides: staged once, tied again in the file, as ``torch.save`` of the state writes
    them). A snapshot whose tensors match it copies into the same staged tensors; one that does not builds a new
    layout, which takes over every staged tensor of the old one that still fits. Each staged tensor has a storage of
    its own bytes, with the strides of its source where they cover its elements and nothing else (channels_last, a
    transpose), else contiguous: a checkpoint holds exactly the tensors. So a view of part of another tensor of the
    state (``x[2:5]`` beside ``x``) is saved as a tensor of its own, with the same values, where ``torch.save`` of the
    live state would keep it a view of ``x``'s storage. The snapshot's tensors stay valid until the next capture, so
    the caller must not take a new snapshot while the previous one is being written (:class:`AsyncSaver` does not).
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
        spare: dict[tuple, list[torch.Tensor]] = {}  # (dtype, shape, strides, pinned) -> staged tensors free to take
        for i in [] if self._layout is None else self._layout.untied:
            dtype, shape, stride, device, _ = self._layout.key[i]
            spare.setdefault((dtype, shape, stride, device.type == "cuda"), []).append(self._layout.staged[i])
        self._layout = None
        staged: list[Any] = [None] * len(key)
        for i, (dtype, shape, stride, device, owner) in enumerate(key):
            if owner == i and (free := spare.get((dtype, shape, stride, device.type == "cuda"))):
                staged[i] = free.pop()
        for untaken in spare.values():  # freed before anything is allocated
            untaken.clear()
        allocated = False
        for i, (dtype, shape, stride, device, owner) in enumerate(key):
            if owner != i:  # another tensor object over the same bytes, as state_dict() gives tied weights
                staged[i] = staged[owner].detach()
            elif staged[i] is None:  # pinned for a GPU tensor, so that its copy need not block
                pinned = device.type == "cuda"
                if stride is None:
                    staged[i] = torch.empty(shape, dtype=dtype, pin_memory=pinned)
                else:
                    staged[i] = torch.empty_strided(shape, stride, dtype=dtype, pin_memory=pinned)
                allocated = True
        self.allocations += allocated
        return _Layout(key, staged)

    def capture(self, state: Any) -> Captured:
        """Copy every tensor of ``state`` into the staged tensors and deep-copy the rest, now; assemble later.

        Raises ``ValueError`` naming a tensor whose storage is smaller than its view (:func:`_layout_key`)."""
        flat = Flattened(state)
        sources = flat.sources
        key = _layout_key(flat)
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
        flat.let_go()
        return Captured(flat, layout.staged)

    def take(self, state: Any) -> Any:
        """Copy ``state`` into the staged tensors; return the same structure holding the copies."""
        return self.capture(state).assemble()
