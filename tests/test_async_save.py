"""AsyncSaver: the file holds the state as it was at save(), failures reach every rank within one step,
warm-up fails early everywhere, nothing leaks or is lost at exit."""

from __future__ import annotations

import concurrent.futures
import gc
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import ranksafe
from ranksafe.async_save import AsyncSaver
from ranksafe.checkpoint_file import atomic_save, load_file
from ranksafe.lock import StateDictLock
from tests.ranks import run_ranks


def _state(n=200, size=64):
    torch.manual_seed(0)
    return {"model": {f"w{i}": torch.randn(size) for i in range(n)}, "step": 7, "opt": {"lr": [0.1]}}


def _mutate(state):
    for t in state["model"].values():
        t.add_(1000)
    state["step"] = 8
    state["opt"]["lr"][0] = 99.0


def _count_pre_mutation(path, reference):
    back = load_file(path)
    return sum(torch.equal(back["model"][k], v) for k, v in reference["model"].items()), back


def _gated_writer(gate: threading.Event, path: str):
    def write(obj):
        assert gate.wait(10)
        return atomic_save(obj, path)

    return write


def test_file_holds_the_state_at_save_time_and_a_write_without_snapshot_does_not(tmp_path):
    state = _state()
    reference = {"model": {k: v.clone() for k, v in state["model"].items()}}
    n = len(state["model"])

    # control: the naive pattern (hand the live state to a writer thread) writes what the state became
    gate, naive = threading.Event(), str(tmp_path / "naive.pt")
    t = threading.Thread(target=_gated_writer(gate, naive), args=(state,))
    t.start()
    _mutate(state)
    gate.set()
    t.join(10)
    same, back = _count_pre_mutation(naive, reference)
    assert same == 0 and back["step"] == 8, "the control should have caught the race"

    # ours, with the write held back until after the mutation: the snapshot still has the old values
    state = _state()
    saver, gate, path = AsyncSaver(), threading.Event(), str(tmp_path / "ours.pt")
    assert saver.submit(state, _gated_writer(gate, path))
    _mutate(state)
    gate.set()
    saver.close()
    same, back = _count_pre_mutation(path, reference)
    assert same == n and back["step"] == 7 and back["opt"] == {"lr": [0.1]}

    # and through save() with no gate, mutating at once
    state = _state()
    path = str(tmp_path / "sub" / "plain.pt")  # parent created by the background writer
    assert saver.save(state, path)
    _mutate(state)
    saver.close()
    same, back = _count_pre_mutation(path, reference)
    assert same == n and back["step"] == 7


def _step(state, lock, half_done: threading.Event, go_on: threading.Event):
    """An optimizer step that updates half the tensors, pauses, then updates the rest."""
    names = list(state["model"])
    with lock.write() if lock else _nothing():
        for k in names[: len(names) // 2]:
            state["model"][k].add_(1)
        half_done.set()
        assert go_on.wait(10)
        for k in names[len(names) // 2 :]:
            state["model"][k].add_(1)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _save_during_step(tmp_path, name, lock):
    state = _state(n=20)
    before = {k: v.clone() for k, v in state["model"].items()}
    saver = AsyncSaver(lock=lock)
    half_done, go_on = threading.Event(), threading.Event()
    stepper = threading.Thread(target=_step, args=(state, lock, half_done, go_on))
    stepper.start()
    assert half_done.wait(10)
    path = str(tmp_path / f"{name}.pt")
    saving = threading.Thread(target=saver.save, args=(state, path))
    saving.start()
    saving.join(0.5)
    blocked = saving.is_alive()  # still waiting for the step's write side?
    go_on.set()
    stepper.join(10)
    saving.join(10)
    saver.close()
    back = load_file(path)["model"]
    updated = sum(torch.equal(back[k], before[k] + 1) for k in before)
    return blocked, updated, len(before)


def test_a_snapshot_during_a_step_waits_for_the_step(tmp_path):
    blocked, updated, n = _save_during_step(tmp_path, "nolock", None)  # control: half-updated weights
    assert not blocked and 0 < updated < n
    blocked, updated, n = _save_during_step(tmp_path, "locked", StateDictLock())
    assert blocked and updated == n


def test_policies_wait_or_skip_when_a_save_is_in_flight(tmp_path):
    state = _state(n=4)
    gate = threading.Event()
    skip = AsyncSaver(policy="skip")
    assert skip.submit(state, _gated_writer(gate, str(tmp_path / "a.pt")))
    assert skip.save(state, tmp_path / "b.pt") is False  # dropped, returned at once
    gate.set()
    skip.close()
    assert os.path.exists(tmp_path / "a.pt") and not os.path.exists(tmp_path / "b.pt")

    gate = threading.Event()
    wait = AsyncSaver(policy="wait")
    assert wait.submit(state, _gated_writer(gate, str(tmp_path / "c.pt")))
    second = threading.Thread(target=wait.save, args=(state, tmp_path / "d.pt"))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # waits for the first write
    gate.set()
    second.join(10)
    wait.close()
    assert os.path.exists(tmp_path / "c.pt") and os.path.exists(tmp_path / "d.pt")
    with pytest.raises(ValueError):
        AsyncSaver(policy="later")


def test_on_commit_runs_after_the_commit_so_retention_never_removes_the_last_checkpoint(tmp_path):
    seen = []

    def retain(path):  # keep one: delete older files only once the new one is committed
        seen.append((path, os.path.exists(path), sorted(os.listdir(tmp_path))))
        for name in os.listdir(tmp_path):
            if os.path.join(tmp_path, name) != path:
                os.unlink(tmp_path / name)

    saver = AsyncSaver(on_commit=retain)
    for step in range(3):
        saver.save(_state(n=4), str(tmp_path / f"{step}.pt"))
        saver.wait()
    saver.close()
    assert [s[1] for s in seen] == [True, True, True]
    assert seen[1][2] == ["0.pt", "1.pt"] and seen[2][2] == ["1.pt", "2.pt"]  # the previous one was still there
    assert os.listdir(tmp_path) == ["2.pt"]


def test_a_relative_path_is_where_it_was_at_the_call_not_at_the_write(tmp_path, monkeypatch):
    """The write runs later, on another thread: a relative path resolved there followed a chdir made meanwhile
    (the file landed in the new directory, and on_commit got "m.pt"). torch.save resolves it at the call."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    gate, committed = threading.Event(), []
    saver = AsyncSaver(on_commit=committed.append)
    saver.submit(None, lambda _: gate.wait(10))  # a write in flight: the next save's write comes after the chdir
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        queued = pool.submit(saver.save, _state(n=4), "m.pt")
        time.sleep(0.2)
        os.chdir(tmp_path / "b")
        gate.set()
        assert queued.result(timeout=10) is True
    saver.close()
    assert (os.listdir(tmp_path / "a"), os.listdir(tmp_path / "b")) == (["m.pt"], [])
    assert committed[-1] == str(tmp_path / "a" / "m.pt")


def _failing_writer(gate: threading.Event):
    def write(obj):
        assert gate.wait(10)
        raise OSError(28, "No space left on device (injected)")

    return write


def test_an_action_added_while_the_writer_runs_earlier_ones_queues_behind_them(tmp_path):
    """Two links of ``last.ckpt`` once raced here: the write had committed, so a second action ran at once on the
    training thread while the writer thread still ran the first. Actions run one after another, in order."""
    saver, gate, started, release, ran = AsyncSaver(), threading.Event(), threading.Event(), threading.Event(), []

    def first():
        ran.append(("first starts", threading.current_thread().name))
        started.set()
        release.wait(10)
        ran.append(("first ends", threading.current_thread().name))

    assert saver.submit(_state(n=2), _gated_writer(gate, str(tmp_path / "m.pt")))
    assert saver.after_commit(first)  # queued: the write waits at the gate
    gate.set()
    assert started.wait(10)  # the write committed; the writer thread is inside the first action
    assert saver.after_commit(lambda: ran.append(("second", threading.current_thread().name)))
    release.set()
    saver.wait()
    assert [what for what, _ in ran] == ["first starts", "first ends", "second"], ran
    assert {thread for _, thread in ran} != {"MainThread"}
    saver.close()


def test_after_commit_waits_for_the_write_in_flight_and_is_dropped_when_it_fails(tmp_path):
    """Removing the previous checkpoint right after submitting the next one (the naive order) leaves no checkpoint
    when the write fails; ``after_commit`` removes it only once the new one is committed, and never after a failure."""
    spare, old, new, newer = (str(tmp_path / f"{name}.pt") for name in ("spare", "old", "new", "newer"))
    atomic_save({"step": 1}, old)

    # control: the removal runs at submit time; the write fails, and no checkpoint is left
    naive, gate = AsyncSaver(), threading.Event()
    naive.submit(_state(n=2), _failing_writer(gate))
    os.unlink(old)
    gate.set()
    naive.wait()
    assert naive.failed and os.listdir(tmp_path) == []
    naive.take_error()

    saver, gate, ran = AsyncSaver(), threading.Event(), []

    def removing(path):  # records where it runs and what is on disk then, and removes ``path``
        def remove():
            ran.append((os.path.basename(path), threading.current_thread().name, sorted(os.listdir(tmp_path))))
            os.unlink(path)

        return remove

    atomic_save({"step": 0}, spare)
    assert saver.after_commit(removing(spare)) and ran == [("spare.pt", "MainThread", ["spare.pt"])]  # no write yet
    atomic_save({"step": 1}, old)
    assert saver.submit(_state(n=2), _gated_writer(gate, new))
    assert saver.after_commit(removing(old))  # queued
    assert len(ran) == 1 and os.listdir(tmp_path) == ["old.pt"]
    gate.set()
    saver.wait()
    assert ran[1] == ("old.pt", "ranksafe-async-save", ["new.pt", "old.pt"])  # on the writer thread, after the commit
    assert os.listdir(tmp_path) == ["new.pt"]

    gate.clear()
    saver.submit(_state(n=2), _failing_writer(gate))
    assert saver.after_commit(removing(new))  # queued, then dropped with the write
    gate.set()
    saver.wait()
    assert saver.after_commit(removing(new)) is False  # the latest write failed: dropped at once
    assert len(ran) == 2 and os.listdir(tmp_path) == ["new.pt"]  # one checkpoint left, where the control had none
    with pytest.raises(OSError, match="injected"):
        saver.check()
    assert saver.after_commit(removing(new)) is False  # reported, but still the latest write

    saver.save(_state(n=2), newer)
    saver.wait()
    assert saver.after_commit(removing(new)) and ran[2][:2] == ("new.pt", "MainThread")  # committed: at once
    freed = torch.zeros(4)
    freed.untyped_storage().resize_(0)  # the snapshot itself fails: nothing is handed to the writer thread
    assert saver.save({"w": freed}, str(tmp_path / "freed.pt")) is False and saver.failed
    assert saver.after_commit(removing(newer)) is False and os.listdir(tmp_path) == ["newer.pt"]
    saver.take_error()
    saver.shutdown()


def test_calls_that_wait_for_the_write_refuse_to_run_inside_it_instead_of_hanging(tmp_path):
    refused = {}
    saver = AsyncSaver()

    def on_commit(path):  # runs on the writer thread, inside the write these calls would wait for
        for name, call in [
            ("wait", saver.wait),
            ("save", lambda: saver.save(_state(n=2), str(tmp_path / "again.pt"))),
            ("shutdown", saver.shutdown),
            ("close", saver.close),
        ]:
            try:
                call()
            except RuntimeError as e:
                refused[name] = "own writer thread" in str(e)

    saver.save(_state(n=2), str(tmp_path / "a.pt"), on_commit=on_commit)
    assert saver.wait(20), "the write waited for itself"
    assert refused == {"wait": True, "save": True, "shutdown": True, "close": True}
    assert not saver.failed and os.listdir(tmp_path) == ["a.pt"]
    saver.close()


def test_single_process_failure_is_flagged_then_raised_once_as_the_original_error(tmp_path):
    (tmp_path / "file").write_text("x")
    saver = AsyncSaver()
    assert saver.save(_state(n=2), tmp_path / "file" / "ckpt.pt")  # a file where a directory must go
    saver.wait()
    assert saver.failed
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        saver.check()
    assert not saver.failed
    saver.check()  # reported once


def _background_failure(rank, root, steps):
    """A training loop that checks the saver every step; rank 0 writes into a path that cannot exist."""
    saver = AsyncSaver()
    local_flag_seen, failed_at = None, None
    for step in range(steps):
        time.sleep(0.05)  # the step's work
        if step == 2:
            saver.save({"w": torch.randn(1000)}, os.path.join(root, "file", "ckpt.pt"))
        if saver.failed and local_flag_seen is None:
            local_flag_seen = step
        try:
            saver.check()
        except ranksafe.RankFailure as e:
            failed_at = step
            err = {"ranks": e.ranks, "os": isinstance(e, OSError), "msg": str(e)}
            break
    else:
        err = None
    saver.close()
    return {"failed_at": failed_at, "local_flag_seen": local_flag_seen, "err": err}


def test_a_background_failure_is_raised_on_every_rank_within_one_step(tmp_path):
    (tmp_path / "file").write_text("a file where the checkpoint directory must go")
    values = run_ranks(_background_failure, 2, args=(str(tmp_path), 40), timeout=60).values
    at = {v["failed_at"] for v in values}
    assert len(at) == 1 and None not in at, values  # same step on every rank
    step = at.pop()
    assert 2 <= step <= 30
    # rank 0 saw its own failure locally at most one step before everyone raised it
    assert values[0]["local_flag_seen"] is None or values[0]["local_flag_seen"] >= step - 1
    # control: rank 1 never learns of it by itself; only the agreed check brought it the error
    assert values[1]["local_flag_seen"] is None
    for v in values:
        assert v["err"]["ranks"] == [0] and v["err"]["os"], v["err"]
        assert "cannot save" in v["err"]["msg"] and "ckpt.pt (rank 0)" in v["err"]["msg"]  # names the target


def _warmup(rank, root):
    saver = AsyncSaver()
    start = time.monotonic()
    try:
        saver.warmup({"w": torch.randn(100)}, os.path.join(root, "file", "ckpts"))
    except ranksafe.RankFailure as e:
        return {"ranks": e.ranks, "os": isinstance(e, OSError), "s": time.monotonic() - start, "msg": str(e)}
    return "no error"


def test_warmup_fails_on_every_rank_when_the_directory_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("x")
    values = run_ranks(_warmup, 2, args=(str(tmp_path),)).values
    for v in values:
        assert v != "no error"
        assert v["ranks"] == [0] and v["os"] and v["s"] < 10 and "cannot write checkpoints" in v["msg"]


def test_warmup_allocates_the_buffers_and_leaves_no_file(tmp_path):
    saver = AsyncSaver()
    state = _state(n=10)
    saver.warmup(state, tmp_path / "ckpts")
    assert saver.staging.allocations == 1 and saver.staging.nbytes == 10 * 64 * 4
    assert os.listdir(tmp_path / "ckpts") == []
    saver.save(state, tmp_path / "ckpts" / "a.pt")
    saver.close()
    assert saver.staging.allocations == 1  # the first save reused the warm-up's buffers


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _ranksafe_threads() -> set[tuple[str, int]]:
    return {(t.name, t.ident) for t in threading.enumerate() if t.name.startswith("ranksafe")}


def _settle_parked_threads() -> None:
    """Earlier tests' savers that were never closed stop their threads once collected: wait for that."""
    gc.collect()
    deadline = time.monotonic() + 5
    while _ranksafe_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _ranksafe_threads() == set(), "a saver that nobody refers to still has threads"


def test_twenty_saves_grow_neither_memory_nor_threads(tmp_path):
    state = {"model": {f"w{i}": torch.randn(256, 256) for i in range(64)}}  # 16 MiB
    saver = AsyncSaver()
    state["model"]["w0"].add_(0)  # torch starts its intra-op thread pool at the first parallel op: not ours
    _settle_parked_threads()
    threads_before, os_threads_before = threading.active_count(), len(os.listdir("/proc/self/task"))
    saver.save(state, tmp_path / "0.pt")
    saver.wait()
    rss = _rss()
    parked = _ranksafe_threads()  # the writer: started once, parked between saves
    assert [name for name, _ in parked] == ["ranksafe-async-save"]
    for i in range(1, 21):
        saver.save(state, tmp_path / f"{i % 2}.pt")
        assert _ranksafe_threads() == parked  # the same threads every time, none started per save
        state["model"]["w0"].add_(1)
    saver.close()
    growth = _rss() - rss
    assert saver.staging.allocations == 1
    assert growth < 4 << 20, f"resident memory grew by {growth / 2**20:.1f} MiB over 20 saves"
    # close() stops them: no thread is left, neither in threading's list nor among the OS threads
    assert _ranksafe_threads() == set() and threading.active_count() == threads_before
    # and among the OS threads (a joined thread's OS thread may still be exiting for a moment)
    deadline = time.monotonic() + 5
    while len(os.listdir("/proc/self/task")) != os_threads_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(os.listdir("/proc/self/task")) == os_threads_before
    saver.save(state, tmp_path / "again.pt")  # still usable: the threads start again
    saver.close()
    assert torch.equal(torch.load(tmp_path / "again.pt")["model"]["w0"], state["model"]["w0"])
    assert _ranksafe_threads() == set()


def test_a_saver_nobody_refers_to_stops_its_thread(tmp_path):
    _settle_parked_threads()
    saver = AsyncSaver()
    saver.save({"w": torch.ones(3)}, tmp_path / "w.pt")
    saver.wait()
    assert [name for name, _ in _ranksafe_threads()] == ["ranksafe-async-save"]
    del saver  # never closed: collecting it stops the thread (the thread itself does not keep it alive)
    _settle_parked_threads()


_EXIT_SCRIPT = """
import sys, time, torch
from ranksafe.async_save import AsyncSaver
from ranksafe.checkpoint_file import atomic_save

def slow(obj):
    time.sleep(1.0)
    return atomic_save(obj, sys.argv[1])

AsyncSaver().submit({"w": torch.arange(10.0)}, slow)
print("exiting", flush=True)
"""


def test_interpreter_exit_waits_for_the_write_in_flight(tmp_path):
    path = tmp_path / "last.pt"
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(path)], capture_output=True, text=True, timeout=60, cwd=os.getcwd()
    )
    assert out.returncode == 0, out.stderr
    assert "exiting" in out.stdout
    assert torch.equal(load_file(path)["w"], torch.arange(10.0))


def _two_savers(rank):
    from ranksafe import exchange as protocol
    from ranksafe.saver_failures import check_savers

    a, b = AsyncSaver(writer="all"), AsyncSaver(writer="all")
    check_savers([a, b], "two")  # warms up the session
    before = protocol._session.seq
    check_savers([a, b], "two")
    quiet = protocol._session.seq - before

    def fail(snapshot):
        raise OSError(28, "No space left on device (second saver)")

    if rank == 0:
        b.submit({"w": torch.zeros(4)}, fail)
        b.wait()
    try:
        check_savers([a, b], "two")
    except ranksafe.RankFailure as e:
        return {"quiet": quiet, "ranks": e.ranks, "os": isinstance(e, OSError), "msg": str(e)}
    return {"quiet": quiet, "ranks": None}


def test_check_savers_costs_one_exchange_and_reports_any_saver():
    for v in run_ranks(_two_savers, 2).values:
        assert v["quiet"] == 1
        assert v["ranks"] == [0] and v["os"] and "second saver" in v["msg"]


def _async_paths(rank, base):
    from ranksafe import topology

    topology.hostname = lambda: "node0" if rank < 2 else "node1"  # ranks 0, 1 on one host, rank 2 on another
    out = {}
    cases = {  # what each rank passes to save; a per-rank name with one writer is the slip
        "main, path per rank": ("main", f"preds_{rank}.pt"),
        "main, one path": ("main", "preds.pt"),
        "main, rank 0 alone": ("main", "alone.pt" if rank == 0 else None),
        "local, path per node": ("local", f"node{1 if rank == 2 else 0}.pt"),
        "local, path per rank": ("local", f"local_{rank}.pt"),
    }
    for case, (writer, name) in cases.items():
        saver = AsyncSaver(writer=writer)
        saver.warmup({"w": torch.zeros(4)}, base)  # learns the nodes on every rank, as its docstring asks
        if name is not None:
            saver.save({"w": torch.zeros(4)}, os.path.join(base, name))
        for call in ("check", "close"):
            try:
                getattr(saver, call)()
                out[case, call] = "ok"
            except ValueError as e:
                out[case, call] = str(e)
    return out


def test_a_rank_that_saved_where_its_writer_did_not_gets_an_error_at_the_check_on_every_rank(tmp_path):
    """save() on a rank that is not a writer returns False and writes nothing: a per-rank path there was a file that
    would never exist, and no call said so. The next check() raises on every rank instead, once (close() after it is
    clean)."""
    values = run_ranks(_async_paths, 3, args=(str(tmp_path),), timeout=90).values
    for rank, out in enumerate(values):
        for case in ("main, one path", "main, rank 0 alone", "local, path per node"):
            assert out[case, "check"] == out[case, "close"] == "ok", (rank, case, out[case, "check"])
        for case, apart in (("main, path per rank", "preds_1.pt"), ("local, path per rank", "local_1.pt")):
            message = out[case, "check"]
            assert "saved to paths their writer did not" in message and apart in message, (rank, case, message)
            assert out[case, "close"] == "ok", (rank, case)  # reported once
        assert "preds_2.pt" in out["main, path per rank", "check"]  # rank 2 too, on the other node
        assert "local_2.pt" not in out["local, path per rank", "check"]  # rank 2 is node 1's writer
    written = ["alone.pt", "local_0.pt", "local_2.pt", "node0.pt", "node1.pt", "preds.pt", "preds_0.pt"]
    assert sorted(os.listdir(tmp_path)) == written


def _script(code: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, bounded: a regression that hangs fails here instead of hanging CI."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


_SIGNAL_SAVE = """
import faulthandler, os, signal, sys, threading, time, torch
from ranksafe.async_save import AsyncSaver
from ranksafe.checkpoint_file import atomic_save, load_file
faulthandler.dump_traceback_later(30, exit=True)  # a hang prints where, and fails the test
d, order = sys.argv[1] if len(sys.argv) > 1 else {tmp!r}, []
saver = AsyncSaver(policy="wait", on_commit=lambda path: order.append(os.path.basename(path)))
state = {{"w": torch.zeros(1000)}}

def slow(path):
    def write(obj):
        time.sleep(1.0)
        return atomic_save(obj, path)
    return write

def on_usr1(signum, frame):  # Lightning's SLURM requeue handler saves a checkpoint from the handler
    assert saver.submit(state, slow(os.path.join(d, "emergency.pt")))
    assert os.path.exists(os.path.join(d, "emergency.pt"))  # written before the handler returns

signal.signal(signal.SIGUSR1, on_usr1)
threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
saver.submit(state, slow(os.path.join(d, "first.pt")))
state["w"] += 1  # what the handler saves: the state when the signal came
saver.submit(state, slow(os.path.join(d, "second.pt")))  # waits for the first write: the signal lands here
saver.close()
print("ORDER", order)
print("VALUES", [float(load_file(os.path.join(d, n))["w"][0]) for n in order])
"""


def test_a_save_from_a_signal_handler_inside_save_writes_at_once_instead_of_deadlocking(tmp_path):
    out = _script(_SIGNAL_SAVE.format(tmp=str(tmp_path)))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    # the handler's write waited for the write in flight (older state must not commit over it), ran on the
    # spot, then the interrupted save went on
    assert "ORDER ['first.pt', 'emergency.pt', 'second.pt']" in out.stdout, out.stdout
    assert "VALUES [0.0, 1.0, 1.0]" in out.stdout, out.stdout


_SIGNAL_SAVE_WHILE_ANOTHER_THREAD_SNAPSHOTS = """
import faulthandler, os, signal, sys, threading, time, traceback, torch
from ranksafe.async_save import AsyncSaver
from ranksafe.checkpoint_file import load_file
from ranksafe.lock import StateDictLock
faulthandler.dump_traceback_later(30, exit=True)  # a hang prints where, and fails the test
d, lock = sys.argv[1], StateDictLock()
saver, state = AsyncSaver(lock=lock), {"w": torch.zeros(1000)}
main, reading, handled, events = threading.main_thread().ident, threading.Event(), threading.Event(), []


def another_snapshot():  # holds the read side until the handler is done: the main thread's step waits for it
    with lock.read():
        reading.set()
        handled.wait(10)
    events.append("the read ends")


def another_save():  # holds the saver while its snapshot queues behind the main thread's waiting step
    saver.save(state, os.path.join(d, "thread.pt"))
    events.append("the thread's snapshot")


saving = threading.Thread(target=another_save)


def signal_once_both_wait():
    while main not in lock._writers_waiting:
        time.sleep(0.01)
    saving.start()
    while "acquire_read" not in "".join(traceback.format_stack(sys._current_frames()[saving.ident])):
        time.sleep(0.01)
    signal.pthread_kill(main, signal.SIGUSR1)


def on_usr1(signum, frame):  # Lightning's SLURM requeue handler saves a checkpoint from the handler
    saver.save(state, os.path.join(d, "handler.pt"))
    events.append("the handler's save")
    handled.set()


signal.signal(signal.SIGUSR1, on_usr1)
threading.Thread(target=another_snapshot).start()
reading.wait(5)
threading.Thread(target=signal_once_both_wait).start()
with lock.write():  # the optimizer step, waiting for the other snapshot when the signal comes
    state["w"] += 1
    events.append("the step")
saving.join(10)
saver.close()
print("EVENTS", events)
print("VALUES", [float(load_file(os.path.join(d, n))["w"][0]) for n in ("handler.pt", "thread.pt")])
"""


def test_a_signal_handler_saves_while_another_threads_snapshot_queues_behind_its_step(tmp_path):
    """Before: the handler waited for the saver, which another thread held while its snapshot queued behind the
    step the handler interrupted: a hang (here faulthandler ends it after 30 s). Now the handler's save is written
    at once from the live state, before the step; the other thread's snapshot follows the step."""
    out = subprocess.run(
        [sys.executable, "-c", _SIGNAL_SAVE_WHILE_ANOTHER_THREAD_SNAPSHOTS, str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    events = ["the handler's save", "the read ends", "the step", "the thread's snapshot"]
    assert f"EVENTS {events}" in out.stdout, out.stdout
    assert "VALUES [0.0, 1.0]" in out.stdout, out.stdout


def _collective_in_signal_handler(rank):
    import signal

    caught = {}
    ranksafe.barrier("start")

    def on_usr1(signum, frame):
        ranksafe.barrier("inside the handler", timeout=5)

    if rank == 0:
        signal.signal(signal.SIGUSR1, on_usr1)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
    else:
        time.sleep(2)  # rank 0 waits in the barrier below when its signal comes
    start = time.monotonic()
    try:
        ranksafe.barrier("the step's barrier", timeout=8)
    except Exception as e:
        caught = {"type": type(e).__name__, "msg": str(e)}
    return caught, time.monotonic() - start


def test_a_collective_from_a_signal_handler_inside_a_collective_raises_instead_of_deadlocking():
    res = run_ranks(_collective_in_signal_handler, 2, timeout=60)
    (caught0, _), (caught1, seconds1) = res.values
    assert caught0["type"] == "RuntimeError" and "signal handler" in caught0["msg"], caught0
    assert 'inside collective "barrier:the step\'s barrier"' in caught0["msg"], caught0
    assert caught1 and seconds1 < 30  # rank 0 left the barrier: rank 1 is told (timeout or lost store), not stuck


def test_shutdown_from_another_thread_never_strands_a_save(tmp_path):
    state = {"w": torch.ones(4)}
    saver = AsyncSaver()
    assert saver.save(state, tmp_path / "warm.pt") and saver.wait(5)
    writer = saver._worker._slot.thread
    join, stopping = writer.join, threading.Event()

    def slow_join(*args):  # widen the window in which a save from another thread used to slip in
        stopping.set()
        time.sleep(0.3)
        join(*args)

    writer.join = slow_join
    stopper = threading.Thread(target=saver.shutdown)
    stopper.start()
    assert stopping.wait(5)
    saver.save(state, tmp_path / "x.pt")  # while the writer thread is being stopped
    stopper.join()
    assert saver.wait(5), "the save was queued behind the thread's stop and never ran"
    saver.close()
    assert load_file(tmp_path / "x.pt")["w"].sum() == 4


def test_a_writer_thread_that_cannot_start_leaves_nothing_in_flight(tmp_path, monkeypatch):
    saver = AsyncSaver()

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError, match="can't create new thread"):
            saver.save(_state(n=2), tmp_path / "a.pt")
    assert not saver.in_flight and saver.wait(timeout=1)  # was: in flight for ever, close() hung
    assert saver.save(_state(n=2), tmp_path / "b.pt")
    saver.close()
    assert os.path.exists(tmp_path / "b.pt")


def _own_failure_while_another_rank_is_gone(rank, root):
    saver = AsyncSaver(writer="all")
    ranksafe.barrier("warm")
    if rank == 1:
        return None  # ends: its exit hook says it is gone
    blocker = os.path.join(root, "blocker")
    open(blocker, "w").close()
    saver.save({"w": torch.ones(2)}, os.path.join(blocker, "x.pt"))  # a file where a directory must go
    saver.wait()
    with pytest.raises(ranksafe.RankFailure) as raised:
        saver.check()  # decided on rank 1's exit
    own = saver.take_error()
    return [(f.rank, f.type_name) for f in raised.value.failures], own


def test_a_background_failure_checked_while_another_rank_is_gone_is_reported(tmp_path):
    """Before: when the check's exchange was decided on another rank's exit, this rank's own write failure was
    dropped: no later check reported it, and the exit hook had nothing to print. Then it was kept for a later check.
    Now the verdict given up on rank 1 names it beside rank 1's exit, and nothing is left pending."""
    values = run_ranks(_own_failure_while_another_rank_is_gone, 2, args=(str(tmp_path),), timeout=60).values
    assert values[0] == ([(0, "builtins.NotADirectoryError"), (1, "ranksafe.Exited")], None), values


_INTERRUPTED = """
import faulthandler, os, queue, sys, threading, time, torch
sys.path.insert(0, {root!r})
from ranksafe.async_save import AsyncSaver
from ranksafe.checkpoint_file import load_file
from tests.interrupts import interrupt_each_point
faulthandler.dump_traceback_later(60, exit=True)  # a hang prints where, and fails the test
d = {tmp!r}


class NaiveSaver:  # the usual hand-off: mark the saver busy, then give the job to the writer thread
    def __init__(self):
        self.idle, self.jobs = threading.Event(), queue.SimpleQueue()
        self.idle.set()
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            self.jobs.get()()
            self.idle.set()

    def save(self, state, path):
        self.idle.wait()
        snapshot = {{k: v.clone() for k, v in state.items()}}
        self.idle.clear()
        self.hand(lambda: torch.save(snapshot, path))

    def hand(self, job):
        self.jobs.put(job)

    @property
    def in_flight(self):
        return not self.idle.is_set()


for make in (NaiveSaver, AsyncSaver):
    saver, state, counts = make(), {{"w": torch.zeros(4), "b": torch.zeros(2)}}, {{"hung": 0, "wrong": 0}}
    saver.save(state, os.path.join(d, "warm.pt"))
    n = [0]

    def after(where):  # the interrupted save: gone, or written without anyone waiting for it; never in flight for ever
        global saver
        n[0] += 1
        deadline = time.monotonic() + 5
        while saver.in_flight and time.monotonic() < deadline:  # not wait(): the write must start by itself
            time.sleep(0.002)
        if saver.in_flight:
            counts["hung"] += 1
            print(make.__name__, "hung after an interrupt at", where, flush=True)
            saver = make()  # the stuck one is left behind: the next point gets a saver of its own
            return
        state["w"].fill_(n[0])  # and the next save holds the values it was given
        saver.save(state, os.path.join(d, "after.pt"))
        while saver.in_flight:
            time.sleep(0.002)
        counts["wrong"] += float(load_file(os.path.join(d, "after.pt"))["w"][0]) != n[0]

    points = interrupt_each_point(
        lambda: saver.save(state, os.path.join(d, "cut.pt")), ("/ranksafe/", "<string>"), after
    )
    print(make.__name__, "points", points, "hung", counts["hung"], "wrong", counts["wrong"], flush=True)
os._exit(0)
"""


def test_ctrl_c_anywhere_in_a_save_leaves_no_write_in_flight_for_ever(tmp_path):
    """A signal handler that raises (Ctrl-C) at any point of :meth:`AsyncSaver.save` where Python runs one: the
    save is then written or dropped, never left "in flight" with no write coming (every later save, and the exit,
    would wait for it for ever). Control: the usual hand-off (mark busy, then queue the job) hangs at one point."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = _script(_INTERRUPTED.format(root=root, tmp=str(tmp_path)))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    naive, ours = (line.split() for line in out.stdout.splitlines() if " points " in line)
    assert naive[0] == "NaiveSaver" and int(naive[2]) >= 3 and int(naive[4]) >= 1, out.stdout
    assert ours[0] == "AsyncSaver" and int(ours[2]) >= 50, out.stdout  # every point of the hand-off, and more
    assert ours[4:] == ["0", "wrong", "0"], out.stdout


_SHUTDOWN_WHILE_SAVING = """
import os, sys, threading, torch
from ranksafe.async_save import AsyncSaver
sys.setswitchinterval(1e-5)  # threads change often: the saves land at every point of shutdown()
saver, stop = AsyncSaver(), threading.Event()

def keep_saving():
    while not stop.is_set():
        saver.save({{"w": torch.ones(2)}}, os.path.join({tmp!r}, "x.pt"))

threading.Thread(target=keep_saving, daemon=True).start()
for i in range(5000):
    saver.shutdown()
    if not saver.wait(2):
        print("STRANDED at shutdown", i, flush=True)
        os._exit(1)
stop.set()
print("NONE STRANDED", flush=True)
os._exit(0)
"""


def test_a_save_from_another_thread_during_shutdown_is_written_not_stranded(tmp_path):
    """Save and shutdown() are local calls, for any thread at any time. A write handed between shutdown()'s wait for
    the write in flight and its stop of the thread found no thread to run it, and stayed in flight for ever."""
    out = _script(_SHUTDOWN_WHILE_SAVING.format(tmp=str(tmp_path)), timeout=120)
    assert out.returncode == 0 and "NONE STRANDED" in out.stdout, out.stdout + out.stderr[-3000:]


_REAP_THE_CHILD = """
for _ in range(200):  # the forked child: its exit, or "stuck" after 10 s
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("CHILD EXITED", status, flush=True)
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    print("CHILD STUCK", flush=True)
saver.close()
"""


_FORK_WHILE_THE_WRITER_HOLDS_ITS_LOCK = """
import os, sys, threading, time, torch
from ranksafe.async_save import AsyncSaver
saver = AsyncSaver()
saver.save({{"w": torch.zeros(3)}}, os.path.join({tmp!r}, "parent.pt"))
saver.wait()
held, release = threading.Event(), threading.Event()

def hold():  # what the writer thread does for a moment each time it takes or ends a job
    with saver._worker._slot.lock:
        held.set()
        release.wait(30)

threading.Thread(target=hold, daemon=True).start()
held.wait(10)
pid = os.fork()
if pid == 0:  # a DataLoader worker, say: it starts, and saves with threads of its own
    saver.save({{"w": torch.ones(3)}}, os.path.join({tmp!r}, "child.pt"))
    saver.close()
    os._exit(0)
release.set()
"""


def test_a_fork_while_the_writer_holds_its_lock_gives_a_child_that_saves(tmp_path):
    """Before: the child's at-fork hook dropped the parent's writer, whose finalizer took the writer's lock, held by
    a thread that does not exist in the child: the child hung inside os.fork()."""
    out = _script(_FORK_WHILE_THE_WRITER_HOLDS_ITS_LOCK.format(tmp=str(tmp_path)) + _REAP_THE_CHILD, timeout=60)
    assert out.returncode == 0 and "CHILD EXITED 0" in out.stdout, out.stdout + out.stderr[-3000:]
    assert load_file(tmp_path / "child.pt")["w"].sum() == 3


_FORK_WHILE_THE_WRITER_PICKLES = """
import os, time, torch
from ranksafe.async_save import AsyncSaver
from ranksafe.checkpoint_file import atomic_save, load_file


class SlowToPickle:  # a large non-tensor part of a state: the background write pickles it for a while
    def __deepcopy__(self, memo):
        return SlowToPickle()

    def __reduce__(self):
        time.sleep(2)
        return (SlowToPickle, ())


saver = AsyncSaver()
saver.save({{"w": torch.zeros(3), "extra": SlowToPickle()}}, os.path.join({tmp!r}, "parent.pt"))
time.sleep(0.5)  # the writer thread is pickling: it has torch's zip CRC turned off, under a lock
pid = os.fork()
if pid == 0:
    crc = torch.serialization.get_crc32_options()  # the parent's setting, not the writer's passing one
    atomic_save({{"w": torch.ones(2)}}, os.path.join({tmp!r}, "child.pt"))
    os._exit(0 if crc else 3)
"""


def test_a_fork_while_the_writer_pickles_gives_a_child_that_saves(tmp_path):
    """Before: the child inherited the lock a save holds while torch's zip CRC is off (the writer thread held it, and
    does not exist there): every ranksafe save in the child waited for ever."""
    out = _script(_FORK_WHILE_THE_WRITER_PICKLES.format(tmp=str(tmp_path)) + _REAP_THE_CHILD, timeout=60)
    assert out.returncode == 0 and "CHILD EXITED 0" in out.stdout, out.stdout + out.stderr[-3000:]
    assert load_file(tmp_path / "child.pt")["w"].sum() == 2 and os.path.exists(tmp_path / "parent.pt")


_FORK = """
import os, sys, torch
from ranksafe.async_save import AsyncSaver
from ranksafe.checkpoint_file import load_file
d = {tmp!r}
saver = AsyncSaver()
state = {{"w": torch.zeros(1000)}}  # small: a forked child hangs in any OpenMP region torch opens (not ours)
assert saver.save(state, os.path.join(d, "parent.pt")) and saver.wait(10)
staged = saver.staging.buffers[0]  # the parent's staged copy of "w"
pid = os.fork()
if pid == 0:  # the child saves with the saver it inherited: its own thread, its own buffer pages
    state["w"] += 7
    ok = saver.save(state, os.path.join(d, "child.pt")) and saver.wait(10)
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("CHILD", os.waitstatus_to_exitcode(status), float(load_file(os.path.join(d, "child.pt"))["w"][0]))
print("PARENT_STAGED", float(staged[0]))
"""


def test_a_forked_child_saves_with_its_own_thread_and_never_writes_into_the_parents_buffer(tmp_path):
    out = _script(_FORK.format(tmp=str(tmp_path)), timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "CHILD 0 7.0" in out.stdout, out.stdout  # was: the job waited for a thread that only the parent has
    assert "PARENT_STAGED 0.0" in out.stdout, out.stdout  # was: a shared mapping, the child's copy showed here


_FORK_START = """
import multiprocessing, os, time, torch
from ranksafe.async_save import AsyncSaver
from ranksafe.checkpoint_file import atomic_save

def slow(path):
    def write(obj):
        time.sleep(0.5)
        return atomic_save(obj, path)
    return write

def train(path):
    AsyncSaver().submit({{"w": torch.ones(8)}}, slow(path))  # the last checkpoint, still in flight at return

if __name__ == "__main__":
    for method in ("fork", "spawn"):
        path = os.path.join({tmp!r}, method + ".pt")
        p = multiprocessing.get_context(method).Process(target=train, args=(path,))
        p.start()
        p.join(60)
        print(method, p.exitcode, os.path.exists(path))
"""


def test_the_last_write_of_a_forked_process_is_not_lost_at_its_exit(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_FORK_START.format(tmp=str(tmp_path)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fork 0 True" in out.stdout and "spawn 0 True" in out.stdout, out.stdout  # fork: os._exit skips atexit


_DROPPED = """
import gc, torch
from ranksafe.async_save import AsyncSaver
saver = AsyncSaver()
saver.save({{"w": torch.ones(2)}}, {path!r})
saver.wait()
del saver
gc.collect()
print("dropped")
"""


def test_a_failure_of_a_saver_dropped_unchecked_is_printed_once(tmp_path):
    (tmp_path / "file").write_text("in the way")
    out = _script(_DROPPED.format(path=str(tmp_path / "file" / "ckpt.pt")))
    assert out.returncode == 0 and "dropped" in out.stdout, out.stderr
    assert out.stderr.count("a background checkpoint write failed: NotADirectoryError") == 1, out.stderr


_FORKED_AFTER_A_FAILURE = """
import multiprocessing, torch
from ranksafe.async_save import AsyncSaver
saver = AsyncSaver()
saver.save({{"w": torch.ones(2)}}, {path!r})
saver.wait()
for _ in range(2):  # DataLoader workers, say
    p = multiprocessing.get_context("fork").Process(target=print, args=("worker",))
    p.start()
    p.join()
try:
    saver.check()
except OSError as e:
    print("checked", type(e).__name__)
"""


def test_a_failure_is_reported_by_the_process_that_failed_not_again_by_its_forked_children(tmp_path):
    """Before: each forked child inherited the unreported failure and printed it at its exit (twice here), before
    the parent's check raised it."""
    (tmp_path / "file").write_text("in the way")
    out = _script(_FORKED_AFTER_A_FAILURE.format(path=str(tmp_path / "file" / "ckpt.pt")))
    assert out.returncode == 0 and "checked NotADirectoryError" in out.stdout, out.stdout + out.stderr
    assert out.stdout.count("worker") == 2 and "a background checkpoint write failed" not in out.stderr, out.stderr


_SIGNAL_IN_WARMUP = """
import faulthandler, os, signal, torch
from ranksafe.async_save import AsyncSaver
faulthandler.dump_traceback_later(30, exit=True)  # a hang prints where, and fails the test
saver = AsyncSaver()

def on_usr1(signum, frame):  # Lightning's SLURM requeue handler saves a checkpoint from the handler
    saver.save({{"w": torch.ones(4)}}, os.path.join({tmp!r}, "emergency.pt"))
    print("handler saved", os.path.exists(os.path.join({tmp!r}, "emergency.pt")))

class SignalArrives:  # the signal lands while warmup copies the state
    def __deepcopy__(self, memo):
        os.kill(os.getpid(), signal.SIGUSR1)
        return SignalArrives()

signal.signal(signal.SIGUSR1, on_usr1)
saver.warmup({{"w": torch.ones(4), "x": SignalArrives()}}, {tmp!r})
print("warmed up")
saver.close()
"""


def test_a_save_from_a_signal_handler_during_warmup_writes_at_once_instead_of_deadlocking(tmp_path):
    """Before: warmup held the saver's submit lock without saying which thread did, and the handler's save waited for
    it forever."""
    out = _script(_SIGNAL_IN_WARMUP.format(tmp=str(tmp_path)))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "handler saved True" in out.stdout and "warmed up" in out.stdout, out.stdout


def _close_against_check(rank, root):
    saver = AsyncSaver()
    if rank == 0:  # rank 0 has a failure to report
        saver.save({"w": torch.ones(2)}, os.path.join(root, "file", "ckpt.pt"))
        saver.wait()
    try:
        saver.check() if rank == 0 else saver.close()  # rank 1 stopped early; rank 0 goes on to its next step
        outcome = "passed"
    except Exception as e:
        outcome = type(e).__name__
    return outcome, saver.failed


def test_close_and_check_do_not_pair_and_a_failed_exchange_keeps_the_failure(tmp_path):
    (tmp_path / "file").write_text("in the way")
    res = run_ranks(_close_against_check, 2, args=(str(tmp_path),), timeout=60)
    (outcome0, failed0), (outcome1, _) = res.values
    assert outcome0 == outcome1 == "CollectiveMismatch"  # was: paired, and rank 0 went on into the next step
    assert failed0  # was: taken for the exchange that failed, then lost


def _paths_across_a_failed_check(rank, root):
    saver = AsyncSaver()
    saver.save({"w": torch.ones(2)}, os.path.join(root, f"preds_{rank}.pt"))  # rank 1's path: no file will be there
    saver.wait()
    outcomes = []
    for call in ("check" if rank == 0 else "close", "check"):  # the first pair mismatches: its exchange fails
        try:
            getattr(saver, call)()
            outcomes.append("passed")
        except ranksafe.CollectiveMismatch:
            outcomes.append("CollectiveMismatch")
        except ValueError as e:
            outcomes.append(str(e))
    return outcomes


def test_a_failed_check_keeps_the_paths_for_the_next_check(tmp_path):
    """The paths a saver was given travel in the check's exchange; when that exchange failed they were dropped with
    it, and the next check passed, though rank 1 still had a path where no file is."""
    values = run_ranks(_paths_across_a_failed_check, 2, args=(str(tmp_path),), timeout=60).values
    apart = f"rank 1 has {tmp_path / 'preds_1.pt'} where rank 0 has {tmp_path / 'preds_0.pt'}"
    for rank, (first, second) in enumerate(values):
        assert first == "CollectiveMismatch", (rank, first)
        assert apart in second, (rank, second)  # was: "passed"
    assert os.listdir(tmp_path) == ["preds_0.pt"]
