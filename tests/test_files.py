"""Local file layer: atomic commit, integrity footer, clear errors for bad input. One process."""

from __future__ import annotations

import io
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest
import torch

import ranksafe
from ranksafe.checkpoint_file import ChecksummingWriter
from ranksafe.files import TMP_SUFFIX, _host_tag, clean_orphans


def _state(scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g) * scale, "step": torch.tensor(7)}


def _debris(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.endswith(TMP_SUFFIX)]


def test_atomic_save_round_trip_and_stock_torch_load(tmp_path):
    path = tmp_path / "model.pth"
    ranksafe.atomic_save(_state(), path)
    assert ranksafe.verify_file(path) is True
    assert torch.equal(ranksafe.load_file(path)["w"], _state()["w"])
    assert torch.equal(torch.load(path, weights_only=True)["w"], _state()["w"])  # stock torch still reads it
    assert _debris(tmp_path) == []


def test_published_file_gets_the_usual_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        ranksafe.atomic_save(_state(), tmp_path / "a.pth")
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "a.pth").st_mode & 0o777) == oct(0o640)  # not mkstemp's 0600


def test_exception_inside_atomic_write_leaves_target_untouched(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("committed\n")
    with pytest.raises(ZeroDivisionError), ranksafe.atomic_write(path, "w") as f:
        f.write("partial")
        raise ZeroDivisionError
    assert path.read_text() == "committed\n"
    assert _debris(tmp_path) == []


@pytest.mark.parametrize("mode", ["ab", "a", "xb", "r+b"])
def test_atomic_write_refuses_a_mode_that_would_not_write_a_whole_new_file(tmp_path, mode):
    """Before: "ab" replaced the file with what the block wrote (its old rows were gone), "xb" replaced a file that
    existed instead of raising FileExistsError."""
    log = tmp_path / "log.csv"
    log.write_bytes(b"epoch,loss\n0,0.9\n")
    with pytest.raises(ValueError, match=f"not mode '{re.escape(mode)}'"), ranksafe.atomic_write(log, mode) as f:
        f.write(b"1,0.5\n")
    assert log.read_bytes() == b"epoch,loss\n0,0.9\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_sound_file_that_cannot_be_mapped_here_is_not_called_corrupt(tmp_path):
    """Before: a verified file loaded with map_location="cuda" on a machine without one raised CorruptCheckpoint,
    which tells the user to throw a good file away. Now torch's own error passes through."""
    path = tmp_path / "m.pth"
    ranksafe.atomic_save({"w": torch.ones(2)}, path)
    with pytest.raises(RuntimeError, match="CUDA") as raised:
        ranksafe.load_file(path, map_location="cuda")
    assert not isinstance(raised.value, ranksafe.CorruptCheckpoint)
    assert ranksafe.load_file(path)["w"].tolist() == [1.0, 1.0]


def test_a_home_relative_path_is_expanded_and_a_folders_path_refused(tmp_path, monkeypatch):
    """Before: save("~/m.pth") wrote into a folder named "~" under the working directory, while the manager and
    ModelCheckpoint expand it; and "out/" wrote a file named "out" (torch.save refuses that path)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    ranksafe.save({"w": 1}, "~/run/m.pth")
    assert os.listdir(tmp_path) == ["home"] and ranksafe.load("~/run/m.pth", weights_only=False) == {"w": 1}
    with pytest.raises(IsADirectoryError, match="a file's path, not a directory's"):
        ranksafe.atomic_save({"w": 1}, "out/")
    assert not os.path.exists(tmp_path / "out")


def test_bit_flip_is_detected_though_torch_load_accepts_it(tmp_path):
    path = tmp_path / "m.pth"
    ranksafe.atomic_save(_state(), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    stock = torch.load(path, weights_only=True)  # the control: stock loading silently returns wrong values
    assert not torch.equal(stock["w"], _state()["w"])
    with pytest.raises(ranksafe.CorruptCheckpoint, match="checksum mismatch") as e:
        ranksafe.load_file(path)
    assert e.value.path == str(path)


@pytest.mark.parametrize("cut", [1, 100, 0.5])
def test_truncated_file_is_corrupt_and_named(tmp_path, cut):
    path = tmp_path / "m.pth"
    ranksafe.atomic_save(_state(), path)
    data = path.read_bytes()
    keep = int(len(data) * cut) if isinstance(cut, float) else len(data) - cut
    path.write_bytes(data[:keep])
    with pytest.raises(ranksafe.CorruptCheckpoint, match=re.escape(str(path))):
        ranksafe.load_file(path)


def test_stock_file_truncated_is_corrupt(tmp_path):
    path = tmp_path / "stock.pth"
    torch.save(_state(), path)
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(ranksafe.CorruptCheckpoint, match=r"stock\.pth"):
        ranksafe.load_file(path)


def test_empty_garbage_missing_and_directory(tmp_path):
    (tmp_path / "empty.pth").write_bytes(b"")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint" * 10)
    with pytest.raises(ranksafe.CorruptCheckpoint, match="empty"):
        ranksafe.load_file(tmp_path / "empty.pth")
    with pytest.raises(ranksafe.CorruptCheckpoint, match=r"junk\.pth"):
        ranksafe.load_file(tmp_path / "junk.pth")
    # text that the unpickler chokes on with IndexError (a passwd file, a CSV) is not a checkpoint either
    (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n")
    (tmp_path / "preds.csv").write_text("x,y\n1,2\n")
    legacy = tmp_path / "legacy.pth"  # torch's pre-zip format is a checkpoint, read as one
    ranksafe.atomic_save(_state(), legacy, _use_new_zipfile_serialization=False)
    assert ranksafe.load_file(legacy).keys() == _state().keys()
    for name in ("passwd", "preds.csv"):
        for weights_only in (True, False):
            with pytest.raises(ranksafe.CorruptCheckpoint, match=f"{name}: not a torch checkpoint"):
                ranksafe.load_file(tmp_path / name, weights_only=weights_only)
    with pytest.raises(FileNotFoundError):
        ranksafe.load_file(tmp_path / "missing.pth")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        ranksafe.load_file(tmp_path)
    with pytest.raises(IsADirectoryError):
        ranksafe.atomic_save(_state(), tmp_path)


def test_untrusted_pickle_needs_opt_in(tmp_path):
    path = tmp_path / "obj.pkl"
    ranksafe.atomic_save({"fn": os.path.join}, path)
    with pytest.raises(ranksafe.UntrustedCheckpoint, match="weights_only=False") as e:
        ranksafe.load_file(path)
    assert "Unsupported global: GLOBAL posixpath.join" in str(e.value)  # what was refused, not torch's advice
    assert ranksafe.load_file(path, weights_only=False)["fn"] is os.path.join


def test_file_where_a_directory_must_go(tmp_path):
    (tmp_path / "blocker").write_text("a file")
    blocker = re.escape(f"{tmp_path / 'blocker'} is a file, not a directory")
    for target in (tmp_path / "blocker" / "m.pth", tmp_path / "blocker" / "a" / "b" / "m.pth"):
        # os.makedirs alone says "File exists", as if the target existed
        with pytest.raises(NotADirectoryError, match=re.escape(f"cannot save {target} (rank 0): ") + blocker):
            ranksafe.save(_state(), target)
        with pytest.raises(NotADirectoryError, match=blocker):
            ranksafe.prepare_dir(target)
    assert (tmp_path / "blocker").read_text() == "a file"


def test_local_writes_name_the_target_not_the_temporary(tmp_path):
    (tmp_path / "blocker").write_text("a file")
    with pytest.raises(FileNotFoundError, match=f"directory {re.escape(str(tmp_path / 'nodir'))} does not exist") as e:
        ranksafe.atomic_save(_state(), tmp_path / "nodir" / "m.pth")
    assert e.value.path == str(tmp_path / "nodir" / "m.pth") and TMP_SUFFIX not in str(e.value)
    with pytest.raises(NotADirectoryError, match="blocker is a file, not a directory") as e:
        ranksafe.atomic_save(_state(), tmp_path / "blocker" / "m.pth")
    assert TMP_SUFFIX not in str(e.value)


def test_orphans_of_dead_writers_are_cleaned_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_tmp = tmp_path / f".m.pth.{_host_tag()}.{int(dead.stdout)}.abcd{TMP_SUFFIX}"
    live_tmp = tmp_path / f".m.pth.{_host_tag()}.{os.getpid()}.ef01{TMP_SUFFIX}"
    dead_tmp.write_bytes(b"x" * 100)
    live_tmp.write_bytes(b"y")
    assert clean_orphans(tmp_path, "m.pth") == [dead_tmp.name]
    assert live_tmp.exists() and not dead_tmp.exists()
    # a write to the directory cleans the debris of any file there (a crashed epoch_3.pth is never written again)
    dead_tmp.write_bytes(b"x" * 100)
    ranksafe.atomic_save(_state(), tmp_path / "other.pth")
    assert live_tmp.exists() and not dead_tmp.exists()


def test_writers_in_two_pid_namespaces_of_one_host_name_tell_their_temporaries_apart(tmp_path):
    """Two containers with one host name (host networking) share a volume: a pid alive in one is dead in the other,
    so the host tag must tell them apart, or each removes the other's live temporaries as a crashed writer's."""
    tag = "from ranksafe.files import _host_tag; print(_host_tag())"
    other = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", tag], capture_output=True, text=True, timeout=60
    )
    if other.returncode != 0:
        pytest.skip(f"no PID namespace here: {other.stderr.strip()}")
    theirs = other.stdout.strip()
    assert theirs.startswith(socket.gethostname().replace(".", "_")) and theirs != _host_tag()
    their_tmp = tmp_path / f".m.pth.{theirs}.1.abcd{TMP_SUFFIX}"  # pid 1 of their namespace: their writer
    their_tmp.write_bytes(b"theirs, being written")
    ranksafe.atomic_save(_state(), tmp_path / "m.pth")
    assert their_tmp.exists()


def test_verify_finds_the_end_of_a_zip_with_a_comment_and_refuses_a_footer_alone(tmp_path):
    stock = tmp_path / "commented.pth"
    torch.save(_state(), stock)
    with zipfile.ZipFile(stock, "a") as z:  # a tool that tags archives: stock torch.load still reads it
        z.comment = b"tagged by the archive tool"
    assert torch.load(stock, weights_only=True).keys() == _state().keys()
    assert ranksafe.verify_file(stock) is False  # no footer, and a complete zip: before, "truncated"
    assert ranksafe.load_file(stock).keys() == _state().keys()
    cut = tmp_path / "cut.pth"
    cut.write_bytes(stock.read_bytes()[:-5])  # into the comment: the end record announces more than there is
    with pytest.raises(ranksafe.CorruptCheckpoint, match="truncated"):
        ranksafe.verify_file(cut)
    alone = tmp_path / "footer.pth"
    alone.write_bytes(ChecksummingWriter(io.BytesIO()).footer())  # a footer over nothing: before, "OK"
    with pytest.raises(ranksafe.CorruptCheckpoint, match="no torch checkpoint"):
        ranksafe.verify_file(alone)


_FSIZE_CHILD = textwrap.dedent(
    """
    import resource, sys, torch, ranksafe
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
    try:
        ranksafe.atomic_save({"w": torch.zeros(1 << 20)}, sys.argv[1])
    except OSError as e:
        print("ERR", e.errno, e)
    """
)


def test_file_too_large_keeps_the_committed_file_and_the_error_names_it(tmp_path):
    path = tmp_path / "m.pth"
    ranksafe.atomic_save(_state(), path)
    before = path.read_bytes()
    out = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(path), str(256 * 1024)], capture_output=True, text=True, timeout=60
    )
    assert "ERR 27" in out.stdout, out.stderr  # EFBIG, even for root
    assert f"cannot save {path} (rank 0): File too large" in out.stdout  # before: "File too large", naming nothing
    assert path.read_bytes() == before
    assert _debris(tmp_path) == []


_LINK_FSIZE_CHILD = textwrap.dedent(
    """
    import os, resource, signal, sys
    from ranksafe.files import atomic_link
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG instead
    def no_symlinks(*args):  # a file system without symlinks: the link is a copy
        raise PermissionError(1, "Operation not permitted")
    os.symlink = no_symlinks
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]),) * 2)
    try:
        atomic_link(sys.argv[1], sys.argv[2])
    except OSError as e:
        print("ERR", e.errno)
    """
)


def _no_symlinks(*args):
    raise PermissionError(1, "Operation not permitted")


def test_a_link_is_a_relative_symlink_or_a_whole_copy_committed_over_the_old_one(tmp_path, monkeypatch):
    old, new, last = tmp_path / "epoch=0.ckpt", tmp_path / "epoch=1.ckpt", tmp_path / "last.ckpt"
    old.write_bytes(b"old" * 100_000)
    new.write_bytes(b"new" * 100_000)
    ranksafe.files.atomic_link(str(old), str(last))
    ranksafe.files.atomic_link(str(new), str(last))
    assert os.readlink(last) == "epoch=1.ckpt" and sorted(os.listdir(tmp_path)) == [old.name, new.name, last.name]
    # without symlinks, a copy; one cut short by a full disk (RLIMIT_FSIZE) never replaces the last good link
    out = subprocess.run(
        [sys.executable, "-c", _LINK_FSIZE_CHILD, str(old), str(last), "100000"], capture_output=True, text=True
    )
    assert "ERR 27" in out.stdout, out.stderr  # EFBIG, even for root
    assert last.read_bytes() == new.read_bytes() and sorted(os.listdir(tmp_path)) == [old.name, new.name, last.name]
    monkeypatch.setattr(os, "symlink", _no_symlinks)
    ranksafe.files.atomic_link(str(old), str(last))
    assert not last.is_symlink() and last.read_bytes() == old.read_bytes()
    assert sorted(os.listdir(tmp_path)) == [old.name, new.name, last.name]


# --- SIGKILL during a save: the previous checkpoint survives ---------------------------------------------

_KILL_CHILD = textwrap.dedent(
    """
    import sys, torch, ranksafe
    path, mode, version = sys.argv[1], sys.argv[2], float(sys.argv[3])
    state = {"w": torch.full((50 * 1024 * 1024 // 4,), version)}  # 50 MiB
    print("writing", flush=True)
    if mode == "naive":
        torch.save(state, path)
    else:
        ranksafe.atomic_save(state, path)
    print("done", flush=True)
    """
)


def _writing_size(path, mode: str, committed_size: int) -> int:
    """Size of the file a save is writing right now: our temporary, or the target itself once the naive save has
    truncated it (until then it is the committed file, and a kill would find it intact)."""
    names = [path.name] if mode == "naive" else [n for n in os.listdir(path.parent) if n.endswith(TMP_SUFFIX)]
    for name in names:
        try:
            size = os.path.getsize(path.parent / name)
        except FileNotFoundError:
            continue
        if mode != "naive" or size < committed_size:
            return size
    return 0


def _kill_mid_save(path, mode: str, runs: int) -> tuple[int, set[str]]:
    """Save version k over a committed version k-1, SIGKILL mid-write. Returns how many saves destroyed the
    committed file, and the temporaries the killed writers left (seen right after each kill: the next save
    removes the temporaries of dead writers)."""
    torn, left, committed = 0, set(), 0.0
    ranksafe.atomic_save({"w": torch.full((50 * 1024 * 1024 // 4,), committed)}, path)
    for k in range(1, runs + 1):
        committed_size = os.path.getsize(path)
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILL_CHILD, str(path), mode, str(k)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "writing"
        # kill while the bytes are going out: once the file being written has grown past 1 MiB
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            if _writing_size(path, mode, committed_size) > (1 << 20):
                break
            time.sleep(0.0005)
        os.kill(proc.pid, 9)
        proc.wait()
        left.update(_debris(path.parent))
        try:
            w = torch.load(path, weights_only=True)["w"]
            intact = float(w[-1]) in (committed, k) and bool(torch.all(w == w[-1]))
        except Exception:  # missing, truncated, unreadable
            intact = False
        if intact:
            committed = float(w[-1])
        else:
            torn += 1
            committed = float(k)
            ranksafe.atomic_save({"w": torch.full((50 * 1024 * 1024 // 4,), committed)}, path)
    return torn, left


def test_sigkill_mid_save_naive_tears_ours_never(tmp_path):
    naive_torn, _ = _kill_mid_save(tmp_path / "naive.pth", "naive", 3)
    ours_torn, left = _kill_mid_save(tmp_path / "ours.pth", "ours", 6)
    print(f"SIGKILL mid-save: naive torch.save destroyed the checkpoint {naive_torn}/3, ranksafe {ours_torn}/6")
    assert naive_torn >= 1, "the control must show the naive pattern tearing the file"
    assert ours_torn == 0
    assert left, "killed writers left temporaries ..."
    ranksafe.atomic_save({"w": torch.zeros(4)}, tmp_path / "ours.pth")
    assert not left & set(_debris(tmp_path))  # ... and the saves after them removed them
    assert [n for n in _debris(tmp_path) if n.startswith(".ours")] == []
