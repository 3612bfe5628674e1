"""Two inputs that used to "succeed" somewhere else than asked: a URL written as a local folder, and a sharded
DTensor saved as one rank's shard. Both are now a clear error on every rank, before anything is written, except
where a sharded DTensor can be saved whole: a CheckpointManager step, where every rank writes its shards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ranksafe
from ranksafe.files import local_path
from tests.ranks import run_ranks

URLS = ["gs://bucket/run/model.pth", "az://container/model.pth", "nosuch://bucket/model.pth"]


@pytest.mark.parametrize("url", [*URLS, Path("gs://bucket/run/model.pth")], ids=str)
def test_a_url_no_file_system_serves_is_refused_and_no_local_folder_named_after_it_appears(tmp_path, monkeypatch, url):
    # the control: the pattern ranksafe had (make the parent, then save) "succeeds" into a local folder
    control = tmp_path / "control"
    control.mkdir()
    monkeypatch.chdir(control)
    os.makedirs(os.path.dirname(os.fspath(url)), exist_ok=True)
    torch.save({"w": torch.ones(2)}, os.fspath(url))
    assert os.listdir(control) == [os.fspath(url).split(":")[0] + ":"], "the control must write a local folder"
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    calls = [
        lambda: ranksafe.save({"w": torch.ones(2)}, url),
        lambda: ranksafe.load(url),
        lambda: ranksafe.prepare_dir(url),
        lambda: ranksafe.atomic_save({"w": torch.ones(2)}, url),
        lambda: ranksafe.AsyncSaver().save({"w": torch.ones(2)}, url),
        lambda: ranksafe.verify_file(url),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"\(rank 0\): no file system for (gs|az|nosuch)://"):
            call()
    assert sorted(os.listdir(tmp_path)) == before, "nothing may be written under the working directory"


def test_a_url_pathlib_mangled_is_still_the_url_and_file_urls_are_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ranksafe.save({"w": torch.ones(2)}, Path("memory://refused/model.pth"))  # pathlib prints memory:/refused/...
    assert torch.equal(ranksafe.load("memory://refused/model.pth")["w"], torch.ones(2))
    assert os.listdir(tmp_path) == []
    target = tmp_path / "a b" / "model.pth"
    ranksafe.save({"w": torch.ones(2)}, f"file://{target}")
    assert torch.equal(ranksafe.load(target.as_uri())["w"], torch.ones(2))
    assert local_path(Path(f"file://{target}")) == str(target)  # pathlib's "file:/..." too
    assert local_path("C:/data/x.pth") == "C:/data/x.pth"  # a drive letter is no scheme


def _url_on_every_rank(rank, url, root):
    os.chdir(root)
    outcome = {}
    for name, call in (
        ("save", lambda: ranksafe.save({"w": torch.ones(2)}, url)),
        ("load", lambda: ranksafe.load(url)),
    ):
        try:
            call()
            outcome[name] = "saved"
        except ValueError as e:
            outcome[name] = f"ValueError: {e}"
    ranksafe.barrier("after")  # the ranks are still in step: nothing was half-done
    return outcome


def test_a_url_without_a_file_system_fails_every_rank_at_once(tmp_path):
    values = run_ranks(_url_on_every_rank, 2, args=("gs://bucket/run", str(tmp_path)), timeout=60).values
    for rank, outcome in enumerate(values):
        for name, said in outcome.items():
            assert said.startswith(f"ValueError: gs://bucket/run (rank {rank}): no file system"), (rank, name, said)
    assert os.listdir(tmp_path) == []


# --- sharded DTensors ---------------------------------------------------------------------------------


def _sharded(rank, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (4,))
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    w = distribute_tensor(full, mesh, [Shard(0)])
    out = {}
    # the control: rank 0 writes the state as torch.save sees it, which keeps rank 0's two rows only
    if rank == 0:
        torch.save({"w": w}, os.path.join(root, "naive.pt"))
    ranksafe.barrier("naive written")
    naive = torch.load(os.path.join(root, "naive.pt"), weights_only=False)["w"]
    out["naive rows"] = naive.to_local().shape[0]
    manager = ranksafe.CheckpointManager(os.path.join(root, "ckpt"))
    for name, call in (
        ("manager", lambda: manager.save(1, {"model": {"w": w}, "epoch": 3})),
        ("extra file", lambda: manager.save(2, {"epoch": 3}, extra_files={"w.pt": {"w": w}})),
        ("save", lambda: ranksafe.save({"w": w}, os.path.join(root, "model.pt"))),
        ("async", lambda: ranksafe.AsyncSaver().save({"w": w}, os.path.join(root, "async.pt"))),
    ):
        try:
            call()
            out[name] = "saved"
        except ValueError as e:  # RankFailure[ValueError] for the collectives, ValueError for the local call
            out[name] = f"{type(e).__name__}: {e}"
    out["latest"] = manager.latest()
    into = {"model": {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])}, "epoch": 0}
    manager.load(into=into)
    out["loaded"] = (into["model"]["w"].full_tensor().tolist(), into["epoch"])
    out["full"] = full.tolist()
    # per-rank shards stay possible: every rank writes its own
    manager.save(2, {"w": w}, sharded=True)
    out["own shard"] = manager.load(2, sharded=True, weights_only=False)["w"].to_local().tolist()
    out["expected shard"] = w.to_local().tolist()
    return out


def test_a_sharded_dtensor_is_saved_whole_by_a_manager_and_refused_by_one_writer_on_every_rank(tmp_path):
    values = run_ranks(_sharded, 4, args=(str(tmp_path),), timeout=120).values
    for rank, out in enumerate(values):
        assert out["naive rows"] == 2, "the control must show one rank's shard only: 2 of 8 rows"
        assert out["manager"] == "saved" and out["latest"] == 1  # every rank wrote its shards
        assert out["loaded"] == (out["full"], 3)
        for name in ("extra file", "save", "async"):  # what one writer writes whole is refused
            said = out[name]
            assert "sharded tensors ('" in said and "Shard(dim=0)" in said, (rank, name, said)
            assert "in a dict with CheckpointManager.save(step, {'model'" in said  # not "the call you just made"
        assert "RankFailure[ValueError]" in out["extra file"] and "ranks 0, 1, 2, 3" in out["extra file"]
        assert out["own shard"] == out["expected shard"]
    assert not os.path.exists(tmp_path / "model.pt") and not os.path.exists(tmp_path / "async.pt")


def _sharded_tensor(rank: int, fill: float, ranks: int = 2) -> torch.Tensor:
    """FSDP1's sharded tensor (what its sharded state dict holds): rows 0-3 on rank 0, rows 4-7 on rank 1; with
    ``ranks=1``, 4 rows on rank 0 alone (FSDP1 chunks a small bias so)."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    placements = [f"rank:{r}/cpu" for r in range(ranks)]
    st = sharded_tensor.empty(ChunkShardingSpec(dim=0, placements=placements), 4 * ranks, 4)
    for shard in st.local_shards():
        shard.tensor.copy_(torch.arange(16.0).reshape(4, 4) + 16 * rank + fill)
    return st


def _local(st) -> list:
    return [shard.tensor.tolist() for shard in st.local_shards()]


def _sharded_tensors(rank, root):
    import warnings

    warnings.simplefilter("ignore")  # ShardedTensor is deprecated in favour of DTensor
    st, bias = _sharded_tensor(rank, 0.0), _sharded_tensor(rank, 0.0, ranks=1)
    out = {"expected": (_local(st), _local(bias))}
    # the control: rank 0 writes the state as torch.save sees it, which keeps rank 0's rows only
    if rank == 0:
        torch.save({"w": st}, os.path.join(root, "naive.pt"))
    ranksafe.barrier("naive written")
    if rank == 0:
        out["naive rows"] = [
            tuple(s.tensor.shape)
            for s in torch.load(os.path.join(root, "naive.pt"), weights_only=False)["w"].local_shards()
        ]
    manager = ranksafe.CheckpointManager(os.path.join(root, "ckpt"))
    manager.save(1, {"model": {"w": st, "b": bias}, "epoch": 3})
    into = {"model": {"w": _sharded_tensor(rank, 100.0), "b": _sharded_tensor(rank, 100.0, ranks=1)}, "epoch": 0}
    manager.load(into=into)
    out["loaded"] = ((_local(into["model"]["w"]), _local(into["model"]["b"])), into["epoch"])
    background = ranksafe.CheckpointManager(os.path.join(root, "async"), async_save=True)
    for name, call in (
        ("async manager", lambda: background.save(1, {"model": {"w": st}})),
        ("save", lambda: ranksafe.save({"w": st}, os.path.join(root, "model.pt"))),
        ("one shard", lambda: ranksafe.save({"b": bias}, os.path.join(root, "bias.pt"))),
        ("async", lambda: ranksafe.AsyncSaver().save({"w": st}, os.path.join(root, "async.pt"))),
    ):
        try:
            call()
            out[name] = "saved"
        except ValueError as e:
            out[name] = f"{type(e).__name__}: {e}"
    out["async steps"] = background.latest()
    return out


def test_fsdp1_sharded_tensors_are_saved_whole_by_a_manager_and_refused_by_one_writer(tmp_path):
    """Before: CheckpointManager.save said "saved" on both ranks and wrote rank 0's four rows only; a load on rank 1
    raised "Local rank at save time was 0, but at load time was 1", and ranksafe.save kept rank 0's rows too. Now a
    step holds every rank's shard (through DCP, as for DTensors); an asynchronous one is refused on every rank."""
    values = run_ranks(_sharded_tensors, 2, args=(str(tmp_path),), timeout=120).values
    assert values[0]["naive rows"] == [(4, 4)], "the control must show one rank's shard only: 4 of 8 rows"
    for rank, out in enumerate(values):
        assert out["loaded"] == (out["expected"], 3), rank  # every rank wrote its shard, and reads it back
        for name in ("save", "async"):
            assert "sharded tensors ('w' ShardedTensor in 2 shards)" in out[name], (rank, name, out[name])
        # one shard is still one rank's: its pickle loads on that rank only
        assert "sharded tensors ('b' ShardedTensor in 1 shard)" in out["one shard"], (rank, out["one shard"])
        said = out["async manager"]  # its snapshot cannot copy one: refused on every rank, nothing committed
        assert "RankFailure[ValueError]" in said and "ranks 0, 1" in said and "cannot be snapshotted" in said, said
        assert out["async steps"] is None
    assert not {"model.pt", "bias.pt", "async.pt"} & set(os.listdir(tmp_path))


def test_a_state_that_holds_itself_is_saved_where_dtensors_may_be(tmp_path):
    """Before: once torch.distributed.tensor was imported (DCP, FSDP2 and many libraries import it), the search for
    sharded tensors recursed into a state holding itself until RecursionError, in AsyncSaver.save and in a save of
    the manager."""
    import torch.distributed.tensor  # what makes every save look for DTensors

    state = {"w": torch.ones(2)}
    state["self"] = state
    assert ranksafe.sharded.sharded_tensors(state) == {} and ranksafe.sharded.for_dcp(state) is None
    manager = ranksafe.CheckpointManager(tmp_path / "ckpt", async_save=True)
    manager.save(1, state)
    loaded = manager.load(weights_only=False)
    manager.close()
    assert loaded["self"] is loaded and torch.equal(loaded["w"], state["w"])


def _dtensor_on_rank_0_only(rank, root, async_save):
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(torch.arange(8.0).reshape(4, 2), init_device_mesh("cpu", (2,)), [Shard(0)])
    manager = ranksafe.CheckpointManager(root, async_save=async_save)
    start = time.monotonic()
    try:  # rank 0 would write its shards through DCP, rank 1 a state.pt from one writer: each waits for the other
        manager.save(1, {"model": {"w": w if rank == 0 else w.to_local()}})
        manager.wait()
        said = "saved"
    except ranksafe.RankFailure as e:
        said = f"{type(e).__name__}: {e}"
    out = {"said": said, "seconds": time.monotonic() - start, "latest": manager.latest()}
    manager.save(2, {"model": {"w": w}})  # agreed again: the manager goes on
    out["after"] = manager.latest()
    return out


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_dtensor_on_some_ranks_only_fails_every_rank_at_once_instead_of_a_wait(tmp_path, async_save):
    ranks = run_ranks(_dtensor_on_rank_0_only, 2, args=(str(tmp_path), async_save), env={"RANKSAFE_TIMEOUT": "30"})
    for out in ranks.values:
        said = out["said"]
        assert said.startswith("CollectiveMismatch: checkpoint 1: create"), said
        assert "rank 0: CollectiveMismatch: was in 'outcome:checkpoint 1: create, a state with DTensors'" in said, said
        assert "rank 1: CollectiveMismatch: was in 'outcome:checkpoint 1: create, no DTensors'" in said, said
        assert out["seconds"] < 15, out  # half the timeout: an error at once, not a wait (before: the timeout)
        assert (out["latest"], out["after"]) == (None, 2)
