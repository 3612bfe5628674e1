"""StateDictLock (exclusion, no deadlock, no starvation of the step) and the reusable staging buffers."""

from __future__ import annotations

import collections
import ctypes
import io
import mmap
import threading
import time

import pytest
import torch

from ranksafe import snapshot
from ranksafe.snapshot import _BULK_BYTES, _GAP, StagingBuffers, StateDictLock, copy_small
from tests.ranks import run_ranks

# --------------------------------------------------------------------------------------------------- lock


def test_readers_share_the_lock():
    lock = StateDictLock()
    both_inside = threading.Barrier(2, timeout=5)  # breaks (raises) unless two readers hold it at once
    errors = []

    def reader():
        try:
            with lock.read():
                both_inside.wait()
        except threading.BrokenBarrierError as e:
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and not any(t.is_alive() for t in threads)


def test_exclusion_under_contention_and_no_deadlock():
    lock = StateDictLock()
    state = {"readers": 0, "writers": 0, "violations": 0, "reads": 0, "writes": 0}
    guard = threading.Lock()

    def enter(kind):
        with guard:
            state[kind] += 1
            if state["writers"] > 1 or (state["writers"] and state["readers"]):
                state["violations"] += 1

    def leave(kind):
        with guard:
            state[kind] -= 1

    def worker(i):
        for n in range(300):
            if (n + i) % 3 == 0:
                with lock.write():
                    enter("writers")
                    state["writes"] += 1
                    leave("writers")
            else:
                with lock.read():
                    enter("readers")
                    state["reads"] += 1
                    leave("readers")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "deadlock: workers still blocked after 20 s"
    assert state["violations"] == 0
    assert state["reads"] + state["writes"] == 4 * 300
    assert time.monotonic() - start < 20


def test_reentrancy_and_misuse_raise_instead_of_deadlocking():
    lock = StateDictLock()
    # nested step hooks, and a snapshot taken inside the step on the stepping thread
    with lock.write(), lock.write(), lock.read():
        pass
    with lock.read():
        with lock.read():
            pass
        with pytest.raises(RuntimeError, match="deadlock"):
            lock.acquire_write()
    with pytest.raises(RuntimeError):
        lock.release_write()
    with pytest.raises(RuntimeError):
        lock.release_read()
    # after all that, another thread can still take the write side at once
    got = []
    t = threading.Thread(target=lambda: got.append(lock.acquire_write(timeout=2)))
    t.start()
    t.join(5)
    assert got == [True]


def test_a_held_write_side_times_readers_out():
    lock = StateDictLock()
    with lock.write():
        out = []
        t = threading.Thread(target=lambda: out.append(lock.acquire_read(timeout=0.2)))
        t.start()
        t.join(5)
    assert out == [False]
    with lock.read():  # the timed-out reader left no trace
        pass


class _ReaderPreferringLock:
    """The textbook reader/writer lock: a writer waits until no reader is left. The control."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    def acquire_read(self, timeout=None):
        with self._cond:
            if not self._cond.wait_for(lambda: not self._writer, timeout):
                return False
            self._readers += 1
            return True

    def release_read(self):
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def acquire_write(self, timeout=None):
        with self._cond:
            if not self._cond.wait_for(lambda: not self._writer and self._readers == 0, timeout):
                return False
            self._writer = True
            return True

    def release_write(self):
        with self._cond:
            self._writer = False
            self._cond.notify_all()


def _writer_wait_under_relay(lock, writer_timeout: float) -> tuple[bool, int, float]:
    """Two reader threads pass the read side hand to hand, so there is always a reader (snapshots in a
    loop). Each releases only after the next has acquired, or after 0.2 s if the next is held back.
    Returns whether a writer (the step) got in within ``writer_timeout``, and the reads done meanwhile."""
    stop = threading.Event()
    turn = [threading.Event(), threading.Event()]
    acquired = [threading.Event(), threading.Event()]
    reads = [0]
    turn[0].set()

    def relay(i):
        nxt = 1 - i
        while not stop.is_set():
            if not turn[i].wait(0.05):
                continue
            turn[i].clear()
            if not lock.acquire_read(timeout=0.5):
                turn[i].set()
                continue
            reads[0] += 1
            acquired[i].set()
            turn[nxt].set()
            acquired[nxt].wait(0.2)
            acquired[nxt].clear()
            time.sleep(0.005)
            lock.release_read()

    threads = [threading.Thread(target=relay, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.1)  # the relay is running
    start = time.monotonic()
    got = lock.acquire_write(timeout=writer_timeout)
    waited = time.monotonic() - start
    if got:
        lock.release_write()
    stop.set()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    return got, reads[0], waited


def test_the_step_is_not_starved_by_back_to_back_snapshots():
    # control: with a reader-preferring lock the overlapping readers keep the writer out for the whole window
    got, reads, _ = _writer_wait_under_relay(_ReaderPreferringLock(), writer_timeout=1.0)
    assert not got and reads > 20, (got, reads)
    # ours: the waiting writer holds new readers back, so it gets in after the snapshot already running
    got, reads, waited = _writer_wait_under_relay(StateDictLock(), writer_timeout=5.0)
    assert got, f"the writer starved ({reads} reads)"
    assert waited < 5.0


# ----------------------------------------------------------------------------------------------- staging


def _many_tensors(n=2000):
    state = collections.OrderedDict()
    for i in range(n):
        state[f"p{i}"] = torch.randn(3, 2) if i % 2 else torch.arange(4, dtype=torch.int64) + i
    state["half"] = torch.ones(5, dtype=torch.float16)
    return state


def test_thousands_of_tensors_take_one_buffer_reused_across_snapshots():
    staging = StagingBuffers()
    state = _many_tensors()
    snap = staging.take(state)
    assert staging.allocations == 1  # one host buffer for float32, int64 and float16, not 2001 allocations
    ptrs = {k: b.data_ptr() for k, b in staging.buffers.items()}
    assert type(snap) is collections.OrderedDict and list(snap) == list(state)
    assert all(snap[k].dtype == state[k].dtype and torch.equal(snap[k], state[k]) for k in state)
    assert all(snap[k].data_ptr() != state[k].data_ptr() for k in state)  # copies, not aliases
    for v in state.values():
        v.add_(1)
    snap2 = staging.take(state)
    assert staging.allocations == 1 and ptrs == {k: b.data_ptr() for k, b in staging.buffers.items()}
    assert all(torch.equal(snap2[k], state[k]) for k in state)
    # a changed structure that still fits keeps the buffer; one that does not fit gets a new one
    state["p1"] = torch.randn(7)
    snap3 = staging.take(state)
    assert staging.allocations == 1 and all(torch.equal(snap3[k], state[k]) for k in state)
    state["big"] = torch.randn(100_000)
    snap4 = staging.take(state)
    assert staging.allocations == 2 and all(torch.equal(snap4[k], state[k]) for k in state)


def test_snapshot_keeps_structure_ties_parameters_and_deep_copies_the_rest(monkeypatch):
    full_walks = _count_full_walks(monkeypatch)
    staging = StagingBuffers()
    w = torch.nn.Parameter(torch.randn(4, 4))
    t = torch.randn(6, 4).t()  # not contiguous
    Point = collections.namedtuple("Point", "x y")
    for _ in range(3):  # the plan, then the quick walk (which does not tell tensors apart by identity)
        state = {"w": w, "tied": [w, w], "t": t, "meta": {"lr": [0.1]}, "pt": Point(1, t), "n": None}
        snap = staging.take(state)
        state["meta"]["lr"].append(0.2)  # non-tensor state changes after the call: the snapshot must not
        assert snap["meta"] == {"lr": [0.1]}
        assert isinstance(snap["w"], torch.nn.Parameter) and torch.equal(snap["w"], w)
        assert snap["tied"][0] is snap["tied"][1] is snap["w"]  # one copy, still tied
        assert torch.equal(snap["t"], t) and isinstance(snap["pt"], Point) and snap["pt"].y is snap["t"]
        assert snap["n"] is None
    assert full_walks[0] == 1


def _dtensor_snapshot(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(16.0).reshape(4, 4)
    d = distribute_tensor(full, mesh, [Shard(0)])
    snap = StagingBuffers().take({"w": d})["w"]
    before = d.to_local().clone()
    d._local_tensor.add_(100)
    return {
        "type": type(snap) is DTensor,
        "placements": str(snap.placements),
        "shape": tuple(snap.shape),
        "local_equal": torch.equal(snap._local_tensor, before),
        "copied": snap._local_tensor.data_ptr() != d._local_tensor.data_ptr(),
    }


def test_dtensor_snapshot_copies_the_local_shard_and_keeps_placements():
    for v in run_ranks(_dtensor_snapshot, 2).values:
        expected = {"type": True, "placements": "(Shard(dim=0),)", "shape": (4, 4), "local_equal": True, "copied": True}
        assert v == expected


def test_small_copies_move_exactly_their_byte_ranges():
    src = torch.randint(0, 255, (3 * 1000 + 7,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    sizes = [1000, 1, 2006, 0]  # ranges cut at odd places, and an empty one
    segments, off = [], 0
    for n in sizes:
        segments.append((dst.data_ptr() + off, src.data_ptr() + off, n))
        off += n
    copy_small(segments)
    assert torch.equal(dst[:off], src[:off]) and not dst[off:].any()


def _foreach_calls(monkeypatch) -> list[list[int]]:
    """Record the byte count of every range each ``torch._foreach_copy_`` call copies."""
    calls = []
    real = torch._foreach_copy_
    record = lambda dst, src: (calls.append([s.nbytes for s in src]), real(dst, src))  # noqa: E731
    monkeypatch.setattr(torch, "_foreach_copy_", record)
    return calls


def test_neighbouring_tensors_are_copied_as_one_range_and_saved_without_the_bytes_between(monkeypatch):
    calls = _foreach_calls(monkeypatch)
    flat = torch.full((1000 * 64,), 12345.0)  # 1,000 tensors of 40 floats, 24 floats apart: one range
    state = {f"p{i}": flat[i * 64 : i * 64 + 40] for i in range(1000)}
    for v in state.values():
        v.copy_(torch.randn(40))
    staging = StagingBuffers()
    for _ in range(2):
        snap = staging.take(state)
        assert all(torch.equal(snap[k], v) for k, v in state.items())
    span = (999 * 64 + 40) * 4
    assert calls == [[span], [span]] and not staging._small  # one torch call per capture, one range in it
    assert all(snap[k].untyped_storage().nbytes() == 160 for k in state)  # each tensor its own bytes only
    buf = io.BytesIO()
    torch.save(snap, buf)
    assert torch.tensor(12345.0).numpy().tobytes() not in buf.getvalue()  # the filler between them is not saved
    buf.seek(0)
    loaded = torch.load(buf)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_ranges_follow_addresses_whatever_the_order_dtype_alignment_or_overlap(monkeypatch):
    calls = _foreach_calls(monkeypatch)
    raw = torch.randint(0, 255, (4096 + 1,), dtype=torch.uint8)
    odd = raw[1:].view(torch.uint8)  # starts at an odd address
    state = {
        "tail": raw[1024:1536].view(torch.float64),  # listed first, 424 bytes after the head's end: joins it
        "odd_u8": odd[:100],
        "f32": raw[128 : 128 + 400].view(torch.float32),  # two dtypes in one range, each still aligned
        "overlap": raw[200:600],  # overlaps "f32" and "odd_u8"
        "far": torch.randn(_BULK_BYTES // 4),  # its own range, long enough for torch
        "apart": raw[1536 + _GAP :],  # a gap of _GAP after the tail: a range of its own
    }
    staging = StagingBuffers()
    snap = staging.take(state)
    same_bits = lambda a, b: a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731
    for k, v in state.items():  # random bytes make NaNs: compare bits
        assert same_bits(snap[k], v), k
        assert snap[k].data_ptr() % 8 == v.data_ptr() % 8, k  # same alignment as the source
    assert calls == [[_BULK_BYTES]]  # the large tensor alone went to torch
    assert sorted(n for _, _, n in staging._small) == sorted([4096 + 1 - (1536 + _GAP), 1536 - 1])
    before = {k: v.clone() for k, v in state.items()}
    raw.fill_(7)
    state["far"].fill_(7)
    assert all(same_bits(snap[k], before[k]) for k in state)  # copies, taken when take() ran


def test_long_tensors_with_no_whole_page_between_them_are_one_range_and_no_other_page_is_read(monkeypatch):
    """malloc gives each large tensor a mapping of its own, one page apart: one range for all of them. A whole
    page between two tensors may be unmapped: here it is made unreadable, and a copy across it would crash."""
    calls = _foreach_calls(monkeypatch)
    page, n = mmap.PAGESIZE, _BULK_BYTES
    area = mmap.mmap(-1, 4 * n + 6 * page)
    raw = torch.frombuffer(area, dtype=torch.uint8)
    raw.copy_(torch.randint(0, 255, raw.shape, dtype=torch.uint8))
    state = {  # offsets in the page-aligned area
        "a": raw[64 : 64 + n],
        "b": raw[n + page + 64 : 2 * n + page + 64],  # one page after "a" ends, no whole page between: joins it
        "c": raw[2 * n + 3 * page + 64 : 3 * n + 3 * page + 64],  # the page before it is unreadable: apart
        "short": raw[3 * n + 4 * page + 64 : 3 * n + 4 * page + 64 + 4096],  # one page after "c", short: apart
    }
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(raw.data_ptr() + 2 * n + 2 * page, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    snap = StagingBuffers().take(state)
    assert calls == [[2 * n + page, n]]  # "a" to "b" as one range, "c" alone
    assert all(torch.equal(snap[k], v) for k, v in state.items())


def test_the_copy_plan_is_reused_only_while_every_tensor_stays_where_it_was():
    staging = StagingBuffers()
    state = {"a": torch.randn(20_000), "b": torch.randn(10, 10)}  # "a" larger than a loose tensor may be
    staging.take(state)
    plan = staging._views
    state = {k: v.detach() for k, v in state.items()}  # new tensor objects, same memory: as state_dict() gives
    snap = staging.take(state)
    assert staging._views is plan and all(torch.equal(snap[k], state[k]) for k in state)
    # same dtype and shape, new memory: the buffer stays, the plan must not (it would copy the old bytes)
    state["a"] = torch.randn(20_000)
    snap = staging.take(state)
    assert staging._views is not plan and staging.allocations == 1 and torch.equal(snap["a"], state["a"])
    # same memory, other strides (a transposed square): copied as a tensor, not as the old raw bytes
    state["b"] = state["b"].t()
    snap = staging.take(state)
    assert torch.equal(snap["b"], state["b"])


def _count_full_walks(monkeypatch) -> list[int]:
    """How many snapshots took the full walk (the quick walk and its guard did not admit the state)."""
    count = [0]
    full = snapshot._Walk._mapping_full

    def counted(self, obj, out):
        count[0] += obj is self._state
        return full(self, obj, out)

    init = snapshot._Walk.__init__

    def remember(self, state, quick=False):
        self._state = state
        init(self, state, quick)

    monkeypatch.setattr(snapshot._Walk, "_mapping_full", counted)
    monkeypatch.setattr(snapshot._Walk, "__init__", remember)
    return count


@pytest.mark.parametrize("guard", ["torch's guard", "no guard in this torch"])
def test_a_state_laid_out_as_planned_takes_the_quick_walk_and_any_change_at_the_same_address_is_seen(
    monkeypatch, guard
):
    if guard == "no guard in this torch":
        monkeypatch.setattr(snapshot, "TensorGuards", None)
    full_walks = _count_full_walks(monkeypatch)
    flat = torch.randn(1000)
    c = torch.randn(8, dtype=torch.complex64)
    model = {"flat": flat, "c": c, "p": torch.nn.Parameter(torch.randn(3)), "step": 5, "small": torch.ones(4)}
    staging = StagingBuffers()

    def state():  # new tensor objects over the same memory each time, as state_dict() gives
        return {k: v.detach() if isinstance(v, torch.Tensor) and k != "p" else v for k, v in model.items()}

    staging.take(state())
    staging.take(state())  # the guard is built from a plan's sources
    before = full_walks[0]
    for i in range(3):
        model["step"] = i
        flat.add_(1)
        snap = staging.take(state())
        assert snap["step"] == i and torch.equal(snap["flat"], flat) and isinstance(snap["p"], torch.nn.Parameter)
    assert full_walks[0] - before == (0 if guard == "torch's guard" else 3)

    # every change but the last keeps the address, so only the guard can see it; each must reach the snapshot as
    # torch.save would write it (with the plan kept, the staged copy keeps the old dtype, shape, clothes, bytes)
    small = model["small"]
    changes = [
        ("flat", lambda: flat.view(torch.int32)),  # another dtype
        ("flat", lambda: flat.view(10, 100)),  # another shape
        ("flat", lambda: torch.nn.Parameter(flat, requires_grad=False)),  # now a Parameter
        ("c", lambda: c.conj()),  # a lazy conjugate: its values are not its bytes
        ("small", lambda: small.detach().requires_grad_()),  # now requires grad
        ("small", lambda: small.clone().requires_grad_()),  # new memory too: the addresses alone see it
    ]
    for n, (key, change) in enumerate(changes):
        current = state()
        current[key] = change()
        got, want = staging.take(current)[key], current[key]
        assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape, n
        assert got.requires_grad == want.requires_grad and torch.equal(got.detach(), want.detach()), n
        back = staging.take(state())[key]  # and back to the planned layout
        assert type(back) is type(model[key]) and torch.equal(back, model[key].detach()), n


def test_one_object_met_twice_takes_the_quick_walk_and_another_object_in_its_place_is_seen(monkeypatch):
    """torch's guard rejects an object passed twice, so it checks a repeated object once, and the quick walk
    checks that the repeat is still that object: another tensor at the same address may have another layout."""
    full_walks = _count_full_walks(monkeypatch)
    w, staging = torch.randn(16), StagingBuffers()
    for _ in range(3):
        snap = staging.take({"a": w, "b": w})
        assert snap["a"] is snap["b"] and torch.equal(snap["a"], w)
    assert full_walks[0] == 1
    snap = staging.take({"a": w, "b": w.view(torch.int32)})
    assert snap["b"].dtype == torch.int32 and torch.equal(snap["b"], w.view(torch.int32))
    assert full_walks[0] == 2


def test_a_guard_that_rejects_its_own_tensors_is_not_used(monkeypatch):
    """Another torch whose guard means something else: no quick walk wasted on every save, and still exact."""

    class Contrary:
        def __init__(self, *tensors, **kwargs):
            pass

        def check(self, *tensors):
            return False

    monkeypatch.setattr(snapshot, "TensorGuards", Contrary)
    full_walks = _count_full_walks(monkeypatch)
    quick = []
    monkeypatch.setattr(snapshot._Walk, "_mapping_quick", lambda self, obj, out: quick.append(obj))
    state, staging = {"w": torch.randn(10)}, StagingBuffers()
    for i in range(3):
        state["w"].fill_(i)
        assert torch.equal(staging.take(state)["w"], state["w"])
    assert full_walks[0] == 3 and quick == []


def _count_plans(monkeypatch) -> list[int]:
    plans = [0]
    plan = StagingBuffers._plan

    def counted(self, *args):
        plans[0] += 1
        return plan(self, *args)

    monkeypatch.setattr(StagingBuffers, "_plan", counted)
    return plans


@pytest.mark.parametrize("guard", ["torch's guard", "no guard in this torch"])
def test_a_small_tensor_new_at_every_snapshot_costs_one_new_plan_not_one_per_snapshot(monkeypatch, guard):
    """A monitored score (Lightning's ModelCheckpoint keeps a new tensor in every checkpoint) made a new plan at
    every save: 18 ms of 29 for a state of 1,040 tensors. It becomes loose, copied on its own wherever it is."""
    if guard == "no guard in this torch":
        monkeypatch.setattr(snapshot, "TensorGuards", None)
    plans = _count_plans(monkeypatch)
    state = {f"b{i}": torch.randn(64) for i in range(200)} | {"w": torch.randn(100_000), "step": 0}
    staging, kept = StagingBuffers(), []
    for i in range(20):
        score = torch.tensor(float(i), requires_grad=i % 2 == 1)  # and its flag changes too
        if i == 12:
            score = torch.full((3, 2000), float(i))  # larger than the room planned for it: planned again
        if i == 15:
            score = torch.full((30_000,), float(i))  # too large to be loose: back in the ranges, planned again
        kept.append(score)  # the old scores stay alive: the new one is elsewhere in memory
        state["score"], state["top"], state["step"] = score, score, i  # the same tensor twice, as Lightning keeps it
        snap = staging.take(state)
        score.data.add_(100)  # after the snapshot: must not reach it
        assert torch.equal(snap["score"].detach(), torch.full_like(score, float(i))), i
        assert snap["top"] is snap["score"], i  # copied once, still one tensor
        assert snap["score"].requires_grad == score.requires_grad and snap["step"] == i, i
        assert all(torch.equal(snap[k], v) for k, v in state.items() if k.startswith(("b", "w"))), i
    assert plans[0] == 4  # the first, the one that found the score moving, the one that took it back into the
    # ranges when it grew too large to be loose, and the one that made it loose again (the larger score of i=12
    # fits the buffer's slack)
    assert staging.allocations == 1 and staging._loose == {200 + 1, 200 + 2}  # "score" and "top"


@pytest.mark.parametrize("guard", ["torch's guard", "no guard in this torch"])
def test_tensors_added_before_others_keep_the_plan_and_one_gone_makes_a_new_one(monkeypatch, guard):
    """A list of tensors that grows at every save shifts the position of every tensor after it: Lightning's
    ModelCheckpoint(save_top_k=-1) keeps a score per checkpoint in ``best_k_models``, and its callback state comes
    before the optimizer state. Matched by position, every save made a new plan (20 in 20 saves); matched by
    signature, the newcomers are loose and the plan stays, until a planned tensor is gone."""
    if guard == "no guard in this torch":
        monkeypatch.setattr(snapshot, "TensorGuards", None)
    plans = _count_plans(monkeypatch)
    model = {f"b{i}": torch.randn(64) for i in range(100)} | {"w": torch.randn(100_000)}
    moments = {f"m{i}": torch.randn(64) for i in range(100)}
    best_k: dict[str, torch.Tensor] = {}
    staging = StagingBuffers()

    def snapshot_is_exact() -> None:
        state = {
            "state_dict": {k: v.detach() for k, v in model.items()},  # new objects, same memory: as state_dict()
            "callbacks": {"best_k_models": dict(best_k), "step": len(best_k)},
            "optimizer_states": [{k: v.detach() for k, v in moments.items()}],
        }
        want = {k: v.clone() for k, v in [*model.items(), *moments.items(), *best_k.items()]}
        snap = staging.take(state)
        for t in [*model.values(), *moments.values(), *best_k.values()]:
            t.add_(1)  # after the snapshot: must not reach it
        got = snap["state_dict"] | snap["optimizer_states"][0] | snap["callbacks"]["best_k_models"]
        assert got.keys() == want.keys() and snap["callbacks"]["step"] == len(best_k)
        assert all(torch.equal(got[k], want[k]) for k in want)

    for epoch in range(20):
        best_k[f"epoch={epoch}.ckpt"] = torch.tensor(float(epoch))
        snapshot_is_exact()
    assert plans[0] == 1 and len(staging._loose) == 19  # every score after the first one planned
    del best_k["epoch=0.ckpt"]  # the one planned score is gone: its bytes must not be read again
    snapshot_is_exact()
    assert plans[0] == 2 and len(staging._loose) == 19  # a new plan, the others still loose
    for epoch in range(20, 90):  # more newcomers than may be loose (64): planned with the others, and again
        best_k[f"epoch={epoch}.ckpt"] = torch.full((epoch,), float(epoch))
        snapshot_is_exact()
    assert plans[0] == 3 and staging.allocations == 1
    model["w"] = torch.randn(100_000)  # a large newcomer (and a large tensor gone): a new plan
    snapshot_is_exact()
    assert plans[0] == 4 and not staging._loose


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch.nested is a prototype
def test_a_nested_tensor_at_a_planned_address_does_not_reach_the_guard():
    """torch's guard reads sizes and strides before anything else; a strided nested tensor has none, and the
    process aborts. One viewing the planned tensor's memory passes the address check, so the quick walk itself
    must turn it away."""
    buffer = torch.randn(5)
    state = {"w": torch.ones(2), "x": buffer}
    staging = StagingBuffers()
    staging.take(state)
    staging.take(state)
    state["x"] = torch._nested_view_from_buffer(
        buffer, torch.tensor([[2], [3]]), torch.tensor([[1], [1]]), torch.tensor([0, 2])
    )
    assert state["x"].data_ptr() == buffer.data_ptr()
    snap = staging.take(state)
    assert snap["x"].is_nested and [t.tolist() for t in snap["x"].unbind()] == [
        buffer[:2].tolist(),
        buffer[2:].tolist(),
    ]


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR is in beta
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_a_tensor_without_storage_after_the_plan_takes_the_full_walk(layout):
    """A sparse tensor has no address to check: the quick walk leaves it to the full walk, which copies it."""
    state = {"w": torch.ones(2), "x": torch.randn(4, 4)}
    staging = StagingBuffers()
    staging.take(state)
    dense = torch.eye(4)
    state["x"] = dense.to_sparse() if layout == "sparse_coo" else dense.to_sparse_csr()
    snap = staging.take(state)
    assert snap["x"].layout == state["x"].layout and torch.equal(snap["x"].to_dense(), dense)
    state["x"].values().mul_(3)  # a copy, not the tensor itself
    assert torch.equal(snap["x"].to_dense(), dense)


def test_a_tensor_on_another_device_at_a_planned_address_is_seen_by_the_guard():
    """The quick walk reads no device: an empty meta tensor has the planned empty tensor's address (0), and
    the guard tells them apart."""
    state = {"w": torch.randn(10), "e": torch.empty(0)}
    staging = StagingBuffers()
    staging.take(state)
    staging.take(state)
    meta = torch.empty(0, device="meta")
    assert meta.data_ptr() == state["e"].data_ptr()
    assert staging.take(state | {"e": meta})["e"].device.type == "meta"
    assert staging.take(state)["e"].device.type == "cpu"


def test_a_large_snapshot_copies_every_kind_of_tensor_exactly():
    torch.manual_seed(0)
    state = {
        "big": torch.randn(5_000_001),  # > 16 MiB in all: the threaded byte copy runs
        "bf16": torch.randn(4_000_003).to(torch.bfloat16),
        "conj": torch.randn(33, dtype=torch.complex64).conj(),  # a lazy conjugate: never copied as raw bytes
        "strided": torch.randn(64, 32)[:, ::3],
        "empty": torch.empty(0, 5),
        "flag": torch.tensor([True, False, True]),
    }
    snap = StagingBuffers().take(state)
    for k, v in state.items():
        assert snap[k].dtype == v.dtype and torch.equal(snap[k], v), k


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch deprecates quantized tensors and TypedStorage
def test_tensors_no_flat_buffer_can_hold_are_deep_copied_beside_staged_ones():
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    state = {"q": q, "meta": torch.empty(3, device="meta"), "sparse": torch.randn(3, 3).to_sparse(), "w": torch.ones(2)}
    staging = StagingBuffers()
    snap = staging.take(state)
    assert snap["q"].is_quantized and snap["q"] is not q and torch.equal(snap["q"].dequantize(), q.dequantize())
    assert snap["meta"].is_meta and snap["meta"].shape == (3,)
    assert snap["sparse"].is_sparse and torch.equal(snap["sparse"].to_dense(), state["sparse"].to_dense())
    assert staging.nbytes == 2 * 4  # only the plain tensor went to a buffer
    state["sparse"].values()[0] = 100.0  # a later change does not reach the snapshot
    assert snap["sparse"].values()[0] != 100.0


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch.nested is a prototype
def test_a_nested_tensor_is_copied_whole_beside_staged_ones():
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    state = {"nested": nested, "again": [nested], "w": torch.ones(2)}
    staging = StagingBuffers()
    snap = staging.take(state)
    assert snap["nested"].is_nested and snap["again"][0] is snap["nested"]
    assert all(torch.equal(a, b) for a, b in zip(snap["nested"].unbind(), nested.unbind(), strict=True))
    nested.unbind()[0].fill_(100.0)  # a later change does not reach the snapshot
    assert not (snap["nested"].unbind()[0] == 100.0).any() and torch.equal(snap["w"], state["w"])


def _saved(obj) -> tuple[int, object]:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell(), torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def test_tied_weights_are_staged_once_and_stay_tied_like_torch_save():
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 1000, bias=False))
    model[1].weight = model[0].weight  # tied, as in language models: state_dict() gives two tensor objects
    state = model.state_dict()
    keys = list(state)
    assert state[keys[0]] is not state[keys[1]] and state[keys[0]].data_ptr() == state[keys[1]].data_ptr()
    staging = StagingBuffers()
    snap = staging.take(state)
    size, back = _saved(snap)
    stock_size, _ = _saved(state)
    assert size < stock_size * 1.1  # was: twice the bytes, one storage per key
    assert back[keys[0]].data_ptr() == back[keys[1]].data_ptr()  # tied again when loaded
    assert torch.equal(back[keys[1]], model[0].weight.detach())
    assert staging.nbytes == 1000 * 64 * 4  # what one checkpoint needs on disk: the weight once


def test_a_plain_tensor_that_requires_grad_keeps_it_like_torch_save():
    log_alpha = torch.zeros(1, requires_grad=True)  # SAC's temperature: a leaf tensor, not a Parameter
    state = {"log_alpha": log_alpha, "w": torch.ones(3)}
    staging = StagingBuffers()
    for _ in range(2):  # the staged view is reused: dressing it must not leak the flag to the next snapshot
        snap = staging.take(state)
        assert snap["log_alpha"].requires_grad and not snap["w"].requires_grad
        assert _saved(snap)[1]["log_alpha"].requires_grad == _saved(state)[1]["log_alpha"].requires_grad
    state["log_alpha"] = torch.zeros(1)
    assert not staging.take(state)["log_alpha"].requires_grad


def test_a_tensor_whose_storage_was_resized_under_it_is_refused_not_read():
    t = torch.randn(1000)
    state = {"t": t}
    staging = StagingBuffers()
    staging.take(state)
    t.untyped_storage().resize_(16)  # as FSDP frees a parameter's storage; was: 4,000 bytes read from 16
    with pytest.raises(ValueError, match="spans 4000 bytes of a storage of 16"):
        staging.take(state)


class _Frozen(collections.abc.Mapping):
    """An immutable mapping in a state (a config object): copied whole, its tensors too."""

    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def test_an_immutable_mapping_is_copied_whole_and_the_plan_still_holds(monkeypatch):
    """Its tensors were counted as sources before the assignment into the copy failed: planned and staged for
    nothing, and with the quick walk reading a mapping at once, a plan that never matched again."""
    full_walks = _count_full_walks(monkeypatch)
    frozen = _Frozen({"a": torch.ones(3), "b": torch.nn.Parameter(torch.zeros(2))})
    state, staging = {"w": torch.randn(100), "config": frozen}, StagingBuffers()
    for i in range(3):
        state["w"].fill_(i)
        snap = staging.take(state)
        assert torch.equal(snap["w"], state["w"]) and type(snap["config"]) is _Frozen
        assert torch.equal(snap["config"]["a"], frozen["a"]) and snap["config"]["a"] is not frozen["a"]
    assert len(staging._views) == 1 and full_walks[0] == 1  # the plan, then quick walks


def test_a_tie_copied_one_by_one_is_still_copied_after_tensors_are_added_before_it():
    """Tied tensors copied one by one (not contiguous here; every CUDA tensor) were renumbered at the last position
    and looked up at the first: after two renumbers nothing copied them, and each snapshot held old values."""
    base, staging, scores = torch.arange(12.0).reshape(3, 4), StagingBuffers(), []
    for step in range(4):
        base += 1
        state = {f"s{i}": s for i, s in enumerate(scores)} | {"w": base.t(), "w_tied": base.t()}
        want = {k: v.clone() for k, v in state.items()}
        snap = staging.take(state)
        assert all(torch.equal(snap[k], want[k]) for k in want), step
        scores.append(torch.tensor(float(step)))  # a growing list before them, as best_k_models


def test_a_plan_renumbered_half_way_is_not_taken_for_the_old_one():
    """A newcomer whose storage was freed raises while the plan is renumbered; the quick walk then took the next
    state for the old plan, with the new numbering: wrong shapes, and one tensor's values under another's key."""
    a, b, staging = torch.tensor([1.0]), torch.arange(100_000, dtype=torch.float32), StagingBuffers()
    staging.take({"a": a, "b": b})
    freed = torch.ones(4)
    freed.untyped_storage().resize_(0)  # as FSDP frees a parameter
    with pytest.raises(ValueError, match="resized under it"):
        staging.take({"x": freed, "a": a, "b": b})
    a += 1
    b += 1
    snap = staging.take({"a": a, "b": b})
    assert torch.equal(snap["a"], a) and torch.equal(snap["b"], b)


class _Wrapped(_Frozen, collections.abc.MutableMapping):
    """A mutable mapping over a dict of its own, without __copy__: copy.copy shares that dict."""

    def __setitem__(self, key, value):
        self._items[key] = value

    def __delitem__(self, key):
        del self._items[key]


def test_mappings_that_refuse_assignment_or_share_their_contents_are_copied_whole():
    """torch.fx's immutable_dict (a dict that refuses assignment) made every snapshot raise; a mapping whose copy
    shares its contents had the staged tensors written into the live state."""
    from torch.fx.immutable_collections import immutable_dict

    t, u = torch.arange(4.0), torch.ones(2)
    frozen, wrapped = immutable_dict({"a": t, "lr": 0.1}), _Wrapped({"u": u})
    staging = StagingBuffers()
    for _ in range(3):
        snap = staging.take({"cfg": frozen, "m": wrapped, "w": torch.ones(3)})
        assert type(snap["cfg"]) is immutable_dict and torch.equal(snap["cfg"]["a"], t) and snap["cfg"]["a"] is not t
        assert wrapped["u"] is u and torch.equal(snap["m"]["u"], u)  # the live mapping untouched


def test_an_object_met_again_where_a_loose_tensor_was_is_tied_again():
    """The quick walk laid out a loose position again whatever it held: a planned tensor there (the same object
    under two keys) was saved as two storages, where torch.save of the state writes one."""
    w, staging = torch.randn(100), StagingBuffers()
    staging.take({"w": w, "score": torch.tensor(0.0)})
    staging.take({"w": w, "score": torch.tensor(1.0)})  # the score moved: loose
    assert staging._loose
    snap = staging.take({"w": w, "score": w})
    assert snap["score"] is snap["w"] and torch.equal(snap["w"], w)
