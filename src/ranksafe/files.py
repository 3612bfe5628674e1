"""File primitives: the atomic commit of one file, and the directories it goes in. No collectives here.

The commit protocol (:class:`AtomicFile`) is the one place that decides how a file becomes visible:

1. write to a temporary file with an unpredictable name *in the target's directory* (so the final rename
   never crosses a file system, and never falls back to a copy that a crash can tear);
2. flush and ``fsync`` it, then ``os.replace`` it over the target, then ``fsync`` the directory.

A reader sees the old file or the new one, never a torn one; a crash leaves the previous file intact and a
temporary file that the next write to the same directory removes. What goes *into* a checkpoint file (torch's
format and ranksafe's integrity footer) is :mod:`ranksafe.checkpoint_file`'s.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from typing import IO, Any

from . import remote, topology

TMP_SUFFIX = ".ranksafe-tmp"
BUFFER_SIZE = 256 << 10  # an open commit's buffer: larger writes go straight to the fd, with no copy through it
_ORPHAN_AGE = 24 * 3600  # temporaries of another host are removed once this old


def local_path(path: str | os.PathLike) -> str:
    """``path`` as a local file-system path: a ``file://`` URL becomes its path, ``~`` the home directory (as
    ModelCheckpoint and the manager take it); any other URL raises ValueError.

    For the calls that only work on a local file system (directory commits, storage probes). A URL taken for a
    relative path (``s3://bucket/x`` is ``./s3:/bucket/x`` to ``open``) would "succeed" on a node's disk while
    the user believes the checkpoint is in the bucket. Every rank validates the same argument, so every rank
    raises, before any collective.
    """
    scheme, path = remote.split(path)
    if scheme is not None:
        raise ValueError(
            f"{path} (rank {topology.rank()}) is a URL: this call reads and writes local paths only "
            "(a local directory, or a mount of shared storage)"
        )
    return os.path.expanduser(path)


def _host_tag() -> str:
    """Who writes a temporary, as its name says: the host name and, where there is one, the PID namespace. Two
    containers can share a host name (host networking) and a volume, and a pid is only alive or dead in its own
    namespace: without it, one container took the other's live temporaries for a crashed writer's."""
    tag = socket.gethostname().replace(".", "_")
    with contextlib.suppress(OSError):
        tag += f"-pidns{os.stat('/proc/self/ns/pid').st_ino}"
    return tag


def _umask() -> int:
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # fallback where /proc is missing; racy only against other umask writers
    os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_in_the_way(directory: str) -> str | None:
    """ "X is a file, not a directory" for the nearest existing ancestor X of ``directory`` (itself included)
    when it is not a directory; None when it is one."""
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None if os.path.isdir(path) else f"{path} is a file, not a directory"


def make_dirs(directory: str | os.PathLike) -> str:
    """``os.makedirs(directory, exist_ok=True)``, returning the absolute path, with a clear error where a file
    stands in the way: ``NotADirectoryError`` naming that file (``os.makedirs`` says "File exists", which reads
    as if the target itself existed)."""
    directory = os.path.abspath(local_path(directory))
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        blocked = _file_in_the_way(directory)
        if blocked is None:
            raise
        raise NotADirectoryError(errno.ENOTDIR, blocked) from e
    return directory


def _naming_target(e: OSError, target: str) -> OSError:
    """``e`` as raised for ``target`` rather than for the temporary beside it (which the user never named)."""
    reason = e.strerror or str(e)
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        directory = os.path.dirname(target)
        reason = _file_in_the_way(directory) or f"directory {directory} does not exist"
    return type(e)(e.errno, reason, target)


def clean_orphans(directory: str | os.PathLike, prefix: str = "") -> list[str]:
    """Remove temporary files left by crashed writers in ``directory``; return their names.

    A temporary belongs to a crashed writer when its process no longer exists on this host, or, for
    another host, when it is older than a day. Live writers' temporaries are never touched.
    """
    removed = []
    host = _host_tag()
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):  # nothing there to clean; the write itself will say why
        return removed
    for name in names:
        if not (name.startswith("." + prefix) and name.endswith(TMP_SUFFIX)):
            continue
        parts = name[: -len(TMP_SUFFIX)].rsplit(".", 3)  # [.target, host, pid, random]
        if len(parts) != 4 or not parts[2].isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            stale = (
                not _pid_alive(int(parts[2]))
                if parts[1] == host
                else time.time() - os.stat(path).st_mtime > _ORPHAN_AGE
            )
            if stale:
                os.unlink(path)
                removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _temporary(directory: str, name: str) -> str:
    """A new temporary's path beside ``directory/name``: hidden, unpredictable, and named after its writer's host
    and process, so that :func:`clean_orphans` can tell a crashed writer's from a live one's."""
    return os.path.join(directory, f".{name}.{_host_tag()}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")


class AtomicFile:
    """The commit protocol for one file: temporary beside the target, fsync, rename, fsync directory.

    ``open()`` creates the temporary, ``commit()`` publishes it, ``abort()`` removes it. Prefer
    :func:`atomic_write`, which runs the three in the right order.
    """

    def __init__(self, target: str | os.PathLike):
        path = local_path(target)
        if path.endswith(("/", os.sep)):  # abspath would drop the separator and write a file by the folder's name
            raise IsADirectoryError(f"cannot write {path} (rank {topology.rank()}): a file's path, not a directory's")
        self.target = os.path.abspath(path)
        self.directory, self.name = os.path.split(self.target)
        self.tmp: str | None = None
        self._file: IO[bytes] | None = None

    def open(self, mode: str = "wb") -> IO:
        if os.path.isdir(self.target):
            raise IsADirectoryError(f"cannot write {self.target}: it is a directory")
        clean_orphans(self.directory)  # of any file here: a crashed epoch_3.pth is never written again
        self.tmp = _temporary(self.directory, self.name)
        try:
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            self.tmp = None
            raise _naming_target(e, self.target) from None
        try:
            # mkstemp-style 0600 while writing; the published file gets the mode a plain open() would give
            mode_bits = os.stat(self.target).st_mode & 0o777 if os.path.exists(self.target) else 0o666 & ~_umask()
            os.fchmod(fd, mode_bits)
            self._file = os.fdopen(fd, mode, buffering=BUFFER_SIZE) if "b" in mode else os.fdopen(fd, mode)
        except BaseException:
            os.close(fd)
            self.abort()
            raise
        return self._file

    def commit(self) -> None:
        assert self._file is not None and self.tmp is not None, "commit() before open()"
        f, self._file = self._file, None
        try:
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()
        os.replace(self.tmp, self.target)
        self.tmp = None
        fsync_dir(self.directory)

    def abort(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if self.tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
            self.tmp = None


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike, mode: str = "wb", storage_options: dict[str, Any] | None = None
) -> Iterator[IO]:
    """Open ``path`` for writing so that it appears complete or not at all.

    No collectives: call it on the writer rank only, or use :func:`ranksafe.save`. On any exception the target is
    untouched and the temporary file is removed. ``mode`` writes a whole new file: ``"wb"`` or ``"w"`` (a file is
    replaced, never appended to). ``path`` may be a URL of remote storage (binary mode; ``storage_options`` for its
    file system): see :func:`ranksafe.remote.commit_object`.
    """
    if mode not in ("wb", "w"):  # "a" would drop what the file held, "x" would replace a file that exists
        raise ValueError(f"atomic_write writes a whole new file ('wb' or 'w'), not mode {mode!r}: {remote.where(path)}")
    if remote.is_url(path):
        if mode != "wb":
            raise ValueError(f"atomic_write of a URL opens it in binary mode ('wb'), not {mode!r}")
        with remote.commit_object(remote.Remote.of(path, storage_options)) as f:
            yield f
        return
    commit = AtomicFile(path)
    f = commit.open(mode)
    try:
        yield f
    except BaseException:
        commit.abort()
        raise
    try:
        commit.commit()
    except BaseException:
        commit.abort()
        raise


def atomic_link(target: str, linkpath: str) -> None:
    """Point ``linkpath`` at ``target``: a relative symlink, or a copy where links are not allowed (on remote
    storage, a copy made by the store). Either is made under a temporary name beside ``linkpath`` and committed
    over it as :class:`AtomicFile` commits a file, so the link is never missing, nor a copy torn by a crash."""
    if remote.is_url(linkpath):
        link = remote.Remote.of(linkpath)
        link.fs.copy(remote.Remote.of(target).path, link.path)
        return
    linkpath = os.path.abspath(linkpath)
    if os.path.isdir(linkpath) and not os.path.islink(linkpath):
        shutil.rmtree(linkpath)
    directory, name = os.path.split(linkpath)
    temporary = _temporary(directory, name)
    try:
        os.symlink(os.path.relpath(target, directory), temporary)
    except OSError:  # no symlinks here (some network and FAT file systems): a copy, fsynced before it is renamed
        with open(target, "rb") as source, atomic_write(linkpath) as copy:
            shutil.copyfileobj(source, copy, BUFFER_SIZE)
        return
    try:
        os.replace(temporary, linkpath)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    fsync_dir(directory)
