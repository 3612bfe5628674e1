"""Remote storage: fsspec URLs for save, load, prepare_dir and AsyncSaver, against fsspec's in-memory file system
and a local S3-compatible server (moto) started by the tests."""

from __future__ import annotations

import os

import fsspec
import pytest
import torch

import ranksafe
from tests.ranks import run_ranks
from tests.s3 import make_bucket, s3_server


@pytest.fixture(scope="module")
def s3():
    with s3_server() as env:
        make_bucket("ckpt")
        yield env


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


@pytest.fixture
def memory():
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    return fs


def test_memory_round_trip_verify_and_a_failed_write_keeps_the_previous_object(memory):
    url = "memory://run/model.pth"
    ranksafe.save({"w": torch.arange(4.0)}, url)
    assert ranksafe.verify_file(url) is True
    assert torch.equal(ranksafe.load(url)["w"], torch.arange(4.0))
    with pytest.raises(RuntimeError, match="cannot pickle this"):
        ranksafe.save({"w": torch.zeros(4), "x": _Unpicklable()}, url)
    assert torch.equal(ranksafe.load(url)["w"], torch.arange(4.0)), "the committed object must survive"
    assert memory.ls("/run", detail=False) == ["/run/model.pth"], "no temporary object may stay"
    # the control: fsspec's own open() publishes the object as it is opened, so a failed write replaces it
    with pytest.raises(RuntimeError), memory.open("/run/model.pth", "wb") as f:
        torch.save({"w": torch.zeros(4), "x": _Unpicklable()}, f)
    with pytest.raises(ranksafe.CorruptCheckpoint):
        ranksafe.load(url)


def test_a_save_onto_a_prefix_with_objects_below_it_is_refused_as_a_local_folder_is(memory, tmp_path):
    """Before, save("memory://run") over memory://run/model.pth returned, with its temporary moved into the prefix
    and no object at the URL; a local folder raises IsADirectoryError."""
    ranksafe.save({"w": torch.ones(1)}, "memory://run/model.pth")
    for folder in ("memory://run", tmp_path):
        with pytest.raises(IsADirectoryError, match=f"cannot save {folder} \\(rank 0\\)"):
            ranksafe.save({"w": torch.ones(2)}, folder)
    assert memory.find("/run") == ["/run/model.pth"]  # no temporary left inside


def test_a_damaged_or_missing_object_names_the_url(memory):
    url = "memory://run/model.pth"
    ranksafe.atomic_save({"w": torch.ones(1000)}, url)
    data = bytearray(memory.cat_file("/run/model.pth"))
    data[len(data) // 2] ^= 0xFF
    memory.pipe_file("/run/model.pth", bytes(data))
    with pytest.raises(ranksafe.CorruptCheckpoint, match=r"memory://run/model\.pth: checksum mismatch"):
        ranksafe.load(url)
    with pytest.raises(FileNotFoundError, match=r"cannot load memory://run/none.pth \(rank 0\): no such object"):
        ranksafe.load("memory://run/none.pth")


def test_prepare_dir_on_remote_storage(memory):
    ranksafe.save({"w": 1}, "memory://run/a.pth")
    with pytest.raises(FileExistsError, match=r"memory://run \(rank 0\) is not empty"):
        ranksafe.prepare_dir("memory://run")
    ranksafe.prepare_dir("memory://run", overwrite=True)
    assert memory.ls("/run", detail=False) == []


def test_a_scheme_in_capitals_names_the_same_place(memory):
    """Was: "S3://bucket/x: no file system for s3://", with s3fs installed (fsspec knows schemes in lower case)."""
    ranksafe.save({"w": torch.arange(3.0)}, "Memory://caps/model.pth")
    assert torch.equal(ranksafe.load("memory://caps/model.pth")["w"], torch.arange(3.0))
    assert ranksafe.remote.canonical("MEMORY://caps/model.pth") == "memory://caps/model.pth"


def test_remove_takes_a_file_a_folder_a_link_or_every_object_below_a_url_and_nothing_is_no_error(memory, tmp_path):
    from ranksafe import remote

    kept, folder = tmp_path / "kept", tmp_path / "folder"
    (kept / "sub").mkdir(parents=True)
    (kept / "sub" / "a.ckpt").write_bytes(b"a")
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "b.ckpt").write_bytes(b"b")
    (tmp_path / "last.ckpt").symlink_to(kept, target_is_directory=True)
    remote.remove(tmp_path / "last.ckpt")  # the link goes, not what it points at (rmtree refuses a link)
    remote.remove(folder)
    remote.remove(tmp_path / "missing.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and (kept / "sub" / "a.ckpt").exists()

    for name in ("run/a.ckpt", "run/sub/b.ckpt", "other/c.ckpt"):
        memory.pipe(f"/{name}", b"x")
    remote.remove("memory://run")
    remote.remove("memory://run/missing.ckpt")
    assert memory.find("/") == ["/other/c.ckpt"]


def test_a_file_named_as_the_manifest_cannot_commit_a_remote_step_before_its_files_are_in(memory):
    """On remote storage the manifest, written last, is the commit. Before: a side file of that name made the step
    committed while its state was still missing; a process killed then left a step that latest() took and load()
    could not read, and that no later save could replace."""
    mgr = ranksafe.CheckpointManager("memory://run")
    mgr.save(1, {"w": torch.zeros(2)})
    seen = None
    with pytest.raises(ValueError, match=r"MANIFEST\.json"), mgr.saving(2, {"state.pt": {"w": torch.ones(2)}}) as tx:
        try:
            tx.save(b"{}", "MANIFEST.json")
        finally:
            seen = [(s.step, s.status) for s in ranksafe.list_steps("memory://run")]  # what a crash here leaves
    assert seen == [(1, "committed")], seen
    assert mgr.latest() == 1 and [s.step for s in ranksafe.list_steps("memory://run")] == [1]


def test_a_url_without_a_file_system_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"gs://bucket/m.pth \(rank 0\): no file system for gs://"):
        ranksafe.save({"w": 1}, "gs://bucket/m.pth")
    with pytest.raises(ValueError, match=r"file://otherhost/m.pth \(rank 0\): a file:// URL names a file on this"):
        ranksafe.save({"w": 1}, "file://otherhost/m.pth")  # fsspec would write ./otherhost/m.pth
    with pytest.raises(ValueError, match=r"file://otherhost/run \(rank 0\)"):
        ranksafe.CheckpointManager("file://otherhost/run")
    # fsspec's chained URLs were taken for local paths: ./simplecache::memory:/run/m.pth, and save returned
    chained = r"simplecache::memory://run/m.pth \(rank 0\): chained URLs are not supported"
    with pytest.raises(ValueError, match=chained):
        ranksafe.save({"w": 1}, "simplecache::memory://run/m.pth")
    with pytest.raises(ValueError, match=chained):
        ranksafe.AsyncSaver().save({"w": 1}, "simplecache::memory://run/m.pth")
    with pytest.raises(ValueError, match="chained URLs are not supported"):
        ranksafe.CheckpointManager("simplecache::memory://run").save(1, {"w": torch.ones(1)})
    assert os.listdir(tmp_path) == []


def test_a_url_ending_in_a_slash_is_refused_as_a_local_folder_is(memory, tmp_path):
    """Before, save("memory://models/") wrote the object memory://models; a local "models/" raises."""
    for call in (ranksafe.save, ranksafe.AsyncSaver().save):
        with pytest.raises(IsADirectoryError, match=r"memory://models/ \(rank 0\) ends with '/'"):
            call({"w": torch.ones(1)}, "memory://models/")
    assert memory.find("/") == []


def test_s3_object_is_committed_whole_or_not_at_all(s3):
    url = "s3://ckpt/single/model.pth"
    ranksafe.save({"w": torch.arange(4.0)}, url)
    big = {"w": torch.zeros(3_000_000), "x": _Unpicklable()}  # more than one 5 MiB part before it fails
    with pytest.raises(RuntimeError, match="cannot pickle this"):
        ranksafe.save(big, url)
    assert torch.equal(ranksafe.load(url)["w"], torch.arange(4.0))
    import s3fs

    uploads = s3fs.S3FileSystem().call_s3("list_multipart_uploads", Bucket="ckpt").get("Uploads", [])
    assert uploads == [], "a failed upload is aborted, not left behind"


def test_a_url_fsspec_would_take_for_a_pattern_is_refused_before_anything_is_removed(s3):
    """Before: a manager on s3://ckpt/exp[1] with keep=2 deleted every step of the run under s3://ckpt/exp1 (fsspec's
    recursive rm expands [1] as a pattern) and none of its own; a save to s3://ckpt/model.pt?versionId=v1 returned that
    URL and overwrote s3://ckpt/model.pt (s3fs drops the query)."""
    import s3fs

    fs = s3fs.S3FileSystem()
    other = ranksafe.CheckpointManager("s3://ckpt/exp1", keep=None)
    other.save(1, _state(1))
    for url in ("s3://ckpt/exp[1]", "s3://ckpt/exp?", "s3://ckpt/exp*"):
        with pytest.raises(
            ValueError, match=f"{url.replace('[', '.').replace('?', '.').replace('*', '.')} \\(rank 0\\): "
        ):
            ranksafe.CheckpointManager(url, keep=2)
    with pytest.raises(ValueError, match="versionId"):
        ranksafe.save({"w": torch.ones(1)}, "s3://ckpt/exp1/model.pt?versionId=v1")
    assert other.latest() == 1 and fs.find("ckpt/exp1") == [
        "ckpt/exp1/step_00000001/MANIFEST.json",
        "ckpt/exp1/step_00000001/state.pt",
    ]
    ranksafe.remote.Remote.of("http://127.0.0.1:9/model.pt?signature=x")  # a query is part of an http URL
    fs.rm("ckpt/exp[1]", recursive=True)  # the control: what a removal of that prefix does
    assert fs.find("ckpt/exp1") == []


def test_a_url_with_an_empty_folder_name_is_refused_before_anything_is_written(s3):
    """Before: a manager on s3://ckpt//run (f"s3://{bucket}/{prefix}" with a prefix "/run") committed its steps under
    the keys "/run/step_...", which no listing of the URL finds: latest() was None after four saves, load() found no
    step, and keep=2 removed none."""
    import s3fs

    fs = s3fs.S3FileSystem()
    before = fs.find("ckpt")  # what other tests of the module left there
    with pytest.raises(ValueError, match=r"s3://ckpt//run \(rank 0\): an empty folder name"):
        ranksafe.CheckpointManager("s3://ckpt//run", keep=2)
    with pytest.raises(ValueError, match="an empty folder name"):
        ranksafe.save({"w": torch.ones(1)}, "s3://ckpt/exp//model.pt")
    assert fs.find("ckpt") == before
    fs.pipe("ckpt//run/x", b"1")  # the control: what the store does with such a name
    assert fs.find("ckpt/run") == [] and "ckpt//run/x" in fs.find("ckpt")
    fs.rm("ckpt//run/x")


def test_prepare_dir_on_a_bucket_removes_its_objects_and_keeps_the_bucket(s3):
    """Before: s3fs's recursive rm of the bucket's URL deleted the bucket itself, with every version of its objects,
    and made a new one: its settings (versioning here) were gone."""
    import s3fs

    from tests.s3 import make_bucket

    make_bucket("whole")
    fs = s3fs.S3FileSystem()
    fs.call_s3("put_bucket_versioning", Bucket="whole", VersioningConfiguration={"Status": "Enabled"})
    ranksafe.save({"w": torch.ones(1)}, "s3://whole/a/model.pt")
    ranksafe.prepare_dir("s3://whole", overwrite=True)
    fs.invalidate_cache()
    assert fs.find("whole") == []
    assert fs.call_s3("get_bucket_versioning", Bucket="whole").get("Status") == "Enabled"  # the same bucket
    fs.pipe("whole/x", b"1")
    fs.rm("whole", recursive=True)  # the control
    fs.invalidate_cache()
    assert not fs.exists("whole")


def test_a_save_onto_a_prefix_that_holds_objects_is_refused_on_s3_too(s3):
    """Before: on S3 the object was written beside the prefix, and ``ranksafe verify`` of the URL then reported that
    file, hiding the checkpoints below it; memory:// and local folders raised."""
    ranksafe.CheckpointManager("s3://ckpt/held", keep=None).save(1, _state(1))
    with pytest.raises(IsADirectoryError, match=r"cannot save s3://ckpt/held \(rank 0\)"):
        ranksafe.save({"w": torch.ones(1)}, "s3://ckpt/held")


def test_a_bucket_that_does_not_exist_is_an_error_not_a_root_without_checkpoints(s3):
    """Before: latest() was None on s3://ckpt-typo/run, so a resume started the run afresh (failing only at its first
    save), and ``ranksafe ls`` reported "(no step directories)" with exit status 0."""
    for call in (
        ranksafe.CheckpointManager("s3://ckpt-typo/run").latest,
        lambda: ranksafe.list_steps("s3://ckpt-typo/run"),
    ):
        with pytest.raises(FileNotFoundError, match=r"no such bucket: ckpt-typo"):
            call()
    assert ranksafe.CheckpointManager("s3://ckpt/fresh").latest() is None  # an empty prefix of a bucket that exists


def _s3_ranks(rank, url, missing):
    ranksafe.save({"w": torch.full((3,), 7.0)}, url)
    out = {"loaded": ranksafe.load(url)["w"].tolist()}
    try:
        ranksafe.save({"w": torch.ones(1)}, missing)
        out["missing"] = "saved"
    except FileNotFoundError as e:
        out["missing"] = f"{type(e).__name__}: {e}"
    saver = ranksafe.AsyncSaver()
    try:
        saver.warmup({"w": torch.ones(1)}, "s3://no-such-bucket/run")
        out["warmup"] = "ok"
    except FileNotFoundError as e:
        out["warmup"] = f"{type(e).__name__}: {e}"
    saver.warmup({"w": torch.ones(1)}, "s3://ckpt/async")
    saver.save({"w": torch.full((2,), float(rank))}, "s3://ckpt/async/state.pth")
    saver.close()
    out["async"] = ranksafe.load("s3://ckpt/async/state.pth")["w"].tolist()
    return out


def test_s3_on_two_ranks_one_writer_shared_failures(s3):
    url, missing = "s3://ckpt/ranks/model.pth", "s3://no-such-bucket/model.pth"
    values = run_ranks(_s3_ranks, 2, args=(url, missing), env=s3, timeout=120).values
    for out in values:
        assert out["loaded"] == [7.0, 7.0, 7.0]
        assert out["missing"].startswith("RankFailure[FileNotFoundError]: save s3://no-such-bucket/model.pth failed")
        assert "rank 0: FileNotFoundError: cannot save s3://no-such-bucket/model.pth (rank 0)" in out["missing"]
        assert "cannot write checkpoints to s3://no-such-bucket/run (rank 0)" in out["warmup"]
        assert out["async"] == [0.0, 0.0], "rank 0 is the one writer"


# --- CheckpointManager on remote storage ------------------------------------------------------------------------


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


def test_manager_on_memory_commits_by_manifest_keeps_the_newest_and_ignores_debris(memory):
    mgr = ranksafe.CheckpointManager("memory://run", keep=2)
    mgr.warmup(_state(0))
    for step in (1, 2, 3):
        assert mgr.save(step, _state(step)) == f"memory://run/step_{step:08d}"
    assert mgr.latest() == 3 and mgr.load()["step"] == 3
    assert [s.step for s in ranksafe.list_steps("memory://run")] == [2, 3]
    assert ranksafe.verify_step("memory://run/step_00000003")["step"] == 3
    # a killed save leaves files without a manifest: not committed, never loaded, removed by the next save
    memory.pipe_file("/run/step_00000009/state.pt", b"half an upload")
    assert [(s.step, s.status) for s in ranksafe.list_steps("memory://run")][-1] == (9, "incomplete")
    assert mgr.latest() == 3
    mgr.save(4, _state(4))
    assert memory.ls("/run", detail=False) == ["/run/step_00000003", "/run/step_00000004"]
    # a flipped byte is found by the load's verification
    data = bytearray(memory.cat_file("/run/step_00000004/state.pt"))
    data[100] ^= 1
    memory.pipe_file("/run/step_00000004/state.pt", bytes(data))
    with pytest.raises(ranksafe.CorruptCheckpoint, match=r"step_00000004/state\.pt: checksum mismatch"):
        mgr.load()
    with pytest.warns(RuntimeWarning, match="falling back to step 3") as warned:
        assert mgr.load(fallback=True)["step"] == 3
    assert warned[0].filename == __file__  # the warning points at the caller's load()


def test_a_committed_step_is_not_saved_again_on_remote_storage_where_a_failed_save_would_lose_it(memory):
    """Before: with no rename, a save of a committed step's number removed it before writing, and any failure (here
    a value that does not pickle) left no copy of that step: latest() was None."""
    mgr = ranksafe.CheckpointManager("memory://run")
    mgr.save(1, _state(1))
    with pytest.raises(ValueError, match=r"step 1 is committed under memory://run already.*new step number"):
        mgr.save(1, {"step": _Unpicklable()})
    assert mgr.latest() == 1 and mgr.load()["step"] == 1
    mgr.save(2, _state(2))
    data = bytearray(memory.cat_file("/run/step_00000002/state.pt"))
    data[100] ^= 1
    memory.pipe_file("/run/step_00000002/state.pt", bytes(data))
    with pytest.warns(RuntimeWarning, match="falling back to step 1"):
        assert mgr.load(fallback=True)["step"] == 1
    mgr.save(2, _state(2))  # a damaged step holds nothing to lose: saved again, it loads
    assert mgr.load()["step"] == 2


def test_manager_on_memory_saves_in_the_background(memory):
    mgr = ranksafe.CheckpointManager("memory://bg", keep=None, async_save=True)
    for step in (1, 2):
        mgr.save(step, _state(step))
    mgr.close()
    assert mgr.latest() == 2 and mgr.load(1)["step"] == 1


def _manager_on_s3(rank, root):
    mgr = ranksafe.CheckpointManager(root, keep=2)
    out = {}
    try:
        ranksafe.CheckpointManager("s3://no-such-bucket/run").warmup()
    except FileNotFoundError as e:
        out["warmup"] = str(e)
    mgr.warmup(_state(0))
    for step in (1, 2, 3):
        with mgr.saving(step, {"state.pt": _state(step)}) as tx:
            tx.save({"rank": rank}, f"rank-{rank}.pt")  # every rank's own file, in the same step
    out["latest"] = mgr.latest()
    out["loaded"] = mgr.load()["step"]
    out["files"] = sorted(ranksafe.verify_step(mgr.step_dir(3))["files"])
    if rank == 0:  # the bucket goes away under a running job: the next upload fails
        import s3fs

        s3fs.S3FileSystem().rm("ckpt-gone", recursive=True)
    ranksafe.barrier("bucket removed")
    try:
        ranksafe.CheckpointManager("s3://ckpt-gone/run").save(1, _state(1))
    except FileNotFoundError as e:
        out["failed put"] = f"{type(e).__name__}: {e}"
    try:  # fsspec's memory store lives in one process: warmup finds out before anything is trusted to it
        ranksafe.CheckpointManager("memory://per-process").warmup()
    except FileNotFoundError as e:
        out["memory"] = str(e)
    out["memory left"] = fsspec.filesystem("memory").find("/per-process")  # the probe is gone
    return out


def test_manager_on_s3_on_two_ranks(s3):
    make_bucket("ckpt-gone")
    values = run_ranks(_manager_on_s3, 2, args=("s3://ckpt/two",), env=s3, timeout=180).values
    for out in values:
        assert "cannot write checkpoints to s3://no-such-bucket/run (rank 0)" in out["warmup"]
        assert out["latest"] == 3 and out["loaded"] == 3
        assert out["files"] == ["rank-0.pt", "rank-1.pt", "state.pt"]
        # found missing by the writer's listing, before anything is written (before: at the upload of state.pt)
        assert out["failed put"].startswith("RankFailure[FileNotFoundError]: checkpoint 1: create failed on rank 0")
        assert "cannot save step 1 under s3://ckpt-gone/run (rank 0): no such bucket: ckpt-gone" in out["failed put"]
        assert "memory://per-process (rank 1) does not see what rank 0 wrote" in out["memory"]
        assert out["memory left"] == []
    assert [s.step for s in ranksafe.list_steps("s3://ckpt/two")] == [2, 3]


_KILLED_WRITER = """
import sys, torch, ranksafe
mgr = ranksafe.CheckpointManager(sys.argv[1], keep=None)
mgr.save(1, {"w": torch.ones(4)})
with mgr.saving(2, {"state.pt": {"w": torch.zeros(16_000_000)}}) as tx:  # 64 MB: many parts to upload
    tx.save(b"side file", "side.bin")
"""


def test_a_writer_killed_mid_upload_leaves_no_step_that_loads_and_the_next_save_cleans_up(s3, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    import s3fs

    fs = s3fs.S3FileSystem()
    results = {"ranksafe": 0, "naive": 0}
    kills = 2
    for attempt in range(kills):
        root = f"s3://ckpt/killed-{attempt}"
        child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, root], env={**os.environ, **s3})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the big upload is under way
            uploads = fs.call_s3("list_multipart_uploads", Bucket="ckpt").get("Uploads", [])
            if any(u["Key"] == f"killed-{attempt}/step_00000002/state.pt" for u in uploads):
                break
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        fs.invalidate_cache()
        prefixes = fs.ls(root[len("s3://") :], detail=False)
        naive = max(int(p.rsplit("_", 1)[1]) for p in prefixes)  # the newest step directory there is
        results["naive"] += naive == 2
        mgr = ranksafe.CheckpointManager(root, keep=None)
        results["ranksafe"] += mgr.latest() == 2
        assert mgr.latest() == 1 and torch.equal(mgr.load()["w"], torch.ones(4))
        mgr.save(3, _state(3))  # the writer's next save removes the debris
        assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root[len("s3://") :], detail=False, refresh=True)) == [
            "step_00000001",
            "step_00000003",
        ]
    print(f"{kills} writers killed mid-upload; steps taken for the latest although torn:", results)
    assert results == {"ranksafe": 0, "naive": kills}


def test_the_command_line_verifies_and_lists_remote_steps(memory, capsys):
    from ranksafe import cli

    mgr = ranksafe.CheckpointManager("memory://cli", keep=None)
    mgr.save(1, _state(1))
    ranksafe.save({"w": 1}, "memory://cli/model.pth")
    assert cli.main(["verify", "memory://cli/step_00000001"]) == 0
    assert cli.main(["verify", "memory://cli/model.pth"]) == 0
    assert cli.main(["ls", "memory://cli"]) == 0
    out = capsys.readouterr().out
    assert "OK memory://cli/step_00000001: step 1, 1 files" in out and "OK memory://cli/model.pth: " in out
    assert "committed" in out and "memory://cli/step_00000001" in out
    memory.pipe_file("/cli/step_00000001/state.pt", b"torn")
    assert cli.main(["verify", "memory://cli/step_00000001"]) == 1
    assert cli.main(["ls", "memory://cli"]) == 1
    assert "size is 4 bytes, the manifest says" in capsys.readouterr().err + ""


def test_a_reader_sees_a_step_commit_that_another_client_wrote_after_the_reader_listed_it(s3):
    """s3fs answers exists() and size() from its last listing of the parent. A reader (an eval job polling a running
    job's root) that listed a step while it was written saw it incomplete for good: latest() stayed at the step
    before. The writer here is a client of its own, as another process's would be."""
    root = "s3://ckpt/reader"
    writer = ranksafe.CheckpointManager(root, keep=None, storage_options={"skip_instance_cache": True})
    writer.save(1, {"w": torch.ones(2)})
    with writer.saving(2, {"state.pt": {"w": torch.zeros(2)}}) as step:
        step.save(b"side", "side.bin")  # an object under the step's prefix, and no manifest yet
        during = [(s.step, s.status.value) for s in ranksafe.list_steps(root)]
    after = [(s.step, s.status.value) for s in ranksafe.list_steps(root)]
    assert during == [(1, "committed"), (2, "incomplete")]
    assert after == [(1, "committed"), (2, "committed")]
    assert ranksafe.CheckpointManager(root, keep=None).latest() == 2
