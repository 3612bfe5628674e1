"""One checkpoint file: ``torch.save`` with an integrity footer, written through the atomic commit of
:mod:`ranksafe.files`, and its verified load. No collectives here.

Files written by :func:`atomic_save` end with a small footer (payload length and CRC32, computed while
streaming). ``torch.load`` ignores bytes after the zip archive, so the files stay loadable by stock
PyTorch, while :func:`load_file` detects truncation *and* bit flips (which ``torch.load`` alone loads
silently as wrong values).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import secrets
import shutil
import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import torch

from . import remote
from .errors import CorruptCheckpoint, EmptyCheckpoint, UntrustedCheckpoint, naming_target
from .files import BUFFER_SIZE, atomic_write, local_path, make_dirs

_FOOTER = struct.Struct("<8sQI4s")  # magic, payload length, crc32, version
_MAGIC, _VERSION = b"RANKSAFE", b"v1\0\0"
_CHUNK = 8 << 20
_ZIP_START, _EOCD, _EOCD_SIZE = b"PK\x03\x04", b"PK\x05\x06", 22
_MAX_COMMENT = 0xFFFF  # a zip's end record may be followed by a comment this long (torch writes none)
# torch's legacy (pre-zip) format opens with a pickled magic number: protocol 2, then a LONG1 of 10 bytes
_LEGACY_START = b"\x80\x02\x8a\x0a"

_OVERLAP = 1 << 20  # writes at least this large are hashed in a helper thread while they are written
_WRITEBACK = 8 << 20  # ask the kernel to start writing back every this many bytes (Linux)


def _start_writeback(fd: int, offset: int) -> None:
    """Start writing back, without waiting, the pages written from ``offset`` on.

    Without it the kernel keeps a large new file in the page cache and the final ``fsync`` writes all of
    it, after the last byte; with it the disk works while torch serialises the rest, and ``fsync`` finds
    little left. ``posix_fadvise(POSIX_FADV_DONTNEED)`` does that on Linux: it starts the writeback of the
    range's dirty pages without waiting. (It also drops the range's clean pages; the range begins near the newest
    bytes, which are still dirty, so in practice it drops nothing.) Only a hint:
    ``fsync`` at commit remains what makes the file durable, and where the call is missing or refused nothing
    changes.
    """
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, 0, os.POSIX_FADV_DONTNEED)


class ChecksummingWriter:
    """A write-only file wrapper that counts and CRCs every byte on its way to disk.

    Given a ``helper`` (one worker thread), a large write is hashed there *while* the caller writes it
    (``zlib.crc32`` and the file write both release the GIL), so the checksum costs little more than the
    write itself. ``write`` returns only once both are done: torch hands us views of its own buffers, which
    may be freed right after.
    """

    def __init__(
        self,
        f: IO[bytes],
        on_first_write: Callable[[], None] | None = None,
        helper: ThreadPoolExecutor | None = None,
    ):
        self._f = f
        self._helper = helper
        self._on_first_write = on_first_write
        self.length = 0
        self.crc = 0
        self.error: OSError | None = None  # the first write error, which torch.save may mask with its own
        try:
            self._fd: int | None = f.fileno()
        except (AttributeError, OSError, ValueError):  # not a real file (io.UnsupportedOperation is an OSError)
            self._fd = None
        self._written_back = 0

    def write(self, data) -> int:
        if self._on_first_write is not None:
            self._on_first_write()
            self._on_first_write = None
        size = memoryview(data).nbytes
        try:
            if self._helper is None or size < _OVERLAP:
                n = self._f.write(data)
                self.crc = zlib.crc32(data, self.crc)
            else:
                crc = self._helper.submit(zlib.crc32, data, self.crc)
                try:
                    n = self._f.write(data)
                finally:  # even when the write failed: the helper may still be reading data
                    self.crc = crc.result()
        except OSError as e:
            self.error = self.error or e
            raise
        self.length += size if n is None else n
        if self._fd is not None and self.length - self._written_back >= _WRITEBACK:
            _start_writeback(self._fd, max(0, self._written_back - BUFFER_SIZE))  # the buffer may lag
            self._written_back = self.length
        return size if n is None else n

    def flush(self) -> None:
        self._f.flush()

    def footer(self) -> bytes:
        return _FOOTER.pack(_MAGIC, self.length, self.crc, _VERSION)


_zip_crc_lock = threading.Lock()
_crc_before: list[bool] = []  # the setting to restore while a save has the zip CRC turned off (under the lock)


def _after_fork_in_child() -> None:
    """A thread of the parent inside the window below (a background write, pickling) does not exist in a forked
    child: its lock would stay taken for every save there, and the setting it turned off would stay off."""
    global _zip_crc_lock
    _zip_crc_lock = threading.Lock()
    if _crc_before:
        torch.serialization.set_crc32_options(_crc_before.pop())


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def _torch_zip_crc_off() -> Iterator[Callable[[], None]]:
    """Turn off torch's per-record zip CRC32 for one ``torch.save``; yield the callable that turns it back.

    The footer's CRC32 covers every byte of the file, and ``torch.load`` never checks the zip CRCs, so
    computing them too only doubles the hashing (their bytes stay zero). The option is process-global
    (``torch.serialization.set_crc32_options``) and torch reads it once, when ``torch.save`` builds its zip
    writer, before the first byte is written: the caller restores it at its first write, and at the latest
    when the block ends. A lock covers that window, so concurrent saves through ranksafe restore the
    caller's setting in order, and only that window (mostly the pickling of the object) is serialised. A
    plain ``torch.save`` in another thread inside the window writes zero zip CRCs (still loadable).
    """
    _zip_crc_lock.acquire()
    previous: bool | None = None

    def restore() -> None:
        nonlocal previous
        if previous is not None:
            torch.serialization.set_crc32_options(previous)
            previous = None
            _crc_before.clear()
            _zip_crc_lock.release()

    try:
        previous = torch.serialization.get_crc32_options()
        _crc_before.append(previous)
        torch.serialization.set_crc32_options(False)
    except BaseException:
        _crc_before.clear()
        _zip_crc_lock.release()
        raise
    try:
        yield restore
    finally:
        restore()


@contextlib.contextmanager
def _crc_helper() -> Iterator[ThreadPoolExecutor | None]:
    """A thread that hashes while the caller writes, for the length of one save, on the main thread only.

    On the main thread the training loop waits for the save, and hashing beside the write shortens the wait.
    Elsewhere (a background saver) nobody waits, and a second thread would only take CPU from training. The
    thread starts at the first large write and is gone when the save returns, in every process (no pool to
    outlive a fork).
    """
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ranksafe-crc")
    try:
        yield helper
    finally:
        helper.shutdown(wait=True)


def save_with_footer(obj: Any, f: IO[bytes] | ChecksummingWriter, **torch_save_kwargs: Any) -> None:
    """``torch.save`` ``obj`` into the open file ``f``, then the integrity footer. Local, no collectives.

    torch's own zip CRCs are skipped (the footer covers the same bytes, see :func:`_torch_zip_crc_off`). A write
    that fails (disk full, file too large) raises its ``OSError``, not the ``RuntimeError`` torch's zip writer
    turns it into when it closes the archive: callers, and :class:`~ranksafe.RankFailure`, see the errno.
    """
    with _crc_helper() as helper, _torch_zip_crc_off() as restore:
        w = ChecksummingWriter(f, on_first_write=restore, helper=helper)
        try:
            torch.save(obj, w, **torch_save_kwargs)
        except Exception as e:
            if w.error is not None and e is not w.error:
                raise w.error from None
            raise
        f.write(w.footer())


def atomic_save(
    obj: Any, path: str | os.PathLike, storage_options: dict[str, Any] | None = None, **torch_save_kwargs: Any
) -> str:
    """``torch.save`` ``obj`` to ``path`` atomically, with an integrity footer (:func:`save_with_footer`). No
    collectives. ``path`` may be a URL of remote storage (``storage_options`` for its file system). A failed write
    raises its ``OSError`` naming ``path`` and the rank."""
    with naming_target("cannot save", path):
        _write_whole(obj, path, storage_options, torch_save_kwargs)
    return remote.split(path)[1]


def _write_whole(obj: Any, path: str | os.PathLike, storage_options: dict[str, Any] | None, kw: dict) -> None:
    with atomic_write(path, storage_options=storage_options) as f:
        save_with_footer(obj, f, **kw)


def save_file(
    obj: Any,
    path: str | os.PathLike,
    storage_options: dict[str, Any] | None = None,
    action: str = "cannot save",
    **torch_save_kwargs: Any,
) -> str:
    """One checkpoint file, written as every saver of whole files writes it: :func:`atomic_save` into a parent
    directory made if ``path`` is local, and an ``OSError`` naming ``path`` and the rank
    (``"{action} {path} (rank r): ..."``). No collectives."""
    with naming_target(action, path):
        if not remote.is_url(path):
            make_dirs(os.path.dirname(os.path.abspath(path)))
        _write_whole(obj, path, storage_options, torch_save_kwargs)
    return remote.split(path)[1]


def probe_write(directory: str | os.PathLike, storage_options: dict[str, Any] | None = None, needs: int = 0) -> None:
    """Write and remove a small checkpoint in ``directory`` (created if needed). Raises what the write raised (a
    missing permission, a file in the way, a bucket that does not exist), or ``ENOSPC`` when a local ``directory``
    has fewer than ``needs`` bytes free: room for one checkpoint. No collectives."""
    probe = torch.zeros(1024)
    if remote.is_url(directory):
        target = remote.Remote.of(directory, storage_options).child(f".ranksafe-probe-{secrets.token_hex(4)}")
        atomic_save(probe, target.url, storage_options)
        target.remove()
        return
    directory = make_dirs(directory)
    path = os.path.join(directory, f".ranksafe-probe-{secrets.token_hex(4)}")
    atomic_save(probe, path)
    os.unlink(path)
    free = shutil.disk_usage(directory).free
    if free < needs:
        raise OSError(errno.ENOSPC, f"{free} bytes free, one checkpoint needs {needs}")


def verify_file(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> bool:
    """Check the integrity of a checkpoint file without unpickling it.

    Returns True when the ranksafe footer matches the content, False for a complete file without one
    (written by stock ``torch.save``: only its zip structure can be checked, by the load). Raises
    :class:`CorruptCheckpoint` for a mismatch, a partial footer or a zip archive cut short, and
    ``FileNotFoundError`` / ``IsADirectoryError`` as ``open`` does. ``path`` may be a URL (the object is read).
    """
    if remote.is_url(path):
        target = remote.Remote.of(path, storage_options)
        return _verify(io.BytesIO(target.read()), target.url)
    path = local_path(path)
    with open(path, "rb") as f:
        return _verify(f, path)


def _verify(f: IO[bytes], path: str) -> bool:
    """:func:`verify_file` of an open, seekable file."""
    size = f.seek(0, os.SEEK_END)
    if size == 0:
        raise EmptyCheckpoint(path, "the file is empty")
    f.seek(0)
    first = f.read(4)
    f.seek(max(0, size - _FOOTER.size))
    tail = f.read(_FOOTER.size)
    if len(tail) < _FOOTER.size or tail[:8] != _MAGIC or tail[-4:] != _VERSION:
        # No footer. A zip (torch's format) must then end with its end-of-central-directory record;
        # anything else is a ranksafe file whose footer was cut, or a zip cut short.
        if first == _ZIP_START and not _ends_a_zip(f, size):
            raise CorruptCheckpoint(path, "the file is truncated (no end of archive, no ranksafe footer)")
        return False
    _, length, crc, _ = _FOOTER.unpack(tail)
    if length != size - _FOOTER.size:
        raise CorruptCheckpoint(path, f"size is {size - _FOOTER.size} bytes, the footer says {length}")
    if first not in (_ZIP_START, _LEGACY_START):  # a footer alone, or one under something else
        raise CorruptCheckpoint(path, "a ranksafe footer, but no torch checkpoint before it")
    f.seek(0)
    actual, left = 0, length
    while left:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            raise CorruptCheckpoint(path, "file ended early")
        actual = zlib.crc32(chunk, actual)
        left -= len(chunk)
    if actual != crc:
        raise CorruptCheckpoint(path, f"checksum mismatch (crc32 {actual:08x}, footer says {crc:08x})")
    return True


def _ends_a_zip(f: IO[bytes], size: int) -> bool:
    """Whether the file ends with a zip's end-of-central-directory record and the comment that record announces
    (at most :data:`_MAX_COMMENT` bytes: a stock file with a comment still loads)."""
    start = max(0, size - _EOCD_SIZE - _MAX_COMMENT)
    f.seek(start)
    tail = f.read()
    at = tail.rfind(_EOCD)
    while at >= 0:
        if at + _EOCD_SIZE <= len(tail) and at + _EOCD_SIZE + struct.unpack_from("<H", tail, at + 20)[0] == len(tail):
            return True
        at = tail.rfind(_EOCD, 0, at)
    return False


def load_file(
    path: str | os.PathLike,
    map_location: Any = "cpu",
    weights_only: bool | None = True,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    **kw: Any,
) -> Any:
    """Load a checkpoint with clear errors. No collectives; :func:`ranksafe.load` is the collective.

    ``weights_only=True`` by default: a file holding arbitrary pickled objects raises
    :class:`UntrustedCheckpoint` unless the caller opts in; ``None`` leaves the choice to ``torch.load`` (True,
    unless the user set ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``), as Lightning and torch do. Truncated, bit-flipped
    or foreign files raise :class:`CorruptCheckpoint` naming the path. ``path`` may be a URL of remote storage
    (``storage_options`` for its file system): the object is read once, verified and loaded from memory.
    """
    verified = False  # whether the footer's checksum vouches for every byte
    if remote.is_url(path):
        target = remote.Remote.of(path, storage_options)
        name, source = target.url, io.BytesIO(target.read())
        if verify:
            verified = _verify(source, name)
        source.seek(0)
    else:
        name = source = local_path(path)
        if os.path.isdir(name):
            raise IsADirectoryError(f"{name} is a directory, not a checkpoint file")
        if verify:
            with open(name, "rb") as f:
                verified = _verify(f, name)
    try:
        return torch.load(source, map_location=map_location, weights_only=weights_only, **kw)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as e:
        error = _load_error(name, e, weights_only, _first_bytes(source), verified)
        if error is e:
            raise
        raise error from e


# what torch.load raises for a damaged file (anything else from a torch file comes from the objects in it)
_DAMAGE = (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, KeyError, IndexError, OSError)


class _BuiltinsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to import {module}.{name} from an untrusted pickle")


def load_plain_pickle(data: bytes, path: str | os.PathLike) -> Any:
    """Unpickle ``data``, read from ``path``, when it holds only built-in containers, numbers and strings (a
    vocabulary, say); a pickle that would import any class or function raises :class:`UntrustedCheckpoint`."""
    try:
        return _BuiltinsOnly(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise UntrustedCheckpoint(path, str(e)) from e


def _load_error(path: str, e: Exception, weights_only: bool | None, first: bytes, verified: bool) -> Exception:
    """What a failed ``torch.load`` of ``path`` (whose first bytes are ``first``; ``verified``: its checksum
    matched) means, named for the user (``e`` itself: pass it on)."""
    if first not in (_ZIP_START, _LEGACY_START):
        return CorruptCheckpoint(path, "not a torch checkpoint (neither a zip archive nor torch's legacy format)")
    if isinstance(e, pickle.UnpicklingError) and weights_only is not False and "Weights only load failed" in str(e):
        lines = str(e).splitlines()
        # torch's message is a page of advice; the line naming the refused object is the one that matters
        why = next((line.strip() for line in lines if "WeightsUnpickler error" in line), lines[-1])
        return UntrustedCheckpoint(path, why.split(". Please use")[0][:300])
    if verified or not isinstance(e, _DAMAGE):
        # the file is sound (or may be): a map_location this machine cannot serve, a class missing here
        return e
    detail = str(e).splitlines()[0][:200] if str(e) else ""
    return CorruptCheckpoint(path, f"{type(e).__name__}: {detail}" if detail else type(e).__name__)


def _first_bytes(source: str | IO[bytes]) -> bytes:
    """The 4 bytes that tell torch's two formats (:data:`_ZIP_START`, :data:`_LEGACY_START`) from other files."""
    if isinstance(source, str):
        with open(source, "rb") as f:
            return f.read(4)
    source.seek(0)
    return source.read(4)
