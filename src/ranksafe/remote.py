"""Checkpoints on remote storage: fsspec URLs such as ``s3://``, ``gs://``, ``az://``, ``memory://`` (and
``http://`` to read).

A URL never reaches ``open``: taken for a relative path, ``s3://bucket/x`` would become a local folder ``s3:`` on
a node disk. :func:`split` tells a URL from a local path (``file://`` URLs are local paths), and :class:`Remote`
is a URL resolved to its fsspec file system.

The commit of one object (:func:`commit_object`) fits the store. An object store has no rename, but an upload
becomes visible whole, when it completes: the object is opened with fsspec's ``autocommit=False``, written
(torch's bytes and ranksafe's footer, as on a local disk), and committed only after the last byte. A writer that
fails discards the upload (S3 aborts the multipart upload); one that is killed never completes it: either way the
previous object, or none, stays. A file system whose files cannot defer their commit gets a temporary name and a
move, which is a rename wherever the store has one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import re
import secrets
import shutil
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import IO, Any

from . import topology

# "s3://bucket/x", and what pathlib makes of it ("s3:/bucket/x"); one letter before the colon is a Windows drive
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):/(?P<slashes>/?)(?P<rest>.*)$", re.DOTALL)
TMP_SUFFIX = ".ranksafe-tmp"


def split(path: str | os.PathLike) -> tuple[str | None, str]:
    """``(None, local path)`` or ``(scheme, URL)``. A ``file://`` URL is a local path; pathlib's ``s3:/bucket/x``
    (what ``Path("s3://bucket/x")`` prints) is the URL ``s3://bucket/x``; ``S3://bucket/x`` too (a scheme is
    case-insensitive, fsspec knows it in lower case only). Raises ``ValueError`` for fsspec's chained
    URLs (``simplecache::s3://...``), which would otherwise pass for a local path."""
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if "::" in path and _URL.match(path.rsplit("::", 1)[-1]):  # fsspec's chaining, "simplecache::s3://bucket/x"
        raise ValueError(
            f"{where(path)}: chained URLs are not supported; a caching layer writes the store later, or never, "
            "where ranksafe must know the object committed. Pass the store's own URL"
        )
    m = _URL.match(path)
    if m is None:
        return None, path
    scheme = m["scheme"].lower()
    path = scheme + path[len(scheme) :]
    if scheme == "file":
        parsed = urllib.parse.urlparse(path)
        if parsed.netloc in ("", "localhost"):
            return None, urllib.parse.unquote(parsed.path)
        return scheme, path  # a file on another host: not ours to reach
    if not m["slashes"]:  # pathlib ate one slash of "s3://bucket/x"
        return scheme, f"{scheme}://{m['rest']}"
    return scheme, path


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` names remote storage (a URL other than ``file://``)."""
    return split(path)[0] is not None


def canonical(path: str | os.PathLike) -> str:
    """The absolute local path (``~`` expanded, as a manager's root takes it), or the URL: the one spelling of a
    place, to tell two paths apart by."""
    scheme, place = split(path)
    return place if scheme else os.path.abspath(os.path.expanduser(place))


def where(path: str | os.PathLike) -> str:
    """``path (rank N)``, for messages."""
    return f"{os.fspath(path)} (rank {topology.rank()})"


def joinpath(base: str | os.PathLike, *parts: str | os.PathLike) -> str | pathlib.Path:
    """``Path(base).joinpath(*parts)``, where a part that is a URL starts the path over, as an absolute path does.
    (pathlib takes ``s3://bucket/x`` for a relative folder named ``s3:``, so a checkpoint given a URL would land in
    a local folder under ``base``.)"""
    joined: str | pathlib.Path = base
    for part in parts:
        joined = part if is_url(part) else pathlib.Path(joined) / part
    return joined


def exists(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether a file is at ``path``: a local path, or a URL of remote storage (``os.path.exists`` says no to any
    URL, which would pass for "no such file")."""
    if is_url(path):
        return Remote.of(path, storage_options).exists()
    return os.path.exists(path)


def remove(path: str | os.PathLike) -> None:
    """Remove the file, link or directory at ``path``, or every object below a URL (:meth:`Remote.remove`); nothing
    there is no error."""
    if is_url(path):
        Remote.of(path).remove()
    elif os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def file_url(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> str:
    """The URL of one file (an object), resolved (:meth:`Remote.of`). A URL ending in ``/`` names a folder: refused,
    as a local path is, rather than written as an object named after the folder."""
    if os.fspath(path).endswith("/"):
        raise IsADirectoryError(errno.EISDIR, f"{where(path)} ends with '/': a file's path, not a directory's")
    return Remote.of(path, storage_options).url


@dataclass(frozen=True)
class Remote:
    """A URL and the fsspec file system that serves it (``fs``), with the path that file system uses (``path``)."""

    url: str
    fs: Any
    path: str
    # set by listed_afresh(): exists() and size() answer from the listings made since, not a request each
    from_listings: bool = field(default=False, compare=False)

    @classmethod
    def of(cls, url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Remote:
        """Resolve ``url`` (as :func:`split` reads it) to its file system. Raises ``ValueError`` naming the URL and
        the rank when no installed fsspec implementation serves it (``s3://`` needs ``s3fs``)."""
        scheme, url = split(url)
        if scheme is None:
            raise ValueError(f"{where(url)} is a local path, not a URL")
        if scheme == "file":  # fsspec would take the host for a folder of the current directory
            raise ValueError(f"{where(url)}: a file:// URL names a file on this host (file:///path), not another")
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - fsspec is a dependency
            raise ValueError(f"{where(url)}: remote storage needs fsspec (pip install fsspec)") from e
        if scheme not in ("http", "https") and (magic := sorted(set(url) & set("*?[]"))):
            raise ValueError(
                f"{where(url)}: {' '.join(magic)} in a URL of remote storage: fsspec takes them for a pattern when it "
                "removes or moves, which would reach other objects (and s3fs drops a '?' query, such as a "
                "versionId, writing the object without it). Name it without them"
            )
        if scheme not in ("http", "https") and "//" in url.split("://", 1)[1]:
            raise ValueError(
                f"{where(url)}: an empty folder name ('//') in a URL of remote storage: the store would keep it in the "
                "object's name, where listings of the URL do not find it (a step saved there would never load). Name "
                "it with single slashes"
            )
        try:
            fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as e:  # no implementation for the scheme, or one that is not installed
            raise ValueError(f"{where(url)}: no file system for {scheme}:// ({e})") from e
        return cls(url.rstrip("/"), fs, path.rstrip("/") or path)

    def child(self, *names: str) -> Remote:
        """The URL of ``names`` below this one."""
        tail = "/".join(names)
        return Remote(f"{self.url}/{tail}", self.fs, f"{self.path}/{tail}", self.from_listings)

    def listed_afresh(self) -> Remote:
        """This URL, for a caller that lists below it, then asks about what it listed (:func:`~ranksafe.list_steps`:
        a root's steps, then each step's files and manifest). What the file system remembers of this URL, its parents
        and everything below it is dropped once, here; then :meth:`exists` and :meth:`size`, of it and its children,
        answer from the listings made from now on, where each would otherwise drop them again and ask the store
        (a HEAD request on S3, per file of every step). A later listing calls this again."""
        self._forget()
        below = self.path + "/"
        for key in [k for k in self.fs.dircache if k.startswith(below)]:
            self.fs.dircache.pop(key, None)
        return replace(self, from_listings=True)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    def exists(self) -> bool:
        if not self.from_listings:
            self._forget()
        return self.fs.exists(self.path)

    def size(self) -> int:
        """The object's size in bytes (``FileNotFoundError`` if there is none)."""
        if not self.from_listings:
            self._forget()
        return self.fs.size(self.path)

    def _forget(self) -> None:
        """Drop what the file system remembers of this path and its parents. s3fs answers ``exists`` and ``size``
        from its last listing of the parent, which another process may have written into since: a step committed
        there would still look incomplete to a reader, and a probe written by rank 0 missing to rank 1."""
        self.fs.invalidate_cache(self.path)

    def read(self) -> bytes:
        """The whole object (``FileNotFoundError`` naming the URL if there is none)."""
        try:
            return self.fs.cat_file(self.path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.url) from None
        except IsADirectoryError:
            raise IsADirectoryError(errno.EISDIR, "a directory, not a checkpoint file", self.url) from None

    def names(self) -> list[str]:
        """The names directly below this URL (none when there is nothing there). On an object store whose bucket does
        not exist, ``FileNotFoundError`` naming the URL: read as "no checkpoints yet", a misspelt bucket would start a
        run afresh, and fail only at its first save."""
        try:
            entries = self.fs.ls(self.path, detail=False, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            entries = []
        if not entries:
            self._require_bucket()
            return []
        base = self.path.rstrip("/") + "/"
        inside = (e.rstrip("/") for e in entries)
        return sorted(e[len(base) :] for e in inside if e.startswith(base) and "/" not in e[len(base) :])

    def _require_bucket(self) -> None:
        """Raise ``FileNotFoundError`` if the store says this URL's bucket does not exist. One that may not be looked
        at (a role allowed its prefix only) passes: the listing stands."""
        if not _protocols(self.fs) & _COMMIT_ON_COMPLETION:  # no buckets (fsspec's memory store)
            return
        bucket = self.path.split("/", 1)[0]
        try:
            self.fs.info(bucket)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"no such bucket: {bucket}", self.url) from None
        except OSError:
            pass

    def remove(self) -> None:
        """Remove the object, or every object below this URL; nothing there is no error. One object at a time: a
        recursive ``fs.rm`` of a bucket's URL removes the bucket itself (s3fs: with every version of every object)."""
        try:
            found = self.fs.find(self.path, withdirs=True, detail=True)
        except FileNotFoundError:
            return
        for path, info in found.items():
            if info["type"] != "directory":
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)
        if not _protocols(self.fs) & _COMMIT_ON_COMPLETION:  # a store with folders (fsspec's memory store)
            for path in sorted((p for p, i in found.items() if i["type"] == "directory"), key=len, reverse=True):
                with contextlib.suppress(OSError):
                    self.fs.rmdir(path)


# Object stores whose files, opened with fsspec's ``autocommit=False``, publish only at ``commit()``: an upload
# appears whole when it completes. (fsspec's in-memory file system publishes a file as it is opened.)
_COMMIT_ON_COMPLETION = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


def _protocols(fs: Any) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


@contextlib.contextmanager
def commit_object(target: Remote) -> Iterator[IO[bytes]]:
    """Open ``target`` for writing so that it appears complete or not at all (see the module docstring).

    An exception in the block discards what was written; the previous object, if any, stays.
    """
    fs = target.fs
    target._forget()
    if fs.isdir(target.path):  # an object store would write one beside them, a move put the temporary inside
        raise IsADirectoryError(errno.EISDIR, "Is a directory (objects are below it)", target.url)
    if _protocols(fs) & _COMMIT_ON_COMPLETION:
        staged = None
        f = fs.open(target.path, "wb", autocommit=False)
    else:  # a file system that publishes as it writes: a temporary object, moved into place
        parent = target.path.rsplit("/", 1)[0]
        fs.makedirs(parent, exist_ok=True)
        staged = f"{parent}/.{target.name}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        f = fs.open(staged, "wb")
    try:
        yield f
        f.close()
        if staged is None:
            f.commit()
        else:
            fs.mv(staged, target.path)
    except BaseException:
        with contextlib.suppress(Exception):  # closed first, as fsspec's transactions do: never flushed again later
            f.close()
        with contextlib.suppress(Exception):
            if staged is None:
                f.discard()
            else:
                fs.rm(staged)
        raise
