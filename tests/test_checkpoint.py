"""CheckpointManager on real ranks: node-local copies, agreed latest, crash debris, retention, costs per save.

Simulated nodes come from tests/test_storage.py: the same path reaches a different directory per node.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import ranksafe
from ranksafe import cli, steps
from ranksafe import exchange as protocol
from ranksafe.checkpoint import CheckpointManager
from ranksafe.commit import AtomicDir, verify_step
from ranksafe.steps import StepDirs, list_steps
from tests.ranks import run_ranks
from tests.test_storage import as_node, node_disk


def _state(step: int) -> dict:
    return {"w": torch.full((8,), float(step)), "step": torch.tensor(step)}


def _two_nodes(rank, base):
    root = as_node(rank, 2, base)
    mgr = CheckpointManager(root, keep=2)
    mgr.save(1, _state(1), extra_files={"meta.json": '{"run": 1}'})
    mgr.save(2, _state(2))
    with mgr.saving(3, {"state.pt": _state(3)}) as tx:  # side state of every rank, written beside the state
        tx.save({"rng": torch.tensor([rank, 3])}, f"rng-{rank}.pt")
    resumed = CheckpointManager(root, keep=2)  # a restarted job
    latest = resumed.latest()
    state = resumed.load()
    rng = ranksafe.load_file(os.path.join(resumed.step_dir(3), f"rng-{rank}.pt"))["rng"].tolist()
    listed = sorted(os.listdir(resumed.step_dir(3)))  # this node's copy
    ranksafe.barrier("every rank read step 3")
    # node 1 missed the newest step: its copy of step 3 never got past the temporary name
    if rank == 2:
        doomed = AtomicDir(resumed.step_dir(3))
        os.rename(doomed.final, doomed.tmp)
    ranksafe.barrier("node 1 lost step 3")
    behind = resumed.latest()
    fallback = resumed.load()
    resumed.save(4, _state(4))
    return {
        "latest": latest,
        "w": state["w"][0].item(),
        "rng": rng,
        "listed": listed,
        "behind": behind,
        "fallback_w": fallback["w"][0].item(),
        "after": resumed.latest(),
        "writer": resumed.placement.writer,
        "kind": resumed.placement.kind,
    }


def test_two_nodes_with_local_disks_save_resume_and_agree_on_the_common_step(tmp_path):
    values = run_ranks(_two_nodes, 4, args=(str(tmp_path),), timeout=120).values
    for rank, v in enumerate(values):
        assert v["kind"] == "local"
        assert (v["latest"], v["w"]) == (3, 3.0)
        assert v["rng"] == [rank, 3]  # each rank reads back its own side file from its own node's disk
        assert (v["behind"], v["fallback_w"]) == (2, 2.0)  # every rank resumes from the previous common step
        assert v["after"] == 4
    assert [v["writer"] for v in values] == [True, False, True, False]
    disk0, disk1 = node_disk(tmp_path, 0), node_disk(tmp_path, 1)
    # each node held its own full copy of step 3, with its own ranks' side files
    assert values[0]["listed"] == values[1]["listed"] == ["MANIFEST.json", "rng-0.pt", "rng-1.pt", "state.pt"]
    assert values[2]["listed"] == values[3]["listed"] == ["MANIFEST.json", "rng-2.pt", "rng-3.pt", "state.pt"]
    # keep=2 applied per node to the steps every node has: node 0's step 3, which no load takes now, deleted, node 1's
    # debris of it cleaned. Before, node 0 kept step 3 and deleted step 2: the nodes had one step in common. Step 4
    # counts for keep from the next save on (until then another node's commit of it could still fail).
    assert sorted(os.listdir(disk0)) == sorted(os.listdir(disk1)) == ["step_00000001", "step_00000002", "step_00000004"]
    assert verify_step(os.path.join(disk1, "step_00000004"))["step"] == 4


def _naive(rank, base):
    root = as_node(rank, 2, base)
    path = os.path.join(root, "global_step_20", "model.pt")
    if rank == 0:  # the common pattern: rank 0 alone writes, everyone loads after a barrier
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(_state(20), path)
    ranksafe.barrier("saved")
    try:
        torch.load(path)
    except FileNotFoundError:
        return "FileNotFoundError"
    return "loaded"


def test_control_rank0_alone_writing_to_node_local_disk_leaves_node1_without_the_file(tmp_path):
    values = run_ranks(_naive, 4, args=(str(tmp_path),)).values
    assert values == ["loaded", "loaded", "FileNotFoundError", "FileNotFoundError"]


class _KillOnPickle:
    """Pickling this kills the process: a crash in the middle of writing the state file."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


def _killed_mid_save(rank, root):
    mgr = CheckpointManager(root, keep=3)
    mgr.save(1, _state(1))
    with mgr.saving(2, {"state.pt": {**_state(2), "boom": _KillOnPickle()}}) as tx:
        tx.save(torch.arange(4), f"rng-{rank}.pt")
    return "survived"


def _resume_after_kill(rank, root):
    before = sorted(os.listdir(root))
    mgr = CheckpointManager(root, keep=3)
    latest = mgr.latest()
    w = mgr.load()["w"][0].item()
    mgr.save(3, _state(3))
    return {"before": before, "latest": latest, "w": w, "after": sorted(os.listdir(root))}


def test_sigkill_during_a_save_keeps_the_previous_step_and_the_debris_goes_at_the_next_save(tmp_path):
    root = str(tmp_path / "ckpt")
    killed = run_ranks(_killed_mid_save, 2, args=(root,), env={"RANKSAFE_TIMEOUT": "5"}, timeout=60)
    assert killed[0].exitcode == -signal.SIGKILL  # the writer died inside torch.save of step 2
    # the other rank learns of it (the store died with rank 0) instead of hanging
    assert killed[1].raised("RankFailure") and not killed[1].hung, killed[1].error
    values = run_ranks(_resume_after_kill, 2, args=(root,)).values
    for v in values:
        assert ".step_00000002.ranksafe-partial" in v["before"] and "step_00000001" in v["before"]
        assert "step_00000002" not in v["before"]
        assert (v["latest"], v["w"]) == (1, 1.0)
        assert v["after"] == ["step_00000001", "step_00000003"]


class _FsCounter:
    """Count calls to the os / open functions a save could use, in this process."""

    NAMES = (
        "open", "stat", "lstat", "listdir", "scandir", "mkdir", "makedirs", "rename", "replace", "unlink",
        "remove", "rmdir", "fsync", "walk",
    )  # fmt: skip

    def __init__(self):
        self.count = 0
        self._saved = [(os, n, getattr(os, n)) for n in self.NAMES]
        self._saved += [(builtins, "open", builtins.open), (io, "open", io.open)]

    def _counting(self, fn):
        def call(*args, **kwargs):
            self.count += 1
            return fn(*args, **kwargs)

        return call

    def __enter__(self):
        for owner, name, fn in self._saved:
            setattr(owner, name, self._counting(fn))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)


def _costs(rank, base, per_node, shared):
    root = as_node(rank, per_node, base, shared)
    mgr = CheckpointManager(root, keep=2)
    mgr.save(0, _state(0))  # the first save probes the storage once
    exchanges = []
    with _FsCounter() as fs:
        for step in range(1, 10):
            seq = protocol._session.seq
            mgr.save(step, _state(step))
            exchanges.append(protocol._session.seq - seq)
    ranksafe.barrier("all saved")
    return {"writer": mgr.placement.writer, "exchanges": exchanges, "fs": fs.count, "listing": os.listdir(root)}


@pytest.mark.parametrize(("nprocs", "per_node", "shared"), [(2, 2, True), (4, 2, False)])
def test_a_save_costs_three_exchanges_and_no_file_calls_on_non_writers(tmp_path, nprocs, per_node, shared):
    values = run_ranks(_costs, nprocs, args=(str(tmp_path), per_node, shared), timeout=120).values
    for rank, v in enumerate(values):
        assert v["exchanges"] == [3] * 9, f"rank {rank}"  # the same with 2 and 4 ranks
        if v["writer"]:
            assert v["fs"] > 0  # the counter sees the writer's calls
            # keep=2 over 10 saves; with a writer per node the newest counts from the next save on
            kept = ["step_00000008", "step_00000009"] if shared else ["step_00000007", "step_00000008", "step_00000009"]
            assert sorted(v["listing"]) == kept
        else:
            assert v["fs"] == 0, f"rank {rank} made {v['fs']} file-system calls during saves"
    assert [v["writer"] for v in values] == ([True, False] if shared else [True, False, True, False])


def _corrupt_newest(rank, root):
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    if rank == 0:
        path = os.path.join(mgr.step_dir(2), "state.pt")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    ranksafe.barrier("bit flipped")
    try:
        mgr.load()
        error = None
    except ranksafe.CorruptCheckpoint as e:
        error = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = mgr.load(fallback=True)["w"][0].item()
    fell_back_to = mgr.loaded_step
    mgr.save(3, {"r": torch.tensor(rank)}, sharded=True)  # every rank writes its own shard
    shard = mgr.load(sharded=True)["r"].item()
    return {
        "error": error, "w": w, "step": fell_back_to, "warnings": [str(c.message) for c in caught],
        "rank": rank, "shard": shard, "files": sorted(os.listdir(mgr.step_dir(3))),
    }  # fmt: skip


def test_a_corrupt_newest_step_raises_everywhere_naming_the_file_or_falls_back(tmp_path):
    values = run_ranks(_corrupt_newest, 2, args=(str(tmp_path / "ckpt"),)).values
    for v in values:
        assert v["error"] is not None and "step_00000002/state.pt" in v["error"] and "checksum" in v["error"]
        assert (v["w"], v["step"]) == (1.0, 1)
        assert len(v["warnings"]) == 1 and "step_00000002/state.pt" in v["warnings"][0]
        assert "falling back to step 1" in v["warnings"][0]
        assert v["shard"] == v["rank"] and v["files"] == ["MANIFEST.json", "shard-00000.pt", "shard-00001.pt"]


def _bad_file_name_on_rank_0(rank, root):
    mgr = CheckpointManager(root)
    start = time.monotonic()
    try:
        mgr.save(1, _state(1), extra_files={"notes/../x": "rank 0 only"} if rank == 0 else None)
    except Exception as e:
        return {"type": type(e).__name__, "msg": str(e)[:300], "seconds": time.monotonic() - start}
    return None


def test_a_bad_file_name_given_on_one_rank_fails_every_rank_naming_it(tmp_path):
    """Before: the name was checked before the first exchange, so rank 0 raised alone and rank 1 waited in the
    exchange until rank 0's process ended, then raised that it had ended, without the cause."""
    r0, r1 = run_ranks(_bad_file_name_on_rank_0, 2, args=(str(tmp_path / "ckpt"),), timeout=90).values
    assert r0["type"] == r1["type"] == "RankFailure[ValueError]", (r0, r1)
    assert "notes/../x" in r1["msg"] and "rank 0" in r1["msg"] and r1["seconds"] < 10, r1


# -- one process -------------------------------------------------------------------------------------


def test_a_reader_given_to_load_reads_the_verified_step_only(tmp_path):
    """``load(read=...)``, for a framework's loader that puts the state in place: it gets the path of the step that
    verified, after a fallback over a damaged one too, and what it returns is what load returns."""
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, keep=None)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    read: list[str] = []

    def reader(path: str) -> str:
        read.append(path)
        return "read by the framework"

    assert mgr.load(read=reader) == "read by the framework"
    state = root / "step_00000002" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="falling back to step 1"):
        mgr.load(fallback=True, read=reader)
    with pytest.raises(ranksafe.CorruptCheckpoint, match="step_00000002"):
        mgr.load(2, read=reader)
    assert read == [str(state), str(root / "step_00000001" / "state.pt")]


def test_after_falling_back_over_a_damaged_step_training_saves_below_it_and_resumes_from_there(tmp_path):
    """Before: the damaged step still counted as the newest, so the first save below it (step 15 after falling back
    from 20 to 10) was refused, and training could not go on from the step it fell back to."""
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, keep=None)
    for step in (10, 20):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    state = root / "step_00000020" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="step_00000020/state.pt.*falling back to step 10"):
        assert mgr.load(fallback=True)["w"][0].item() == 10.0
    mgr.save(15, {"w": torch.full((4,), 15.0)})
    relaunched = CheckpointManager(root, keep=None)
    with pytest.warns(RuntimeWarning, match="falling back to step 15"):
        assert relaunched.load(fallback=True)["w"][0].item() == 15.0
    with pytest.raises(ValueError, match="holds step 15 already"):  # an undamaged newer step still holds a save back
        relaunched.save(12, {"w": torch.zeros(4)})
    relaunched.save(20, {"w": torch.full((4,), 20.0)})  # the damaged step saved again, whole
    with pytest.raises(ValueError, match="holds step 20 already"):
        relaunched.save(18, {"w": torch.zeros(4)})
    assert relaunched.load()["w"][0].item() == 20.0


def test_an_io_error_while_verifying_raises_instead_of_falling_back_over_a_sound_step(tmp_path, monkeypatch):
    """Before: any error met while verifying the newest step (an I/O error, storage refusing for a while) counted as
    damage, and load(fallback=True) went back to an older step over a sound one."""
    mgr = CheckpointManager(tmp_path / "ckpt", keep=None)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((2,), float(step))})

    verify = ranksafe.step_agreement.verify_step

    def newest_unreadable(place, **kwargs):
        if str(place).endswith("step_00000002"):
            raise OSError(errno.EIO, "Input/output error (injected)", str(place))
        return verify(place, **kwargs)

    monkeypatch.setattr(ranksafe.step_agreement, "verify_step", newest_unreadable)
    with pytest.raises(OSError, match="Input/output error"):
        mgr.load(fallback=True)
    assert mgr.loaded_step is None


def _failure_elsewhere_while_verifying(rank, root):
    mgr = CheckpointManager(root, keep=None, storage="shared")
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((2,), float(step))})
    if rank == 1:  # after listing the steps, this rank fails in a shared block of its own (a callback's, say)

        def first_good(*args):
            with ranksafe.together("a callback elsewhere"):
                raise FileNotFoundError(errno.ENOENT, "No such file (injected)", "/elsewhere/config.yaml")

        ranksafe.checkpoint.first_good = first_good
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mgr.load(fallback=True)
            error = None
        except FileNotFoundError as e:
            error = (type(e).__name__, e.ranks, e.out_of_step, type(e.__cause__).__name__)
    said = [str(w.message) for w in caught if "falling back" in str(w.message)]
    return {"error": error, "fell back": said, "passed over": sorted(mgr._kept.passed_over), "loaded": mgr.loaded_step}


def test_another_ranks_failure_elsewhere_is_not_taken_for_damage_to_the_step_being_verified(tmp_path):
    """Before: rank 1's missing file, raised in a block of its own while rank 0 verified step 2, reached rank 0 as
    that step's verdict: rank 0 warned that step 2 was damaged, fell back to step 1, then raised anyway."""
    values = run_ranks(_failure_elsewhere_while_verifying, 2, args=(str(tmp_path),), timeout=60).values
    assert values[1]["error"] == ("RankFailure[FileNotFoundError]", [1], True, "FileNotFoundError"), values  # chained
    expected = ("RankFailure[FileNotFoundError]", [1], True, "NoneType")
    assert values[0] == {"error": expected, "fell back": [], "passed over": [], "loaded": None}, values


@pytest.mark.parametrize("step", [-1, 1.5, True, "3", "../x"])
def test_steps_must_be_non_negative_ints(tmp_path, step):
    with pytest.raises(ValueError, match="step must be"):
        CheckpointManager(tmp_path).step_dir(step)


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", ".hidden", ""])
def test_file_names_and_prefixes_cannot_escape_the_step_directory(tmp_path, name):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(ValueError):
        mgr.save(1, _state(1), extra_files={name: b"x"})
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, prefix=name + "/")
    assert os.listdir(tmp_path) == []  # rejected before anything was created


def test_a_file_named_as_ranksafe_names_its_own_is_refused_and_nothing_is_committed(tmp_path):
    """Before, each of these saves said it succeeded: an extra file named MANIFEST.json was replaced by the manifest,
    one named state.pt replaced the state (which was never written), or stood for it beside sharded state, and one
    ending in .ranksafe-tmp was neither listed in the manifest nor verified."""
    mgr = CheckpointManager(tmp_path, keep=None)
    mgr.save(1, _state(1))
    for name in ("MANIFEST.json", "state.pt", "notes.ranksafe-tmp"):
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            mgr.save(2, _state(2), extra_files={name: b"my own bytes"})
    with pytest.raises(ValueError, match=r"state\.pt"):  # a load without sharded=True would take it for the state
        mgr.save(2, _state(2), sharded=True, extra_files={"state.pt": b"my own bytes"})
    for name in ("MANIFEST.json", "notes.ranksafe-tmp"):  # a side file of the block
        with pytest.raises(ValueError, match=name.replace(".", r"\.")), mgr.saving(2) as tx:
            tx.save(b"my own bytes", name)
        with pytest.raises(ValueError, match=name.replace(".", r"\.")), mgr.saving(2) as tx:
            pathlib.Path(tx.file(name)).write_bytes(b"my own bytes")
    for name in ("MANIFEST.json", "notes.ranksafe-tmp"):  # straight into the directory
        with pytest.raises(ValueError, match=name.replace(".", r"\.")), mgr.saving(2) as tx:
            pathlib.Path(tx.path, name).write_bytes(b"my own bytes")
    assert [(s.step, s.status) for s in list_steps(tmp_path)] == [(1, "committed")]
    assert torch.equal(mgr.load()["w"], _state(1)["w"])


def _side_file_named_as_ranksafe_names_its_own_on_one_rank(rank, root, how):
    mgr = CheckpointManager(root, storage="shared")
    try:
        with mgr.saving(1) as tx:
            if rank == 0:
                tx.save(b"this rank's own", f"rng-{rank}.pt")
            elif how == "through the step writer":
                tx.save(b"this rank's own", "MANIFEST.json")
            else:  # found by the writer at its commit
                pathlib.Path(tx.path, "notes.ranksafe-tmp").write_bytes(b"this rank's own")
    except ValueError as e:
        return type(e).__name__, e.ranks, mgr.latest()
    return "saved", None, mgr.latest()


@pytest.mark.parametrize(
    "how, failed", [("through the step writer", [1]), ("straight into the directory", [0])], ids=["writer", "straight"]
)
def test_a_side_file_named_as_ranksafe_names_its_own_on_one_rank_fails_every_rank_and_commits_nothing(
    tmp_path, how, failed
):
    values = run_ranks(
        _side_file_named_as_ranksafe_names_its_own_on_one_rank, 2, args=(str(tmp_path), how), timeout=60
    ).values
    assert values == [("RankFailure[ValueError]", failed, None)] * 2, values


def test_list_steps_reports_committed_incomplete_and_corrupt(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=None)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    with mgr.saving(4) as tx:  # a user file written directly, hashed by the writer at commit
        pathlib.Path(tx.path, "notes.txt").write_text("hello")
    os.truncate(os.path.join(mgr.step_dir(2), "state.pt"), 100)
    os.remove(os.path.join(mgr.step_dir(3), "MANIFEST.json"))
    in_progress = AtomicDir(mgr.step_dir(5))
    in_progress.create()
    pathlib.Path(in_progress.tmp, "a.txt").write_text("abc")
    pathlib.Path(in_progress.tmp, ".b.txt.host.1.0a1b2c3d.ranksafe-tmp").write_bytes(bytes(100))  # a write going on
    steps = list_steps(tmp_path)
    assert [(s.step, s.status) for s in steps] == [
        (1, "committed"), (2, "corrupt"), (3, "incomplete"), (4, "committed"), (5, "incomplete"),
    ]  # fmt: skip
    assert "size is 100 bytes" in steps[1].error and steps[3].size == 5
    assert steps[4].size == 3  # a temporary is renamed or gone any moment: not counted (nor stat'ed)
    assert mgr.latest() == 4  # latest() lists cheaply; load() verifies the contents
    with pytest.raises(ranksafe.CorruptCheckpoint, match=r"step_00000002/state\.pt"):
        mgr.load(2)


def test_a_step_name_is_what_the_manager_makes_and_a_longer_prefix_is_another_managers(tmp_path):
    dirs = StepDirs(str(tmp_path), "step_")
    assert dirs.parse("step_00000007") == (7, "")
    assert dirs.parse(".step_00000007.ranksafe-partial") == (7, AtomicDir.PARTIAL)
    assert dirs.parse(".step_123456789.ranksafe-old") == (123456789, AtomicDir.OLD)  # past 8 digits
    others = ["step_7", "step_best_00000007", ".step_00000007", "step_00000007.ranksafe-partial", "step_00000007x"]
    assert [dirs.parse(name) for name in others] == [None] * len(others)
    for name in ("step_7", "step_best_00000001", ".step_00000003.ranksafe-old", "step_00000003"):
        os.mkdir(tmp_path / name)
    assert [s.step for s in list_steps(tmp_path)] == [3]  # a step set aside beside its new copy is not one more step
    file_root = tmp_path / "file"
    file_root.write_text("not a root")
    with pytest.raises(NotADirectoryError):  # not an empty root: a listing must not say "no steps"
        list_steps(file_root)


def test_saving_a_step_again_replaces_it_and_a_failed_block_commits_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1))
    mgr.save(1, _state(7), extra_files={"meta.json": '{"epoch": 7}'})
    assert mgr.load(1)["w"][0].item() == 7.0
    assert pathlib.Path(mgr.step_dir(1), "meta.json").read_text() == '{"epoch": 7}'
    with pytest.raises(ZeroDivisionError), mgr.saving(2) as tx:
        tx.save(b"partial", "notes.txt")
        raise ZeroDivisionError("the block failed")
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]


def _slips(rank, base):
    out = {}
    shared = CheckpointManager(os.path.join(base, "shared"), storage="shared")
    per_node = CheckpointManager(as_node(rank, 2, os.path.join(base, "nodes")), storage="local")  # ranks 0, 1 | 2
    per_rank = CheckpointManager(os.path.join(base, f"run_{rank}"), storage="shared")
    cases = {
        "shared, one name for two ranks": (shared, lambda tx: tx.save(b"r", "rng.pt")),
        "shared, a side file named as the state": (shared, lambda tx: rank == 1 and tx.save(b"r", "state.pt")),
        "local, one name on two nodes": (per_node, lambda tx: rank != 1 and tx.save(b"r", "rng.pt")),
        "local, one name on one node": (per_node, lambda tx: rank != 2 and tx.save(b"r", "rng.pt")),
        "shared, a root per rank": (per_rank, lambda tx: None),
    }
    for step, (case, (manager, side_files)) in enumerate(cases.items(), start=1):
        try:
            with manager.saving(step, {"state.pt": _state(step)}) as tx:
                side_files(tx)
            out[case] = ("committed", manager.latest())
        except ValueError as e:
            out[case] = ("ValueError", str(e), manager.latest())
    return out


def test_two_ranks_that_would_write_one_file_or_into_another_root_fail_every_rank_and_commit_nothing(tmp_path):
    """Before: two ranks' side files of one name were both taken into the manifest (the last rank's size and CRC,
    whichever file the disk kept), so a committed step failed to load, or silently held one rank's file only; and a
    root per rank with storage="shared" committed rank 0's step while rank 1 got its own path back, with nothing
    there. Per-node names on node-local disks stay fine."""
    values = run_ranks(_slips, 3, args=(str(tmp_path),)).values
    for v in values:
        assert v["local, one name on two nodes"] == ("committed", 3)
        kind, message, latest = v["shared, one name for two ranks"]
        assert (kind, latest) == ("ValueError", None) and "ranks 0, 1, 2 wrote rng.pt" in message, message
        kind, message, latest = v["shared, a side file named as the state"]
        assert (kind, latest) == ("ValueError", None) and "rank 1 wrote state.pt, which the writer writes" in message
        kind, message, latest = v["local, one name on one node"]
        assert (kind, latest) == ("ValueError", 3) and "ranks 0, 1 wrote rng.pt:" in message
        kind, message, _ = v["shared, a root per rank"]
        assert kind == "ValueError" and f"rank 1 has {tmp_path / 'run_1'} where rank 0 has" in message, message
    assert sorted(os.listdir(tmp_path / "shared")) == []  # nothing committed, no temporary left
    assert os.listdir(tmp_path / "run_0") == []


# -- damaged manifests, listing errors, full disks, crashes between renames ---------------------------


def _bad_name_on_rank_1(rank, root):
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1))
    files = {"state.pt": _state(2), **({"../escape.pt": b"x"} if rank == 1 else {})}
    with pytest.raises(ranksafe.RankFailure, match="file name"), mgr.saving(2, files):
        pass
    ranksafe.barrier("failed")
    return sorted(os.listdir(root))


def test_a_save_that_fails_in_its_first_exchange_leaves_no_temporary_directory(tmp_path):
    """Before: the writer had created .step_00000002.ranksafe-partial when rank 1's bad file name failed the first
    exchange; it stayed until the next save, and `ranksafe ls` listed an incomplete step 2."""
    values = run_ranks(_bad_name_on_rank_1, 2, args=(str(tmp_path / "ckpt"),), timeout=60).values
    assert values == [["step_00000001"]] * 2


def _damaged_manifest(rank, root):
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    if rank == 0:  # one flipped bit that keeps the manifest valid JSON: "size" becomes "sizm"
        path = os.path.join(mgr.step_dir(2), "MANIFEST.json")
        data = pathlib.Path(path).read_bytes()
        pathlib.Path(path).write_bytes(data.replace(b'"size"', b'"sizm"', 1))
    ranksafe.barrier("manifest damaged")
    start = time.monotonic()
    try:
        mgr.load()
        error = None
    except ranksafe.CorruptCheckpoint as e:
        error = str(e)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        w = mgr.load(fallback=True)["w"][0].item()
    return {"error": error, "w": w, "step": mgr.loaded_step, "seconds": time.monotonic() - start}


def test_a_manifest_damaged_into_other_valid_json_is_corrupt_on_every_rank_and_falls_back(tmp_path, capsys):
    """Before: the writer raised KeyError alone and the other rank waited out the timeout, then fell back."""
    root = str(tmp_path / "ckpt")
    values = run_ranks(_damaged_manifest, 2, args=(root,), env={"RANKSAFE_TIMEOUT": "20"}, timeout=120).values
    for v in values:
        assert v["error"] is not None and "step_00000002/MANIFEST.json" in v["error"] and "damaged" in v["error"]
        assert (v["w"], v["step"]) == (1.0, 1) and v["seconds"] < 10
    step2 = os.path.join(root, "step_00000002")
    assert cli.main(["verify", step2]) == 1 and cli.main(["ls", root]) == 1
    err = capsys.readouterr().err
    assert "BAD" in err and "damaged manifest entry" in err and "Traceback" not in err


def test_a_save_under_a_root_that_is_a_file_names_the_root_and_the_rank(tmp_path):
    """Before: ``[Errno 20] Not a directory: '.../ckpt'``, without the step or the rank."""
    root = tmp_path / "ckpt"
    root.write_text("a file where the checkpoint root should be")
    with pytest.raises(NotADirectoryError, match=rf"cannot save step 1 under {root} \(rank 0\): Not a directory"):
        CheckpointManager(root).save(1, _state(1))


def test_a_step_saved_again_is_not_put_back_by_another_manager_while_it_is_replaced(tmp_path, monkeypatch):
    """Before: between the two renames that replace a committed step, another manager of the root took the copy set
    aside for a crash's and put it back; the new copy's rename then failed, and the save was lost."""
    root = tmp_path / "ckpt"
    saving, other = CheckpointManager(root, keep=None), CheckpointManager(root, keep=None)
    saving.save(1, {"w": torch.ones(2)})
    rename, seen = os.rename, []

    def listing_in_between(src, dst, *args, **kwargs):
        rename(src, dst, *args, **kwargs)
        if str(dst).endswith(AtomicDir.OLD):
            seen.append(other.latest())

    monkeypatch.setattr(os, "rename", listing_in_between)
    saving.save(1, {"w": torch.full((2,), 2.0)})
    monkeypatch.undo()
    assert seen == [None]  # the step is aside for a moment: not committed, and not put back
    assert saving.load(1)["w"].tolist() == [2.0, 2.0]


def test_retention_leaves_a_step_that_is_being_saved_again(tmp_path):
    """Before: retention renamed the committed step onto its temporary name, which a save of the same step (by another
    manager of the root) was writing: that save's directory was gone."""
    root = tmp_path / "ckpt"
    CheckpointManager(root, keep=None).save(1, {"w": torch.ones(2)})
    again = AtomicDir(os.path.join(root, "step_00000001"))
    again.create()  # the step saved again, in progress
    CheckpointManager(root, keep=1).save(2, {"w": torch.ones(2)})  # retention would delete step 1
    assert os.path.isdir(again.tmp) and os.path.isdir(again.final)
    again.abort()


def test_recover_gives_up_when_the_copy_aside_is_gone_meanwhile(tmp_path, monkeypatch):
    """A save of this process may end its swap between recover()'s look and its rename: nothing is aside any more,
    which is no error."""
    step = AtomicDir(tmp_path / "step_00000001")
    os.mkdir(step._old)

    def gone(src, dst):
        raise FileNotFoundError(src)

    monkeypatch.setattr(os, "rename", gone)
    assert step.recover() is False


def _latest_of_a_file(rank, root):
    start = time.monotonic()
    try:
        CheckpointManager(root, storage="shared").latest()
    except ranksafe.RankFailure as e:
        return {"types": [t.__name__ for t in type(e).__mro__], "msg": str(e), "seconds": time.monotonic() - start}
    return "listed"


def test_a_root_the_writer_cannot_list_fails_every_rank_at_once(tmp_path):
    """Before: rank 0 raised NotADirectoryError alone, rank 1 waited for the timeout (BarrierTimeout)."""
    root = tmp_path / "ckpt"
    root.write_text("a file where the checkpoint root should be")
    values = run_ranks(_latest_of_a_file, 2, args=(str(root),), env={"RANKSAFE_TIMEOUT": "20"}, timeout=120).values
    for v in values:
        assert "NotADirectoryError" in v["types"] and str(root) in v["msg"] and "rank 0" in v["msg"], v
        assert v["seconds"] < 10


def _one_node_commits(rank, base):
    import resource

    root = as_node(rank, 1, base)  # two nodes of one rank each, each with its own disk
    mgr = CheckpointManager(root, keep=2, storage="local")
    mgr.save(10, _state(10))
    if rank == 1:  # node 1's disk fills up (EFBIG, even for root): its commit of step 20 fails, node 0's does not
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    try:
        mgr.save(20, {"w": torch.zeros(1 << 16)})
        failed = None
    except ranksafe.RankFailure as e:
        failed = type(e).__name__
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    relaunched = CheckpointManager(root, keep=2, storage="local")
    out = {"failed": failed, "latest": relaunched.latest(), "w": relaunched.load()["w"][0].item()}
    try:
        for step in (11, 12):  # training resumed from step 10
            relaunched.save(step, _state(step))
        out["resumed"] = sorted(os.listdir(root))
        relaunched.save(20, _state(20))
        out["again"] = (relaunched.latest(), sorted(os.listdir(root)))
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_a_step_one_node_failed_to_commit_holds_no_resumed_save_back_on_the_node_that_did(tmp_path):
    """Before: node 0 committed step 20 and node 1 did not; the relaunched job resumed from step 10 (the newest on
    every node), and its first save was refused on every rank because node 0 "holds step 20 already". Retention on
    node 0 also counted that step, deleting step 11 there, which node 1 kept."""
    values = run_ranks(_one_node_commits, 2, args=(str(tmp_path),), timeout=120).values
    for v in values:
        assert v["failed"] == "RankFailure[OSError]" and (v["latest"], v["w"]) == (10, 10.0), v
        assert "refused" not in v, v["refused"]
    # keep=2 counts the steps every node is known to hold, so the newest (12) waits for the next save to count
    assert values[0]["resumed"] == ["step_00000010", "step_00000011", "step_00000012", "step_00000020"]  # and the stray
    assert values[1]["resumed"] == ["step_00000010", "step_00000011", "step_00000012"]
    for v in values:  # step 20 saved again, whole, on both nodes: it counts again
        assert v["again"] == (20, ["step_00000011", "step_00000012", "step_00000020"]), v


def _commit_fails_on_one_node_then_damage(rank, base):
    import resource

    root = as_node(rank, 1, base)  # two nodes of one rank each, each with its own disk
    mgr = CheckpointManager(root, keep=2, storage="local")
    for step in (1, 2):
        mgr.save(step, _state(step))
    if rank == 1:  # node 1's disk fills up (EFBIG, even for root) during step 3
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    with pytest.raises(ranksafe.RankFailure, match="commit failed on rank 1"):
        mgr.save(3, {"w": torch.zeros(1 << 16)})
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    held = sorted(os.listdir(root))
    if rank == 0:  # then step 2 rots on node 0
        state = pathlib.Path(root, "step_00000002", "state.pt")
        data = bytearray(state.read_bytes())
        data[-100] ^= 0xFF
        state.write_bytes(bytes(data))
    resumed = CheckpointManager(root, keep=2, storage="local")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        try:
            w = resumed.load(fallback=True)["w"][0].item()
        except ranksafe.RankFailure as e:
            w = type(e).__name__
    return {"held": held, "w": w}


def test_a_commit_that_fails_on_one_node_leaves_every_node_keep_steps_to_fall_back_to(tmp_path):
    """Before: node 0 committed step 3 and deleted step 1 at once (keep=2), while node 1's commit of step 3 failed.
    The nodes then had one step in common (2), and when it was damaged, the resume had nothing to fall back to:
    RankFailure[CorruptCheckpoint] on every rank, though step 1 had been committed everywhere."""
    values = run_ranks(_commit_fails_on_one_node_then_damage, 2, args=(str(tmp_path),), timeout=120).values
    assert values[0]["held"] == ["step_00000001", "step_00000002", "step_00000003"]  # was: 2 and 3
    assert values[1]["held"] == ["step_00000001", "step_00000002"]
    assert [v["w"] for v in values] == [1.0, 1.0]  # fell back over the damaged step 2 to step 1


def _one_node_fails_a_background_commit_and_training_goes_on(rank, base):
    import resource

    root = as_node(rank, 1, base)  # two nodes of one rank each, each with its own disk
    mgr = CheckpointManager(root, keep=1, storage="local", async_save=True)
    mgr.save(10, _state(10))
    mgr.wait()
    if rank == 1:  # node 1's disk fills up (EFBIG, even for root): its background commit of step 20 fails
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    mgr.save(20, {"w": torch.zeros(1 << 16)})
    mgr.wait()
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    try:
        mgr.check()
        failed = None
    except ranksafe.RankFailure as e:  # the caller goes on training
        failed = type(e).__name__
    mgr.save(21, _state(21))
    mgr.close()
    return {"failed": failed, "held": sorted(os.listdir(root))}


def test_a_background_commit_that_fails_on_one_node_is_passed_over_on_the_node_that_made_it(tmp_path):
    """Before: node 0 counted its copy of step 20, which node 1 lacks, for keep=1, and deleted step 10 at the next
    save: the nodes no longer had one step in common but the newest. A synchronous save passed step 20 over."""
    values = run_ranks(_one_node_fails_a_background_commit_and_training_goes_on, 2, args=(str(tmp_path),)).values
    for v in values:
        assert v == {"failed": "RankFailure[OSError]", "held": ["step_00000010", "step_00000021"]}, values


def _ranks_out_of_step_after_both_nodes_committed(rank, base):
    root = as_node(rank, 1, base)
    mgr = CheckpointManager(root, keep=1, storage="local", async_save=True)
    for step in (10, 20):
        mgr.save(step, _state(step))
    mgr.check()  # step 20 is committed on both nodes
    try:
        mgr.check() if rank == 0 else mgr.close()  # a mismatch: no commit failed
        failed = None
    except ranksafe.RankFailure as e:
        failed = type(e).__name__
    mgr.save(21, _state(21))
    mgr.close()
    return {"failed": failed, "held": sorted(os.listdir(root))}


def test_a_failure_that_says_nothing_about_a_commit_passes_no_step_over(tmp_path):
    """The control of the test above: a mismatch (or a timeout) after step 20 was committed on both nodes must not
    make step 20 look like a partial commit, or retention deletes it on both nodes."""
    values = run_ranks(_ranks_out_of_step_after_both_nodes_committed, 2, args=(str(tmp_path),)).values
    for v in values:
        assert v == {"failed": "CollectiveMismatch", "held": ["step_00000020", "step_00000021"]}, values


def _a_step_saved_again_fails_on_one_node_then_resume(rank, base, async_save):
    import resource

    root = as_node(rank, 2, base)  # two nodes of two ranks each, each node with its own disk
    mgr = CheckpointManager(root, keep=None, storage="local", async_save=async_save)
    for step in (1, 2):
        mgr.save(step, _state(step))
    mgr.wait()
    if rank == 2:  # node 1's disk fills up (EFBIG, even for root): its copy of step 2 saved again fails
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    try:
        mgr.save(2, {"w": torch.full((1 << 16,), 20.0), "step": torch.tensor(2)})
        mgr.wait()
        mgr.check()
        failed = None
    except ranksafe.RankFailure as e:
        failed = type(e).__name__
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    mgr.close()
    resumed = CheckpointManager(root, storage="local")  # as after a restart: nothing remembered
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        w = resumed.load(fallback=True)["w"]
    fell_back = [str(x.message) for x in said if "falling back" in str(x.message)]
    with pytest.raises(ranksafe.CorruptCheckpoint, match="different saves"):
        resumed.load(2)
    return {"failed": failed, "loaded": resumed.loaded_step, "w": float(w[0]), "fell back": len(fell_back)}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_step_saved_again_whose_new_copy_failed_on_one_node_is_resumed_from_by_no_node(tmp_path, async_save):
    """Before: node 0 committed its new copy of step 2 while node 1's failed and kept the old one. Both copies were
    committed, so a resume loaded step 2 on both nodes: w=20 on node 0, w=2 on node 1, without a word. Now the
    copies' manifests name different saves: the step is damaged, and every rank falls back to step 1 alike."""
    values = run_ranks(
        _a_step_saved_again_fails_on_one_node_then_resume, 4, args=(str(tmp_path), async_save), timeout=120
    ).values
    for v in values:
        assert v == {"failed": "RankFailure[OSError]", "loaded": 1, "w": 1.0, "fell back": 1}, values


def _load_copies_made_apart(rank, base):
    mgr = CheckpointManager(as_node(rank, 2, base), storage="local")  # two nodes of two ranks each
    try:
        return mgr.load()["w"].tolist()
    except ranksafe.CorruptCheckpoint as e:
        return str(e)


def test_copies_of_a_step_made_apart_load_when_they_hold_the_same_files_and_are_refused_when_not(tmp_path):
    """Each node's disk given the step by a save of its own (a conversion script run on each node): copies with the
    same files are one state, and load; copies with other files would resume each node from another state."""
    for same in (True, False):
        base = tmp_path / str(same)
        for node in (0, 1):
            CheckpointManager(node_disk(base, node)).save(4, {"w": torch.tensor([4.0, 0.0 if same else node])})
        values = run_ranks(_load_copies_made_apart, 4, args=(str(base),), timeout=120).values
        if same:
            assert values == [[4.0, 0.0]] * 4, values
        else:
            assert all("come from 2 different saves and hold different files" in v for v in values), values


def test_a_damaged_save_id_is_corrupt_and_falls_back(tmp_path):
    mgr = CheckpointManager(tmp_path)
    for step in (1, 2):
        mgr.save(step, _state(step))
    path = pathlib.Path(mgr.step_dir(2), "MANIFEST.json")
    path.write_text(path.read_text().replace('"save_id": "', '"save_id": ["', 1).replace('"\n}', '"]\n}'))
    with pytest.raises(ranksafe.CorruptCheckpoint, match="damaged save id"):
        mgr.load()
    with pytest.warns(RuntimeWarning, match="falling back to step 1"):
        assert mgr.load(fallback=True)["w"][0] == 1


_AFTER_THE_COMMIT = {  # what fails once on node 1 after its copy of step 4 is in
    "delete": (AtomicDir, "delete"),  # retention: the oldest step
    "listing": (StepDirs, "committed"),  # retention: the steps to rank
    "fsync": (ranksafe.commit, "fsync_dir"),  # the commit: the parent directory, after the rename
}


def _fails_after_the_commit(rank, base, async_save, what_fails):
    root = as_node(rank, 1, base)  # two nodes of one rank each, each with its own disk
    mgr = CheckpointManager(
        root, keep=2, best_metric="loss", keep_best=1, storage="local", async_save=async_save
    )  # fmt: skip
    for step, loss in ((1, 0.9), (2, 0.8), (3, 0.7)):
        mgr.save(step, _state(step), metrics={"loss": loss})
    mgr.wait()
    owner, name = _AFTER_THE_COMMIT[what_fails]
    works = getattr(owner, name)
    if rank == 1:

        def fails_once(self_or_path):
            if str(self_or_path).endswith(AtomicDir.PARTIAL):  # the fsync before the rename: not yet
                return works(self_or_path)
            setattr(owner, name, works)
            raise OSError(errno.EIO, "Input/output error", "a step")

        setattr(owner, name, fails_once)
    try:
        mgr.save(4, _state(4), metrics={"loss": 0.1})  # the best step
        mgr.wait()
        mgr.check()
        failed = None
    except ranksafe.RankFailure as e:  # "step 4 is committed": the caller goes on training
        failed = type(e).__name__
    for step in (5, 6):
        mgr.save(step, _state(step), metrics={"loss": 0.5})
    mgr.close()
    return {"failed": failed, "held": sorted(os.listdir(root))}


@pytest.mark.parametrize("what_fails", list(_AFTER_THE_COMMIT))
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failure_on_one_node_after_every_node_committed_passes_no_step_over(tmp_path, async_save, what_fails):
    """Before: a writer passed step 4 over when the commit exchange failed on another node, though that node had
    committed it and only failed to delete an older step. The next save deleted step 4, the best one, on both nodes
    (sync), or on node 0 only (async: the nodes then held different steps). With one writer, step 4 stayed. The review
    of the first fix found the same with a failure to list the steps, and the next review with an fsync of the parent
    directory that fails after the rename which commits the step."""
    values = run_ranks(
        _fails_after_the_commit,
        2,
        args=(str(tmp_path), async_save, what_fails),
        timeout=120,
    ).values
    for v in values:
        assert v == {"failed": "RankFailure[OSError]", "held": [f"step_0000000{s}" for s in (4, 5, 6)]}, values


_FULL_DISK_CHILD = textwrap.dedent(
    """
    import errno, resource, sys, torch, ranksafe
    root, async_save = sys.argv[1], sys.argv[2] == "async"
    mgr = ranksafe.CheckpointManager(root, async_save=async_save)
    mgr.save(1, {"w": torch.zeros(16)})
    mgr.wait()
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))  # EFBIG, even for root
    try:
        mgr.save(2, {"w": torch.zeros(1 << 20)})
        mgr.wait()
        mgr.check()
    except OSError as e:
        print("ERR", e.errno, e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("LATEST", mgr.latest(), float(mgr.load()["w"][0]))
    """
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_under_a_step_raises_its_oserror_naming_the_file_and_the_rank(tmp_path, mode):
    """Before: torch's zip writer's RuntimeError ("unexpected pos ..."), no errno, no path, no rank."""
    root = tmp_path / "ckpt"
    out = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_CHILD, str(root), mode], capture_output=True, text=True, timeout=120
    )
    assert "ERR 27 " in out.stdout, out.stdout + out.stderr
    assert f"{root / 'step_00000002' / 'state.pt'} (rank 0)" in out.stdout, out.stdout
    assert "LATEST 1 0.0" in out.stdout  # the committed step is intact and still the latest
    assert sorted(os.listdir(root)) == ["step_00000001"]


_CRASH_BETWEEN_RENAMES_CHILD = textwrap.dedent(
    """
    import os, sys, torch, ranksafe
    from ranksafe import commit
    mgr = ranksafe.CheckpointManager(sys.argv[1])
    mgr.save(2, {"w": torch.full((4,), 2.0)})
    rename = os.rename

    def crash_on_the_second(src, dst):  # the committed step is aside, the new one not yet in place
        if src.endswith(commit.AtomicDir.PARTIAL):
            os._exit(9)
        rename(src, dst)

    commit.os.rename = crash_on_the_second
    mgr.save(2, {"w": torch.full((4,), 3.0)})  # saved again: replaces the committed step 2
    """
)


def test_a_crash_between_the_renames_that_replace_a_step_keeps_the_committed_one(tmp_path):
    """Before: the step saved again was lost both ways (the old copy aside, the new one partial, both removed)."""
    root = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, "-c", _CRASH_BETWEEN_RENAMES_CHILD, str(root)], timeout=120)
    assert done.returncode == 9
    assert sorted(os.listdir(root)) == [".step_00000002.ranksafe-old", ".step_00000002.ranksafe-partial"]
    # `ranksafe ls` shows the committed copy set aside (was: step 2 incomplete only, exit status 0)
    listed = [(s.step, s.status.value, os.path.basename(s.path)) for s in list_steps(root)]
    aside, partial = ".step_00000002.ranksafe-old", ".step_00000002.ranksafe-partial"
    assert listed == [(2, "committed", aside), (2, "incomplete", partial)]
    mgr = CheckpointManager(root)
    assert mgr.latest() == 2 and mgr.load()["w"][0].item() == 2.0
    mgr.save(3, _state(3))
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000003"]


def test_a_committed_step_put_back_by_a_save_still_refuses_a_lower_step(tmp_path):
    """The save lists the root once for its clean-up and its refusal of a step below the newest: the step the
    clean-up puts back, which that listing named only by its debris, must still count as the newest."""
    root = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, "-c", _CRASH_BETWEEN_RENAMES_CHILD, str(root)], timeout=120)
    assert done.returncode == 9
    with pytest.raises(ValueError, match=f"checkpoint 1: {root} holds step 2 already"):
        CheckpointManager(root).save(1, _state(1))
    assert sorted(os.listdir(root)) == ["step_00000002"]


def test_another_managers_steps_under_a_longer_prefix_are_not_its_debris(tmp_path):
    """Before: ``step_`` took ``.step_best_00000005.ranksafe-partial`` (a save in flight) for its own debris."""
    every, best = CheckpointManager(tmp_path, prefix="step_"), CheckpointManager(tmp_path, prefix="step_best_")
    in_flight = AtomicDir(best.step_dir(5))
    in_flight.create()
    every.save(1, _state(1))
    assert os.path.isdir(in_flight.tmp)
    os.mkdir(AtomicDir(every.step_dir(2)).tmp)  # its own debris (a crashed save's, no save of this process) goes
    every.save(3, _state(3))
    assert sorted(os.listdir(tmp_path)) == [".step_best_00000005.ranksafe-partial", "step_00000001", "step_00000003"]


def test_a_prefix_ending_in_a_digit_is_refused_before_it_mixes_its_steps_with_another_prefixs(tmp_path):
    """Before: with managers of "ckpt" and "ckpt1" under one root, step 7 of "ckpt1" was step 100000007 of "ckpt":
    its latest(), load() and retention took the other manager's step."""
    for make in (lambda: CheckpointManager(tmp_path, prefix="ckpt1"), lambda: list_steps(tmp_path, prefix="ckpt1")):
        with pytest.raises(ValueError, match="step prefix 'ckpt1' ends with a digit"):
            make()
    CheckpointManager(tmp_path, prefix="ckpt1_").save(7, _state(7))
    assert CheckpointManager(tmp_path, prefix="ckpt").latest() is None


def test_a_step_removed_while_it_is_listed_is_left_out(tmp_path, monkeypatch):
    """Retention or a commit may remove a step between the listing and the look at it; ``ls`` raised."""
    mgr = CheckpointManager(tmp_path, keep=None)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    look = steps._step_info

    def removed_first(path, *args):
        if path.endswith("step_00000002"):
            shutil.rmtree(path)  # as retention would, between the listing and this look
        return look(path, *args)

    monkeypatch.setattr(steps, "_step_info", removed_first)
    assert [s.step for s in list_steps(tmp_path, deep=True)] == [1, 3]


def _warmups_on_a_small_disk(rank, disk):
    from ranksafe.async_save import AsyncSaver

    calls = {
        "CheckpointManager": lambda state: CheckpointManager(disk, storage="shared").warmup(state),
        "CheckpointManager, async": lambda state: CheckpointManager(disk, async_save=True).warmup(state),
        "AsyncSaver": lambda state: AsyncSaver().warmup(state, disk),
    }
    out = {}
    for megabytes in (1, 4):  # the disk holds 2 MiB
        for name, call in calls.items():
            try:
                call({"w": torch.zeros(megabytes << 18)})
                out[name, megabytes] = "ok"
            except ranksafe.RankFailure as e:
                out[name, megabytes] = (e.errno, e.ranks, str(e))
    return out


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=False)


def test_a_warmup_on_a_disk_without_room_for_one_checkpoint_fails_on_every_rank(small_disk):
    """A 4 MiB state on a 2 MiB disk: every warmup raises ENOSPC on both ranks, naming the disk and the room it
    lacks (the manager's warmup wrote its small probe and said nothing: the first save failed, steps later)."""
    for rank, out in enumerate(run_ranks(_warmups_on_a_small_disk, 2, args=(str(small_disk),), timeout=60).values):
        for name in ("CheckpointManager", "CheckpointManager, async", "AsyncSaver"):
            assert out[name, 1] == "ok", (rank, name, out[name, 1])
            code, ranks, message = out[name, 4]
            assert code == errno.ENOSPC and ranks == [0], (rank, name, message)
            assert f"cannot write checkpoints to {small_disk} (rank 0)" in message, message
            assert "one checkpoint needs 4194304" in message, message


def test_a_step_below_the_newest_committed_one_is_refused_instead_of_shadowed_or_deleted(tmp_path):
    """A root holding an earlier run's step 119: a new run's step 8 committed, latest() still said 119 (a resume took
    the old run), and with keep=1 retention deleted step 8 at once, as the oldest."""
    CheckpointManager(tmp_path, keep=1).save(119, _state(119))
    manager = CheckpointManager(tmp_path, keep=1)
    with pytest.raises(ValueError, match=f"checkpoint 8: {tmp_path} holds step 119 already"):
        manager.save(8, _state(8))
    assert [s.step for s in list_steps(tmp_path)] == [119] and manager.latest() == 119
    manager.save(119, _state(120))  # the same step again replaces it, as before
    assert float(manager.load()["w"][0]) == 120.0
