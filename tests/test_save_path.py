"""The fast path of atomic_save: torch's zip CRCs skipped only for our save, the footer CRC hashed in a helper
thread while the bytes are written, early writeback. Each must leave every guarantee of the slow path intact.
One process (plus forked / spawned children where the point is a process boundary)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
import zipfile
import zlib

import pytest
import torch

import ranksafe
from ranksafe import checkpoint_file
from ranksafe.errors import CorruptCheckpoint

_BIG = 3 * (1 << 20) // 4  # float32 elements in 3 MiB: above the size hashed in the helper thread


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Records below and above the helper-thread threshold, so both paths feed one running CRC."""
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(_BIG, generator=g),
        "small": torch.randn(100, generator=g),
        "big2": torch.randn(_BIG, generator=g),
    }


def _zip_crcs(path) -> list[int]:
    with zipfile.ZipFile(path) as z:
        return [info.CRC for info in z.infolist() if info.filename.split("/", 1)[-1].startswith("data/")]


@pytest.fixture(autouse=True)
def _zip_crc_option_back_to_default():
    yield
    torch.serialization.set_crc32_options(True)


def test_footer_crc_is_the_crc_of_every_byte(tmp_path):
    path = tmp_path / "m.pt"
    ranksafe.atomic_save(_state(), path)
    data = path.read_bytes()
    payload, footer = data[: -checkpoint_file._FOOTER.size], data[-checkpoint_file._FOOTER.size :]
    _, length, crc, _ = checkpoint_file._FOOTER.unpack(footer)
    assert (length, crc) == (len(payload), zlib.crc32(payload))
    assert checkpoint_file.verify_file(path) is True


@pytest.mark.parametrize("before", [True, False])
def test_zip_crcs_skipped_for_our_save_only_and_option_restored(tmp_path, before):
    torch.serialization.set_crc32_options(before)
    ranksafe.atomic_save(_state(), tmp_path / "ours.pt")
    assert torch.serialization.get_crc32_options() is before
    torch.save(_state(), tmp_path / "stock.pt")
    assert _zip_crcs(tmp_path / "ours.pt") and set(_zip_crcs(tmp_path / "ours.pt")) == {0}
    assert all(_zip_crcs(tmp_path / "stock.pt")) is before  # a plain torch.save after ours: the caller's choice
    loaded = torch.load(tmp_path / "ours.pt", weights_only=True)  # stock torch reads files without zip CRCs
    assert all(torch.equal(loaded[k], v) for k, v in _state().items())


def test_option_restored_and_lock_free_after_a_failing_save(tmp_path):
    with pytest.raises(Exception, match="pickle"):
        ranksafe.atomic_save({"f": lambda: 0}, tmp_path / "bad.pt")  # fails while pickling: before any write
    assert torch.serialization.get_crc32_options() is True
    assert not checkpoint_file._zip_crc_lock.locked()
    assert os.listdir(tmp_path) == []
    ranksafe.atomic_save(_state(), tmp_path / "ok.pt")  # the next save is not blocked
    assert checkpoint_file.verify_file(tmp_path / "ok.pt")


_FSIZE_CHILD = textwrap.dedent(
    """
    import resource, sys, torch, ranksafe
    from ranksafe import checkpoint_file
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
    try:
        ranksafe.atomic_save({"w": torch.zeros(1 << 22)}, sys.argv[1])  # 16 MiB: fails inside a large write
    except OSError as e:
        print("ERR", e.errno, torch.serialization.get_crc32_options(), checkpoint_file._zip_crc_lock.locked())
    """
)


def test_write_failing_mid_record_raises_the_oserror_and_restores_the_option(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(tmp_path / "m.pt"), str(4 << 20)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # torch's zip writer would have turned this into RuntimeError("unexpected pos ..."): we raise the cause
    assert out.stdout.split() == ["ERR", "27", "True", "False"], out.stderr
    assert os.listdir(tmp_path) == []


def test_bit_flip_in_a_large_record_is_detected_though_torch_load_accepts_it(tmp_path):
    path = tmp_path / "m.pt"
    ranksafe.atomic_save(_state(), path)
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0x10  # inside "big2"'s bytes (written last), hashed by the helper thread
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path, weights_only=True)["big2"], _state()["big2"])  # loads wrong values
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        ranksafe.load_file(path)


def test_concurrent_saves_from_threads_are_all_valid(tmp_path):
    errors: list[BaseException] = []

    def saver(k: int) -> None:
        try:
            for i in range(4):
                ranksafe.atomic_save(_state(seed=k), tmp_path / f"t{k}-{i}.pt")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=saver, args=(k,)) for k in range(1, 4)]
    for t in threads:
        t.start()
    saver(0)  # the main thread saves too, with its hashing helper
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and not any(t.is_alive() for t in threads)
    for k in range(4):
        for i in range(4):
            path = tmp_path / f"t{k}-{i}.pt"
            assert checkpoint_file.verify_file(path) is True
            assert set(_zip_crcs(path)) == {0}
            assert torch.equal(ranksafe.load_file(path)["big"], _state(seed=k)["big"])
    assert torch.serialization.get_crc32_options() is True and not checkpoint_file._zip_crc_lock.locked()


class _CrcSpy:
    """Stands in for the zlib module inside ranksafe.checkpoint_file: records which thread computed each CRC."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def crc32(self, data, value: int = 0) -> int:
        self.threads.append(threading.current_thread().name)
        return zlib.crc32(data, value)


def test_helper_thread_hashes_for_main_thread_saves_only_and_is_gone_after(tmp_path, monkeypatch):
    spy = _CrcSpy()
    monkeypatch.setattr(checkpoint_file, "zlib", spy)
    threads_before = threading.active_count()
    ranksafe.atomic_save(_state(), tmp_path / "main.pt")
    assert threading.active_count() == threads_before  # the helper ended with the save
    helped = [n for n in spy.threads if n.startswith("ranksafe-crc")]
    assert len(helped) == 2 and len(spy.threads) > 2  # the two 3 MiB records; the small ones inline

    spy.threads.clear()
    background = threading.Thread(target=ranksafe.atomic_save, args=(_state(), tmp_path / "bg.pt"), name="bg")
    background.start()
    background.join(timeout=60)
    assert spy.threads and set(spy.threads) == {"bg"}  # an off-main-thread save hashes inline
    monkeypatch.undo()
    assert checkpoint_file.verify_file(tmp_path / "main.pt") and checkpoint_file.verify_file(tmp_path / "bg.pt")


def test_large_saves_start_writeback_and_non_files_are_fine(tmp_path, monkeypatch):
    if sys.platform == "linux":
        assert hasattr(os, "posix_fadvise")
    calls: list[tuple[int, int]] = []
    real = checkpoint_file._start_writeback
    record = lambda fd, offset: (calls.append((fd, offset)), real(fd, offset))  # noqa: E731
    monkeypatch.setattr(checkpoint_file, "_start_writeback", record)
    monkeypatch.setattr(checkpoint_file, "_WRITEBACK", 2 << 20)
    ranksafe.atomic_save(_state(), tmp_path / "m.pt")
    assert len(calls) >= 2 and [o for _, o in calls] == sorted(o for _, o in calls)
    assert checkpoint_file.verify_file(tmp_path / "m.pt")
    sink = io.BytesIO()  # a stream without a file descriptor: checksummed, no writeback asked
    before = len(calls)
    w = checkpoint_file.ChecksummingWriter(sink)
    torch.save(_state(), w)
    assert len(calls) == before and w.crc == zlib.crc32(sink.getvalue()) and w.length == len(sink.getvalue())
