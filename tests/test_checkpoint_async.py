"""CheckpointManager(async_save=True) on real ranks: snapshot then background commit, retention after the
commit, background failures raised on every rank, no thread left after close().

Gated runs make the races deterministic: the writer's background commit waits until the calling thread has
done the dangerous thing (mutate the state, delete an older step), then commits.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import time
import types

import pytest
import torch

import ranksafe
from ranksafe import StateDictLock
from ranksafe import exchange as protocol
from ranksafe.checkpoint import CheckpointManager
from tests.ranks import run_ranks

_STEP = re.compile(r"^step_\d+$")


class Gated(CheckpointManager):
    """A manager whose writer-local commit waits for the ``gate`` set when its save was called (if any).

    Bound at save time: the background commit of an earlier step may start after the test set a new gate.
    """

    gate: threading.Event | None = None

    def save(self, step, state, *args, **kwargs):
        self._gates = {**getattr(self, "_gates", {}), step: self.gate}
        return super().save(step, state, *args, **kwargs)

    def _commit(self, commit, tx, writer_files):
        gate = self._gates.get(tx.step)
        if gate is not None:
            assert gate.wait(30), "gate never opened"
        return super()._commit(commit, tx, writer_files)


def _committed(root: str) -> int:
    names = os.listdir(root) if os.path.isdir(root) else []
    return sum(1 for n in names if _STEP.match(n) and os.path.isfile(os.path.join(root, n, "MANIFEST.json")))


class RenameLog:
    """Every os.rename under ``root`` in this process: the thread that made it and the committed count after.

    Steps appear (commit) and disappear (retention) only by a rename, so the minimum over this log is the
    minimum number of committed steps at any moment.
    """

    def __init__(self, root: str):
        self.root, self.events, self._orig = root, [], os.rename
        os.rename = self

    def __call__(self, src, dst, *a, **k):
        self._orig(src, dst, *a, **k)
        if os.path.dirname(os.fspath(dst)) == self.root:
            self.events.append((threading.current_thread().name, _committed(self.root)))

    def close(self):
        os.rename = self._orig


def _snapshot_then_mutate(mgr: Gated, step: int) -> float:
    """Save a state, mutate it in place before the commit may start, return the committed value."""
    state = {"w": torch.full((1000,), float(step))}
    mgr.gate = threading.Event()
    mgr.save(step, state)  # returns while the writer's commit waits for the gate: the save is asynchronous
    state["w"].add_(100.0)  # the training step that follows the save
    mgr.gate.set()
    mgr.gate = None
    return mgr.load(step)["w"][0].item()


def _live(state):
    """A capture that copies nothing: the control for the snapshot."""
    return types.SimpleNamespace(assemble=lambda: state)


def _async_manager(rank, base):
    out = {}
    root = os.path.join(base, "ckpt")

    # 1. the committed step holds the state as it was when save() returned; control: no snapshot
    mgr = Gated(root, keep=2, storage="shared", async_save=True)
    out["snapshot"] = _snapshot_then_mutate(mgr, 1)
    naive = Gated(os.path.join(base, "naive"), keep=2, storage="shared", async_save=True)
    naive._saver.staging.capture = _live  # the background thread writes the live tensors
    out["naive_snapshot"] = _snapshot_then_mutate(naive, 1)
    naive.close()

    # 2. keep=2 over several saves: retention runs after the commit, on the writer's background thread
    log = RenameLog(os.path.abspath(root))
    seqs = []
    for step in range(2, 7):
        seq = protocol._session.seq
        mgr.save(step, {"w": torch.full((1000,), float(step))})
        seqs.append(protocol._session.seq - seq)
    out["latest"] = mgr.latest()  # waits for the commit in flight
    log.close()
    out["renames"], out["exchanges"] = log.events, seqs
    out["listing"] = sorted(os.listdir(root))
    # control: deleting the step before last as soon as save() returns, as a synchronous loop would
    naive_root = os.path.join(base, "naive-retention")
    naive = Gated(naive_root, keep=None, storage="shared", async_save=True)
    naive.save(1, {"w": torch.zeros(4)})
    naive.save(2, {"w": torch.zeros(4)})
    naive.gate = threading.Event()
    naive.save(3, {"w": torch.zeros(4)})
    if rank == 0:
        shutil.rmtree(naive.step_dir(1))
        out["naive_committed"] = _committed(naive_root)  # step 3 is not committed yet
    naive.gate.set()
    naive.close()

    # 3. a background failure: a file stands where step 7's directory must go (rank 0 is the only writer)
    if rank == 0:
        for step in (7, 8):
            open(mgr.step_dir(step), "w").close()
    ranksafe.barrier("files in the way")
    mgr.save(7, {"w": torch.zeros(4)})  # returns normally on every rank: the commit has not run yet
    mgr.wait()  # local: rank 0's commit has failed now
    out["failed_flag"] = mgr._saver.failed
    out["check"] = _outcome(mgr.check)
    out["check_again"] = _outcome(mgr.check)  # reported once
    mgr.save(8, {"w": torch.zeros(4)})
    mgr.wait()
    out["next_save"] = _outcome(lambda: mgr.save(9, {"w": torch.zeros(4)}))  # the save checks first
    out["after_failures"] = mgr.latest()

    # 4. close() with a commit in flight: waits for it, then no saver thread is left
    mgr.gate = threading.Event()
    mgr.save(10, {"w": torch.zeros(4)})
    out["in_flight"] = mgr._saver.in_flight
    threading.Timer(0.3, mgr.gate.set).start()
    mgr.close()
    out["threads_left"] = [t.name for t in threading.enumerate() if t.name.startswith("ranksafe")]
    out["final"] = mgr.latest()
    return out


def _outcome(fn):
    try:
        fn()
        return None
    except Exception as e:
        return {"types": [t.__name__ for t in type(e).__mro__], "ranks": getattr(e, "ranks", None), "msg": str(e)}


def test_async_saves_snapshot_commit_in_the_background_retain_after_commit_and_share_failures(tmp_path):
    values = run_ranks(_async_manager, 2, args=(str(tmp_path),), timeout=120).values
    r0, r1 = values
    for v in values:
        # the step holds the pre-mutation values; the control's background write saw the mutation
        assert v["snapshot"] == 1.0 and v["naive_snapshot"] == 101.0
        assert v["latest"] == 6 and v["listing"] == ["step_00000005", "step_00000006"]
        assert v["exchanges"] == [3] * 5  # check + create + written; the commit itself is not a collective
        # a failed background commit raises on every rank at the next check, naming rank 0, once
        c = v["check"]
        assert c and "RankFailure" in c["types"] and "OSError" in c["types"] and c["ranks"] == [0], c
        assert v["check_again"] is None
        n = v["next_save"]
        assert n and "RankFailure" in n["types"] and n["ranks"] == [0], n
        assert v["after_failures"] == 6  # neither failed step (nor step 9) is committed anywhere
        assert v["threads_left"] == [] and v["final"] == 10, v["threads_left"]
    assert r0["in_flight"] and not r1["in_flight"]  # close() had a commit to wait for
    assert r0["failed_flag"] and not r1["failed_flag"]  # only the writer knew before the check
    # every commit and every deletion ran on the background thread, and at no moment were fewer than 2 steps
    # committed once 2 existed (commit first, then delete)
    renames = r0["renames"]
    assert {name for name, _ in renames} == {"ranksafe-async-save"}
    counts = [n for _, n in renames]
    assert counts == [2] + [3, 2] * 4, counts  # step 2 joins step 1; then each commit (3) precedes a deletion (2)
    assert r1["renames"] == []  # rank 1 writes nothing
    assert r0["naive_committed"] == 1  # control: the naive deletion left a single committed step


def _half_step(state, lock, half_done: threading.Event, go_on: threading.Event):
    """An optimizer step on another thread that updates the weights in two halves."""
    with lock:
        state["w"][:500] += 1
        half_done.set()
        go_on.wait(5)
        state["w"][500:] += 1


def _save_during_step(root, lock) -> list[float]:
    state = {"w": torch.zeros(1000)}
    mgr = CheckpointManager(root, async_save=True, lock=lock)
    half_done, go_on = threading.Event(), threading.Event()
    held = lock.write() if lock else contextlib.nullcontext()
    step = threading.Thread(target=_half_step, args=(state, held, half_done, go_on))
    step.start()
    half_done.wait(5)
    threading.Timer(0.3, go_on.set).start()  # the step finishes a little later
    mgr.save(1, state)
    step.join()
    mgr.close()
    return sorted(set(mgr.load(1)["w"].tolist()))


def test_a_lock_passed_in_makes_the_snapshot_wait_for_the_optimizer_step(tmp_path):
    assert _save_during_step(tmp_path / "locked", StateDictLock()) == [1.0]  # the whole step, never half of it
    assert _save_during_step(tmp_path / "control", None) == [0.0, 1.0]  # control: a torn, half-updated state


def test_raw_extra_files_are_taken_in_every_bytes_form_as_by_a_synchronous_save(tmp_path):
    blob = bytearray(b"tokenizer bytes")
    for async_save in (False, True):
        manager = ranksafe.CheckpointManager(tmp_path / str(async_save), async_save=async_save, storage="shared")
        extra = {"a.bin": bytes(blob), "b.bin": blob, "c.bin": memoryview(blob)}
        manager.save(0, {"w": torch.ones(2)}, extra_files=extra)  # was (async): memoryview cannot be deep-copied
        blob[0:9] = b"XXXXXXXXX"  # changed after save() returned: the snapshot holds the bytes at save time
        manager.close()
        for name in extra:
            assert (tmp_path / str(async_save) / "step_00000000" / name).read_bytes() == b"tokenizer bytes", name
        blob[0:9] = b"tokenizer"


def test_a_state_that_cannot_be_snapshotted_leaves_no_step_behind(tmp_path):
    """Before, the step's temporary directory stayed after the failed snapshot (no commit was coming to use or remove
    it) until the next save cleaned debris; the failure itself is reported by the next check, as a synchronous save
    raises it."""
    manager = ranksafe.CheckpointManager(tmp_path, async_save=True)
    manager.save(1, {"w": torch.ones(2), "lock": threading.Lock()})  # a lock cannot be deep-copied
    manager.wait()
    assert os.listdir(tmp_path) == []
    with pytest.raises(TypeError, match="lock") as e:
        manager.check()
    if hasattr(e.value, "add_note"):  # Python 3.11+: the error names the step and the root
        assert e.value.__notes__ == [f"the snapshot for step 1 of {tmp_path} (rank 0)"]
    manager.close()


class _SlowToPickle:
    """Holds a background commit open for a second: torch.save pickles it before it writes the tensors' bytes."""

    def __deepcopy__(self, memo):
        return _SlowToPickle()

    def __reduce__(self):
        time.sleep(1.0)
        return (_SlowToPickle, ())


def test_warmup_while_a_commit_is_in_flight_waits_for_it_instead_of_overwriting_its_snapshot(tmp_path):
    """Before: warmup(example_state) copied the example into the staging buffers that the commit in flight was still
    writing from: step 1 held the example's 7.0, not the 1.0 it was saved with."""
    mgr = CheckpointManager(tmp_path, async_save=True)
    mgr.save(1, {"slow": _SlowToPickle(), "w": torch.full((1000,), 1.0)})
    mgr.warmup({"slow": _SlowToPickle(), "w": torch.full((1000,), 7.0)})  # a second fit's, say
    assert mgr.load(1, weights_only=False)["w"][0].item() == 1.0
    mgr.close()


def _one_rank_skips_a_save(rank, root):
    manager = CheckpointManager(root, keep=2, timeout=3, async_save=True)
    manager.save(1, {"w": torch.ones(2)})
    start = time.monotonic()
    try:
        if rank == 0:
            manager.save(2, {"w": torch.ones(2)})
        else:
            time.sleep(12)  # past the manager's timeout, well within the environment's
    except ranksafe.RankFailure as e:
        return {"type": type(e).__name__, "msg": str(e)[:300], "seconds": time.monotonic() - start}
    return None


def test_an_async_managers_timeout_bounds_its_background_writers_exchanges(tmp_path):
    """Before: the background writer's exchanges (the check an async save starts with, close) waited
    ``RANKSAFE_TIMEOUT`` whatever the manager's ``timeout``: here 60 s, by default 30 minutes."""
    ranks = run_ranks(_one_rank_skips_a_save, 2, args=(str(tmp_path / "ckpt"),), env={"RANKSAFE_TIMEOUT": "60"})
    waited = ranks.values[0]
    assert waited is not None and waited["type"] == "BarrierTimeout", waited
    assert "after 3s" in waited["msg"] and "rank(s) 1" in waited["msg"] and waited["seconds"] < 10, waited


def test_a_second_manager_of_the_root_leaves_a_step_committing_in_the_background(tmp_path):
    """Before: the second manager's save took the first one's step, still being written, for the debris of a crashed
    save and removed it; the first commit then failed, and step 1 was lost."""
    root = tmp_path / "ckpt"
    training = Gated(root, keep=3, async_save=True)
    training.gate = threading.Event()
    training.save(1, {"w": torch.ones(4)})  # its commit waits for the gate
    assert os.listdir(root) == [".step_00000001.ranksafe-partial"]
    CheckpointManager(root, keep=3).save(2, {"w": torch.full((4,), 2.0)})  # e.g. a helper that makes its own
    training.gate.set()
    training.wait()
    training.check()
    assert [s.step for s in ranksafe.list_steps(root)] == [1, 2]
    assert training.load(1)["w"].tolist() == [1.0] * 4
    training.close()


class Interrupting:
    """Ctrl-C while the snapshot copies it: non-tensors are deep-copied then."""

    def __deepcopy__(self, memo):
        raise KeyboardInterrupt


def test_a_ctrl_c_in_an_async_snapshot_leaves_no_step_behind(tmp_path):
    """Before: the step's temporary stayed on disk, and marked as being written, no save of the process removed it."""
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep=3, async_save=True)
    with pytest.raises(KeyboardInterrupt):
        manager.save(1, {"w": torch.ones(2), "odd": Interrupting()})
    assert os.listdir(root) == []
    manager.save(2, {"w": torch.ones(2)})
    manager.close()
    assert [s.step for s in ranksafe.list_steps(root)] == [2]


def test_a_second_manager_through_a_link_to_the_root_leaves_the_first_ones_step_too(tmp_path):
    """The same root reached through a symbolic link: before, the registry knew the path as the first manager spelled
    it, and the second one's clean-up removed the step being committed."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    training = Gated(tmp_path / "real" / "ckpt", keep=3, async_save=True)
    training.gate = threading.Event()
    training.save(1, {"w": torch.ones(4)})
    CheckpointManager(tmp_path / "link" / "ckpt", keep=3).save(2, {"w": torch.full((4,), 2.0)})
    training.gate.set()
    training.close()
    assert [s.step for s in ranksafe.list_steps(tmp_path / "real" / "ckpt")] == [1, 2]
