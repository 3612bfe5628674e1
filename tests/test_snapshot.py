"""StateDictLock (exclusion, no deadlock, no starvation of the step) and the staged copies of a snapshot."""

from __future__ import annotations

import collections
import gc
import io
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

from ranksafe.lock import StateDictLock
from ranksafe.snapshot import StagingBuffers
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


_HANDLER_READS_WHILE_ITS_THREAD_WAITS_TO_WRITE = """
import faulthandler, signal, sys, threading, time
from ranksafe.lock import StateDictLock
faulthandler.dump_traceback_later(10, exit=True)  # a hang prints where, and fails the test
side = sys.argv[1]  # what another thread holds while the main thread waits to write: "read" or "write"
lock, held, handled, events = StateDictLock(), threading.Event(), threading.Event(), []
main = threading.main_thread().ident

def other_thread():  # a snapshot (read) or an optimizer step (write) on another thread
    with lock.read() if side == "read" else lock.write():
        held.set()
        handled.wait(5 if side == "read" else 1)  # a write ends on its own: the handler must wait for it
        events.append(f"the other thread's {side} ends")

def on_usr1(signum, frame):  # a save from a signal handler, as Lightning's SLURM requeue handler makes one
    assert main in lock._writers_waiting, "the signal came before the main thread waited to write"
    with lock.read():
        events.append("the handler's snapshot")
    handled.set()

def send_once_main_waits():
    while main not in lock._writers_waiting:
        time.sleep(0.01)
    with lock._cond:  # taken: the main thread has let go of it, inside its wait
        pass
    signal.pthread_kill(main, signal.SIGUSR1)

signal.signal(signal.SIGUSR1, on_usr1)
threading.Thread(target=other_thread).start()
held.wait(5)
threading.Thread(target=send_once_main_waits).start()
with lock.write():  # the optimizer step, waiting for the other thread when the signal comes
    events.append("the step")
print("EVENTS", events)
"""


@pytest.mark.parametrize(
    "side, order",
    [
        ("read", ["the handler's snapshot", "the other thread's read ends", "the step"]),
        ("write", ["the other thread's write ends", "the handler's snapshot", "the step"]),
    ],
)
def test_a_signal_handler_reads_while_its_thread_waits_to_write_instead_of_hanging(side, order):
    """Before: the handler's read queued behind the waiting write of its own thread, which could not go on until the
    handler returned: the process hung (here faulthandler ends it after 10 s). It still waits for a write that
    another thread has begun."""
    script = _HANDLER_READS_WHILE_ITS_THREAD_WAITS_TO_WRITE
    out = subprocess.run([sys.executable, "-c", script, side], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert f"EVENTS {order}" in out.stdout, out.stdout


_HANDLER_READS_AT_EACH_POINT = """
import faulthandler, sys, threading, time
sys.path.insert(0, {root!r})
from ranksafe.lock import StateDictLock
from tests.interrupts import interrupt_each_point
faulthandler.dump_traceback_later(100, exit=True)  # a hang prints where, and fails the test


class PlainMutex:  # the control's mutex: a plain lock, which records its owner so that a hang is counted, not met
    def __init__(self):
        self.lock, self.owner = threading.Lock(), None

    def acquire(self, blocking=True, timeout=-1):
        if self.lock.acquire(blocking, timeout):
            self.owner = threading.get_ident()
            return True
        return False

    def release(self):
        self.owner = None
        self.lock.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()

    def _is_owned(self):
        return self.owner == threading.get_ident()


# what the main thread takes, and what another thread does meanwhile: nothing, hold a side for a while, or wait to
# write behind the main thread
SCENARIOS = [(side, other) for side in ("write", "read") for other in (None, "read", "write", "waits to write")]


def sweep(mutex):
    hangs, wrong, tried = 0, [], 0
    for side, other in SCENARIOS:
        lock = StateDictLock()
        if mutex == "plain":
            lock._cond = threading.Condition(PlainMutex())
        writing, ready = threading.Event(), threading.Event()

        def other_thread():
            with lock.read() if other == "read" else lock.write():
                writing.set() if other != "read" else None
                ready.set()
                time.sleep(0.02 if other != "waits to write" else 0)
                writing.clear()

        def handler():  # a save from a signal handler: a snapshot, never beside another thread's write
            nonlocal hangs
            if mutex == "plain" and lock._cond._lock.owner == threading.get_ident():
                hangs += 1  # it would wait for the mutex its own thread holds: for ever
                return
            if not lock.acquire_read(timeout=10):
                wrong.append(f"{{side}}/{{other}}: the handler's read timed out")
                return
            if writing.is_set():
                wrong.append(f"{{side}}/{{other}}: the handler read during another thread's write")
            lock.release_read()

        def action():
            t = threading.Thread(target=other_thread)
            if other in ("read", "write"):
                ready.clear()
                t.start()
                ready.wait(5)
            with lock.write() if side == "write" else lock.read():
                if other == "waits to write":
                    t.start()
                    while t.ident not in lock._writers_waiting:
                        time.sleep(0.001)
            if other is not None:
                t.join(10)

        def after(where):
            left = (lock._readers, lock._writer, lock._writers_waiting)
            if left != (0, None, {{}}):
                wrong.append(f"{{side}}/{{other}} at {{where}}: left {{left}}")

        tried += interrupt_each_point(action, ("/ranksafe/lock.py",), after, handler=handler)
    print(mutex, "points", tried, "hangs", hangs, "wrong", len(wrong), *wrong, flush=True)


def ctrl_c():  # a handler that raises: the lock is left free or held by this thread, whole, never half-way
    half, held, lost, tried, mutex = [], [], [], 0, 0
    for side in ("write", "read"):
        lock, run = StateDictLock(), {{}}

        def other_side(lock, run, side):  # another thread, waiting for the other side meanwhile: it must get it
            got = lock.acquire_read(timeout=5) if side == "write" else lock.acquire_write(timeout=5)
            run["got"] = got, time.monotonic()
            if got:
                lock.release_read() if side == "write" else lock.release_write()

        def action():
            nonlocal run
            run = {{}}
            with lock.write() if side == "write" else lock.read():
                run["other"] = threading.Thread(target=other_side, args=(lock, run, side), daemon=True)
                run["other"].start()
                while not lock._cond._waiters:  # the other thread waits in the lock (a read behind this write)
                    time.sleep(0.001)

        def after(where):
            nonlocal lock, mutex
            me = threading.get_ident()
            if lock._cond._is_owned():  # raised in Condition's own __enter__ or __exit__: the standard library's window
                mutex += 1  # (a re-entrant mutex: the interrupted thread can still take the lock, the others cannot)
                lock = StateDictLock()
                return
            left = (lock._readers, lock._writer, lock._write_depth, tuple(lock._writers_waiting), lock._reads())
            whole = {{(0, None, 0, (), 0): "free", (0, me, 1, (), 0): "write", (1, None, 0, (), 1): "read"}}
            other = tuple(lock._writers_waiting) if side == "read" else ()  # the other thread, waiting to write
            left_mine = left[:3] + (tuple(w for w in left[3] if w not in other),) + left[4:]
            if left_mine not in whole:
                half.append(f"{{side}} at {{where}}: {{left}}")
            elif whole[left_mine] != "free":
                if where.split(" in ")[1].split(",")[0] not in BEFORE_A_RELEASE:
                    held.append(f"{{side}} at {{where}}: the {{whole[left_mine]}} side held")
                lock.release_write() if whole[left_mine] == "write" else lock.release_read()  # as its owner would
            free = time.monotonic()
            if "other" in run:
                run["other"].join(10)
                got, when = run.get("got", (False, 0.0))
                if not got or when - free > 1:  # no wakeup came: it waited for its timeout
                    lost.append(f"{{side}} at {{where}}: the other thread got the lock {{when - free:.1f}}s later")
            lock = StateDictLock()

        tried += interrupt_each_point(action, ("/ranksafe/lock.py",), after)
    print("ctrl-c points", tried, "half", len(half), "held", len(held), "lost", len(lost), "mutex", mutex, *half,
          *held, *lost, flush=True)  # fmt: skip


# where a release has not begun yet, so that a Ctrl-C there leaves its side held, as at any point before a release
BEFORE_A_RELEASE = ("release_write", "release_read", "__enter__", "_reads")
sweep("plain")
sweep("ranksafe")
ctrl_c()
"""


def test_a_signal_handler_that_reads_at_any_point_of_the_lock_neither_hangs_nor_overlaps_a_write():
    """A save from a signal handler runs on the thread it interrupts, which may be inside the lock's own bookkeeping,
    holding its mutex: with a plain mutex (the control) the handler waited for its own thread for ever. The handler
    runs at every point of each protocol where CPython runs one; it must get the read side, never while another
    thread writes, and leave the lock as it found it. A release that woke the waiting threads after giving the lock
    back (as before) also hangs here: a handler landing between the two waited for a writer nobody woke.

    Then a handler that raises (Ctrl-C) at each point of a step and of a snapshot: the lock must be left free or held
    whole by the interrupted thread, never half-way (before: a read counted but not on its thread, or a writer
    listed as waiting for ever), and held only where the release had not begun (a release that woke the waiting
    threads before giving back, outside a ``finally``, left its side held); and a thread waiting for the other side
    must get it as soon as it is free (a release interrupted in its wakeup left it waiting for ever)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _HANDLER_READS_AT_EACH_POINT.format(root=root)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    plain, ours, ctrl_c = (line.split() for line in out.stdout.splitlines())
    assert plain[:2] == ["plain", "points"] and int(plain[4]) >= 20, out.stdout  # the control hangs, often
    assert ours[:2] == ["ranksafe", "points"] and int(ours[2]) >= 100, out.stdout  # every point of 8 protocols
    assert ours[3:] == ["hangs", "0", "wrong", "0"], out.stdout
    assert ctrl_c[:2] == ["ctrl-c", "points"] and int(ctrl_c[2]) >= 25, out.stdout
    assert ctrl_c[3:9] == ["half", "0", "held", "0", "lost", "0"], out.stdout


_HANDLER_WRITES_WHILE_ITS_THREAD_WAITS_TO_WRITE = """
import faulthandler, signal, threading, time
from ranksafe.lock import StateDictLock
faulthandler.dump_traceback_later(30, exit=True)  # a hang prints where, and fails the test
lock, reading, main, seen = StateDictLock(), threading.Event(), threading.main_thread().ident, []


def another_snapshot():  # the main thread's step waits for it; a signal comes meanwhile
    with lock.read():
        reading.set()
        while main not in lock._writers_waiting:
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGUSR1)
        time.sleep(0.2)


def on_usr1(signum, frame):  # a handler that takes the write side itself (a last step, weights restored)
    with lock.write(timeout=5):
        seen.append("the handler's write")
    seen.append(f"still waiting: {lock.waits_to_write()}")


signal.signal(signal.SIGUSR1, on_usr1)
threading.Thread(target=another_snapshot).start()
reading.wait(5)
with lock.write(timeout=5):
    seen.append("the step")
print("SEEN", seen, dict(lock._writers_waiting))
"""


def test_a_signal_handler_that_writes_while_its_thread_waits_to_write_leaves_that_wait_as_it_was():
    """Review of cd7d874: the waiting writers were a dict of threads, and the handler's wait removed its thread's
    entry; the interrupted wait then raised ``KeyError`` (the step failed), and meanwhile no read queued behind it."""
    script = _HANDLER_WRITES_WHILE_ITS_THREAD_WAITS_TO_WRITE
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "SEEN [\"the handler's write\", 'still waiting: True', 'the step'] {}" in out.stdout, out.stdout


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


def _addresses(snap) -> dict:
    return {k: v.data_ptr() for k, v in snap.items()}


def test_thousands_of_tensors_are_staged_once_and_reused_while_the_layout_stays():
    staging = StagingBuffers()
    state = _many_tensors()
    snap = staging.take(state)
    assert staging.allocations == 1 and staging.nbytes == 1000 * (6 * 4 + 4 * 8) + 5 * 2
    assert type(snap) is collections.OrderedDict and list(snap) == list(state)
    assert all(snap[k].dtype == state[k].dtype and torch.equal(snap[k], state[k]) for k in state)
    assert all(snap[k].data_ptr() != state[k].data_ptr() for k in state)  # copies, not aliases
    staged = _addresses(snap)
    for v in state.values():
        v.add_(1)
    again = collections.OrderedDict((k, v.detach()) for k, v in state.items())  # new objects, same memory
    again["p1"] = torch.randn(3, 2)  # and new memory, same dtype and shape
    snap = staging.take(again)
    assert staging.allocations == 1 and _addresses(snap) == staged  # the same staged tensors
    assert all(torch.equal(snap[k], again[k]) for k in again)


def test_a_changed_dtype_shape_or_tie_builds_a_new_layout_that_keeps_the_staged_tensors_that_fit():
    staging = StagingBuffers()
    state = {"a": torch.randn(100_000), "b": torch.randn(10, 10), "c": torch.arange(6)}
    staged = _addresses(staging.take(state))
    changes = [  # (key, new value, staging memory allocated so far)
        ("b", torch.randn(10, 11), 2),  # another shape
        ("c", torch.arange(6.0), 3),  # another dtype
        ("c", state["a"][:6], 3),  # a view of "a": same dtype and shape as before, the same layout
        ("c", state["a"], 3),  # "a" itself: tied to it, a new layout with nothing to allocate
        ("c", torch.arange(6.0), 4),  # untied again
    ]
    for key, value, allocations in changes:
        state[key] = value
        snap = staging.take(state)
        assert staging.allocations == allocations, key
        assert all(torch.equal(snap[k], v) for k, v in state.items()), key
        assert snap["a"].data_ptr() == staged["a"], key  # the large tensor is taken over, never allocated again
        assert (snap["c"].data_ptr() == snap["a"].data_ptr()) == (value is state["a"])
    assert staging.nbytes == 100_000 * 4 + 110 * 4 + 6 * 4


def test_every_change_at_the_same_address_reaches_the_snapshot_as_torch_save_would_write_it():
    """New views of the same memory keep every address; the layout must still see each change, and the staged
    copy be dressed as the tensor is now, not as it was when the layout was built."""
    flat, c, small = torch.randn(1000), torch.randn(8, dtype=torch.complex64), torch.ones(4)
    model = {"flat": flat, "c": c, "small": small}
    staging = StagingBuffers()
    staging.take(model)
    changes = [
        ("flat", flat.view(torch.int32)),  # another dtype
        ("flat", flat.view(10, 100)),  # another shape
        ("flat", torch.nn.Parameter(flat, requires_grad=False)),  # now a Parameter
        ("c", c.conj()),  # a lazy conjugate: its values are not its bytes
        ("small", small.detach().requires_grad_()),  # now requires grad
        ("small", small.view(2, 2).t()),  # another shape and strides
    ]
    for n, (key, value) in enumerate(changes):
        got = staging.take(model | {key: value})[key]
        assert type(got) is type(value) and got.dtype == value.dtype and got.shape == value.shape, n
        assert got.requires_grad == value.requires_grad and torch.equal(got.detach(), value.detach()), n
        back = staging.take(model)[key]  # and back to the first layout
        assert type(back) is torch.Tensor and not back.requires_grad and torch.equal(back, model[key]), n


def test_dense_tensors_keep_their_strides_as_torch_save_keeps_them():
    """Before, every staged tensor was contiguous: a channels_last weight or a transposed one came back from the
    snapshot's file with other strides than from ``torch.save`` of the state (a model loaded with ``assign=True``
    lost its memory format), and its copy was a gather instead of a straight one. A view with gaps still gets a
    contiguous storage of its own bytes."""
    conv = torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last)
    state = {"conv": conv, "t": torch.randn(5, 7).t(), "gaps": torch.randn(6, 8)[:, ::2], "w": torch.randn(10)}
    staging = StagingBuffers()
    for _ in range(2):  # built, then reused
        snap = staging.take(state)
        buffer = io.BytesIO()
        torch.save(snap, buffer)
        buffer.seek(0)
        back = torch.load(buffer)
        for k, v in state.items():
            assert torch.equal(back[k], v), k
            assert back[k].stride() == (v.stride() if k != "gaps" else (4, 1)), k
        assert back["conv"].is_contiguous(memory_format=torch.channels_last)
        assert back["gaps"].untyped_storage().nbytes() == 6 * 4 * 4  # its own bytes only
    assert staging.allocations == 1
    state["conv"] = conv.contiguous()  # the same shape in another memory format: a layout of its own
    snap = staging.take(state)
    assert staging.allocations == 2 and snap["conv"].is_contiguous() and torch.equal(snap["conv"], conv)


def test_values_changed_after_the_capture_do_not_reach_the_snapshot():
    """The copy is taken when capture() returns; the writer thread assembles it later, while training goes on."""
    w, log = torch.zeros(1000), {"loss": [1.0]}
    state = {"w": w, "view": w[10:20], "log": log, "t": (w, 5)}
    captured = StagingBuffers().capture(state)
    w.add_(7)  # the optimizer step that follows
    log["loss"].append(0.5)
    state["extra"] = 1
    snap = captured.assemble()
    assert not snap["w"].any() and not snap["view"].any() and snap["t"][0] is snap["w"]
    assert snap["log"] == {"loss": [1.0]} and "extra" not in snap


class _History(list):
    """A container the walk does not know: deep-copied whole, its cycles too."""


def test_snapshot_keeps_structure_ties_parameters_and_deep_copies_the_rest():
    staging = StagingBuffers()
    w = torch.nn.Parameter(torch.randn(4, 4))
    t = torch.randn(6, 4).t()  # not contiguous
    Point = collections.namedtuple("Point", "x y")
    factory = collections.defaultdict(list, {"a": torch.ones(2)})
    history = _History([1, 2])
    history.append(history)
    for _ in range(3):  # the first builds the layout, the others reuse it
        state = {"w": w, "tied": [w, w], "t": t, "meta": {"lr": [0.1]}, "pt": Point(1, t), "n": None}
        state |= {"raw": memoryview(b"abc"), "dd": factory, "tuple": (t, "x"), "history": history}
        snap = staging.take(state)
        state["meta"]["lr"].append(0.2)  # non-tensor state changes after the call: the snapshot must not
        assert snap["meta"] == {"lr": [0.1]}
        assert isinstance(snap["w"], torch.nn.Parameter) and torch.equal(snap["w"], w)
        assert snap["tied"][0] is snap["tied"][1] is snap["w"]  # one object, still one object
        assert torch.equal(snap["t"], t) and isinstance(snap["pt"], Point) and snap["pt"].y is snap["t"]
        assert snap["tuple"] == (snap["t"], "x") and type(snap["tuple"]) is tuple
        assert snap["n"] is None and snap["raw"] == b"abc"
        assert type(snap["dd"]) is collections.defaultdict and snap["dd"].default_factory is list
        assert torch.equal(snap["dd"]["a"], factory["a"]) and snap["dd"]["a"] is not factory["a"]
        assert type(snap["history"]) is _History and snap["history"][2] is snap["history"] is not history
    assert staging.allocations == 1


def _dtensor_snapshot(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(16.0).reshape(4, 4)
    d = distribute_tensor(full, mesh, [Shard(0)])
    snap = StagingBuffers().take({"w": d})["w"]
    before = d.to_local().clone()
    d.to_local().add_(100)
    return {
        "type": type(snap) is DTensor,
        "placements": str(snap.placements),
        "shape": tuple(snap.shape),
        "local_equal": torch.equal(snap.to_local(), before),
        "copied": snap.to_local().data_ptr() != d.to_local().data_ptr(),
        "mesh": snap.device_mesh == mesh,
    }


def test_dtensor_snapshot_copies_the_local_shard_and_keeps_placements():
    for v in run_ranks(_dtensor_snapshot, 2).values:
        expected = {"type": True, "placements": "(Shard(dim=0),)", "shape": (4, 4), "local_equal": True}
        assert v == expected | {"copied": True, "mesh": True}


def _file(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_each_staged_tensor_holds_exactly_its_own_bytes():
    """A checkpoint of the snapshot holds the tensors, never the bytes around them: views into one flat buffer
    (with a filler between them) and a strided view are staged as tensors of their own."""
    flat = torch.full((100 * 64,), 12345.0)
    state = {f"p{i}": flat[i * 64 : i * 64 + 40] for i in range(100)}
    for v in state.values():
        v.copy_(torch.randn(40))
    state["strided"] = torch.randn(64, 32)[:, ::4]
    snap = StagingBuffers().take(state)
    assert all(s.untyped_storage().nbytes() == s.nbytes for s in snap.values())
    saved, filler = _file(snap), torch.tensor(12345.0).numpy().tobytes()
    assert filler not in saved and filler in _file(state)  # the control: torch.save of views writes their storage
    assert len(saved) == len(_file({k: v.clone() for k, v in state.items()}))  # as torch.save of copies would
    loaded = torch.load(io.BytesIO(saved))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_views_that_start_at_one_address_are_tied_only_when_they_hold_the_same_values():
    base = torch.randn(64, dtype=torch.complex64)
    state = {
        "base": base,
        "head": base[:8],  # same address, another shape
        "bits": base.view(torch.float32),  # another dtype
        "conj": base.conj(),  # a lazy conjugate: other values from the same bytes
        "again": base.detach(),  # another object, same values: tied to "base"
        "head2": base[:8].detach(),  # tied to "head", not to the first tensor at that address
    }
    staging = StagingBuffers()
    snap = staging.take(state)
    assert all(torch.equal(snap[k], v.resolve_conj()) for k, v in state.items())
    assert snap["again"].data_ptr() == snap["base"].data_ptr() and snap["again"] is not snap["base"]
    assert snap["head2"].data_ptr() == snap["head"].data_ptr() != snap["base"].data_ptr()
    assert len({snap[k].data_ptr() for k in state}) == 4 and staging.nbytes == (64 * 3 + 8) * 8


def test_a_large_snapshot_copies_every_kind_of_tensor_exactly():
    torch.manual_seed(0)
    state = {
        "big": torch.randn(5_000_001),  # > 16 MiB in all: torch's threads copy it
        "bf16": torch.randn(4_000_003).to(torch.bfloat16),
        "conj": torch.randn(33, dtype=torch.complex64).conj(),  # a lazy conjugate: staged with its values
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
    assert staging.nbytes == 2 * 4  # only the plain tensor was staged
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


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR is in beta, torch.nested a prototype
@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "nested"])
def test_a_tensor_that_turns_unstageable_after_the_layout_was_built_is_copied_whole(kind):
    buffer = torch.randn(5)
    state = {"w": torch.ones(2), "x": buffer}
    staging = StagingBuffers()
    staging.take(state)
    if kind == "nested":  # over the very memory the layout staged "x" from
        offsets = torch.tensor([[2], [3]]), torch.tensor([[1], [1]]), torch.tensor([0, 2])
        state["x"] = torch._nested_view_from_buffer(buffer, *offsets)
    else:
        state["x"] = torch.eye(4).to_sparse() if kind == "sparse_coo" else torch.eye(4).to_sparse_csr()
    snap = staging.take(state)
    if kind == "nested":
        assert snap["x"].is_nested and [t.tolist() for t in snap["x"].unbind()] == [
            buffer[:2].tolist(),
            buffer[2:].tolist(),
        ]
    else:
        assert snap["x"].layout == state["x"].layout and torch.equal(snap["x"].to_dense(), torch.eye(4))
    assert torch.equal(staging.take({"w": torch.ones(2), "x": buffer})["x"], buffer)  # and back


def _saved(obj) -> tuple[int, object]:
    data = _file(obj)
    return len(data), torch.load(io.BytesIO(data), weights_only=True)


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
    assert size < stock_size * 1.1  # one storage, not one per key
    assert back[keys[0]].data_ptr() == back[keys[1]].data_ptr()  # tied again when loaded
    assert torch.equal(back[keys[1]], model[0].weight.detach())
    assert staging.nbytes == 1000 * 64 * 4  # what one checkpoint needs on disk: the weight once


def test_a_plain_tensor_that_requires_grad_keeps_it_like_torch_save():
    log_alpha = torch.zeros(1, requires_grad=True)  # SAC's temperature: a leaf tensor, not a Parameter
    state = {"log_alpha": log_alpha, "w": torch.ones(3)}
    staging = StagingBuffers()
    for _ in range(2):  # the staged tensor is reused: dressing it must not leak the flag to the next snapshot
        snap = staging.take(state)
        assert snap["log_alpha"].requires_grad and not snap["w"].requires_grad
        assert _saved(snap)[1]["log_alpha"].requires_grad == _saved(state)[1]["log_alpha"].requires_grad
    state["log_alpha"] = torch.zeros(1)
    assert not staging.take(state)["log_alpha"].requires_grad
    state["log_alpha"] = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    snap = staging.take(state)
    assert type(snap["log_alpha"]) is torch.nn.Parameter and not snap["log_alpha"].requires_grad


def test_python_attributes_of_a_tensor_or_a_parameter_are_kept_as_they_were_at_the_capture_like_torch_save():
    """Before: dropped (``torch.save`` keeps them: Megatron marks its parameters so)."""
    weight = torch.nn.Parameter(torch.ones(3))
    weight.partition_dim, weight.groups = 0, ["tp"]
    buffer = torch.zeros(2)
    buffer.tag = "ema"
    state = {"weight": weight, "buffer": buffer, "plain": torch.ones(1)}
    expected = {k: dict(vars(v)) for k, v in _saved(state)[1].items()}
    captured = StagingBuffers().capture(state)
    weight.groups.append("dp")  # after the capture: not in the snapshot
    buffer.tag = "changed"
    snap = captured.assemble()
    assert {k: vars(v) for k, v in snap.items()} == expected == {
        "weight": {"partition_dim": 0, "groups": ["tp"]}, "buffer": {"tag": "ema"}, "plain": {},
    }  # fmt: skip
    assert type(snap["weight"]) is torch.nn.Parameter


@pytest.mark.parametrize("resize_to", [0, 16])
def test_a_tensor_whose_storage_was_resized_under_it_is_refused_not_read(resize_to):
    """``t.clone()`` of such a tensor crashes the process with a segmentation fault; FSDP frees parameters so."""
    t = torch.randn(1000)
    state = {"model": {"w": t, "b": torch.ones(3)}}
    staging = StagingBuffers()
    staging.take(state)
    t.untyped_storage().resize_(resize_to)
    with pytest.raises(
        ValueError,
        match=rf"state\['model'\]\['w'\] \(\(1000,\), torch.float32\) lies beyond its storage of {resize_to} bytes",
    ):
        staging.take(state)
    column = torch.randn(100, 10)[:, 9]  # a strided view: its last element is the storage's last
    column.untyped_storage().resize_(3996)
    with pytest.raises(ValueError, match="resized under it"):
        staging.take({"column": column})
    state["model"]["w"] = torch.randn(1000)  # and the same layout takes a sound tensor again
    assert torch.equal(staging.take(state)["model"]["w"], state["model"]["w"])


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


def test_an_immutable_mapping_is_copied_whole_and_its_tensors_are_not_staged():
    frozen = _Frozen({"a": torch.ones(3), "b": torch.nn.Parameter(torch.zeros(2))})
    state, staging = {"w": torch.randn(100), "config": frozen}, StagingBuffers()
    for i in range(3):
        state["w"].fill_(i)
        snap = staging.take(state)
        assert torch.equal(snap["w"], state["w"]) and type(snap["config"]) is _Frozen
        assert torch.equal(snap["config"]["a"], frozen["a"]) and snap["config"]["a"] is not frozen["a"]
    assert staging.nbytes == 100 * 4 and staging.allocations == 1


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
    frozen, wrapped = immutable_dict({"a": t, "lr": 0.1, "nested": {"x": 1}}), _Wrapped({"u": u})
    staging = StagingBuffers()
    for _ in range(3):
        snap = staging.take({"cfg": frozen, "m": wrapped, "w": torch.ones(3)})
        assert type(snap["cfg"]) is immutable_dict and torch.equal(snap["cfg"]["a"], t) and snap["cfg"]["a"] is not t
        assert snap["cfg"]["nested"] == {"x": 1}
        assert wrapped["u"] is u and torch.equal(snap["m"]["u"], u)  # the live mapping untouched


def test_ties_stay_right_while_tensors_come_and_go_before_them():
    """Tensors added before a tie (a growing list of scores, as Lightning's best_k_models) shift its position."""
    base, staging, scores = torch.arange(12.0).reshape(3, 4), StagingBuffers(), []
    for step in range(4):
        base += 1
        state = {f"s{i}": s for i, s in enumerate(scores)} | {"w": base.t(), "w_tied": base.t(), "same": base}
        want = {k: v.clone() for k, v in state.items()}
        snap = staging.take(state)
        assert all(torch.equal(snap[k], want[k]) for k in want), step
        assert snap["w"].data_ptr() == snap["w_tied"].data_ptr() != snap["same"].data_ptr(), step
        scores.append(torch.tensor(float(step)))
    assert staging.take({"w": base, "score": base})["score"] is not None


def test_a_failed_capture_leaves_the_staging_usable():
    a, b, staging = torch.tensor([1.0]), torch.arange(100_000, dtype=torch.float32), StagingBuffers()
    staging.take({"a": a, "b": b})
    freed = torch.ones(4)
    freed.untyped_storage().resize_(0)  # as FSDP frees a parameter
    with pytest.raises(ValueError, match="resized under it"):
        staging.take({"x": freed, "a": a, "b": b})
    a += 1
    b += 1
    snap = staging.take({"a": a, "b": b})
    assert torch.equal(snap["a"], a) and torch.equal(snap["b"], b) and staging.allocations == 1


def test_one_object_under_two_keys_is_one_object_in_the_snapshot():
    w, staging = torch.randn(100), StagingBuffers()
    staging.take({"w": w, "score": torch.tensor(0.0)})
    snap = staging.take({"w": w, "score": w})
    assert snap["score"] is snap["w"] and torch.equal(snap["w"], w)
    size, back = _saved(snap)
    assert size == len(_file({"w": w, "score": w})) and back["score"].data_ptr() == back["w"].data_ptr()


def test_a_container_met_twice_or_inside_itself_is_one_container_like_torch_save():
    """Before: a dict under two keys came back as two dicts (a change to one no longer showed in the other, where the
    object ``torch.save`` writes keeps them one), and a dict holding itself raised RecursionError."""
    shared = {"w": torch.randn(10), "lr": [0.1]}
    state = {"model": shared, "ema": shared, "groups": [shared["lr"]], "again": shared["lr"]}
    state["self"] = state
    staging = StagingBuffers()
    for _ in range(2):  # the second capture reuses the layout
        snap = staging.take(state)
        saved = torch.load(io.BytesIO(_file(state)), weights_only=False)
        for copy in (snap, saved):
            assert copy["model"] is copy["ema"] and copy["self"] is copy
            assert copy["groups"][0] is copy["again"] is copy["model"]["lr"]
            assert torch.equal(copy["model"]["w"], shared["w"])
        assert snap["model"] is not shared and snap["again"] is not shared["lr"]  # copies, not the live containers
        assert staging.allocations == 1


class _HandsOutCopies(dict):
    """A mapping that hands out a new copy of each value it holds (a defensive view, as some configs are)."""

    def items(self):
        for k, v in super().items():
            yield k, v.clone() if isinstance(v, torch.Tensor) else v.copy()

    def __copy__(self):
        return _HandsOutCopies(dict.items(self))


def test_containers_a_mapping_hands_out_anew_are_not_taken_for_one_another():
    """Before (while the copies were keyed by the id of a container or a tensor freed after its walk): the next
    temporary at the same address was taken for it, and the snapshot held list0's values under list1 to list3, and
    t0's and t1's under t2 and t3."""
    config = _HandsOutCopies(
        {f"{kind}{i}": [float(i)] if kind == "list" else {"x": float(i)} for i in range(4) for kind in ("list", "dict")}
    )
    snap = StagingBuffers().take({"w": torch.ones(2), "config": config})
    saved = torch.load(io.BytesIO(_file({"config": config})), weights_only=False)
    assert list(dict.items(snap["config"])) == list(dict.items(saved["config"])) == list(dict.items(config))
    # tensors copied whole (cloned: compressed sparse), handed out anew per lookup too
    sparse = _HandsOutCopies({f"t{i}": torch.tensor([[float(i), 0.0], [0.0, 1.0]]).to_sparse_csr() for i in range(4)})
    snap = StagingBuffers().take({"w": torch.ones(2), "sparse": sparse})
    assert [float(v.to_dense()[0, 0]) for v in dict.values(snap["sparse"])] == [0.0, 1.0, 2.0, 3.0]


def test_a_captured_snapshot_keeps_no_tensor_of_the_state_alive():
    """Tensors made for one save (a gathered full state, an EMA copy) are freed once copied, while the snapshot
    waits for its writer; one object under two keys is still one object when it is assembled."""
    staging = StagingBuffers()
    w, extra = torch.randn(100), torch.randn(3).requires_grad_()
    refs = [weakref.ref(w), weakref.ref(extra)]
    captured = staging.capture({"w": w, "again": w, "extra": extra, "meta": {"step": 1}})
    values = w.clone()
    del w, extra
    gc.collect()
    assert [r() for r in refs] == [None, None]
    snap = captured.assemble()
    assert snap["again"] is snap["w"] and torch.equal(snap["w"], values) and snap["extra"].requires_grad


# ------------------------------------------------------------------------------------------------------ CUDA


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@requires_cuda
def test_cuda_tensors_are_staged_in_pinned_memory_and_complete_when_capture_returns():
    big = torch.randn(8 << 20, device="cuda")  # 32 MiB: the copy takes long enough to be caught unfinished
    state = {"big": big, "small": torch.arange(10, device="cuda"), "host": torch.ones(3), "tied": big.detach()}
    staging = StagingBuffers()
    for step in range(3):
        want = {k: v.cpu() for k, v in state.items()}
        captured = staging.capture(state)
        big.add_(1)  # queued on the GPU after the capture: must not reach the snapshot
        snap = captured.assemble()
        assert all(torch.equal(snap[k], want[k]) for k in state), step
        assert all(snap[k].device.type == "cpu" for k in state) and snap["big"].is_pinned(), step
        assert snap["tied"].data_ptr() == snap["big"].data_ptr(), step
    assert staging.allocations == 1


@pytest.mark.cuda
@requires_cuda
def test_a_tensor_moved_to_the_gpu_builds_a_new_layout():
    state, staging = {"w": torch.randn(1000)}, StagingBuffers()
    staging.take(state)
    state["w"] = state["w"].cuda()
    snap = staging.take(state)
    assert staging.allocations == 2 and snap["w"].is_pinned() and torch.equal(snap["w"], state["w"].cpu())
