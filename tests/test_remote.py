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


def test_a_url_without_a_file_system_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"gs://bucket/m.pth \(rank 0\): no file system for gs://"):
        ranksafe.save({"w": 1}, "gs://bucket/m.pth")
    assert os.listdir(tmp_path) == []


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
