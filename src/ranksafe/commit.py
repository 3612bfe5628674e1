"""Step directories that appear complete or not at all: the two commit protocols, and the manifest that a step is
verified against.

A step directory holds the files of one checkpoint and ``MANIFEST.json`` (every file's size and CRC32), written
last. How it becomes visible depends on where it lives:

==================  =====================================  ============================================
                    :class:`AtomicDir` (a file system)      :class:`ObjectDir` (remote storage, a URL)
==================  =====================================  ============================================
files are written   into a hidden temporary sibling        straight under the step's prefix
commit              manifest, then one rename              the manifest, written last, is the marker
replace a step      old one moved aside, then removed      old manifest removed first, then its files
crash before it     the temporary is debris                files without a manifest are debris
debris is removed   by the writer's next save              by the writer's next save
==================  =====================================  ============================================

Object stores have no rename, so a step there is committed by its manifest (Orbax's protocol for GCS): a step
without its manifest is not committed, whatever else is there, and ``latest``, ``load`` and retention never see
it. The one thing a rename gives that a marker does not: replacing a committed step with the same number leaves,
if the writer dies half-way, no copy of that step on remote storage (the earlier steps stay).

Everyone can derive every path from the final one without a file-system call; only the writer creates, commits,
aborts and recovers; any rank may write files into a step being made, through a :class:`StepWriter`.
:func:`verify_step` reads a step without collectives (for ``ranksafe verify``, and for humans); :mod:`ranksafe.steps`
lists a root's steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Iterator, Mapping
from typing import IO, Any, Protocol

from . import remote
from .checkpoint_file import ChecksummingWriter, save_with_footer
from .errors import CorruptCheckpoint, naming_target
from .files import TMP_SUFFIX, atomic_write, fsync_dir, local_path, make_dirs
from .remote import Remote

MANIFEST = "MANIFEST.json"
FORMAT = "ranksafe-step/1"
_CHUNK = 8 << 20

Entry = tuple[int, int]  # size, crc32
Place = str | Remote  # a local path, or a URL resolved to its file system


def check_name(name: str, what: str = "name") -> str:
    """Return ``name`` if it is one plain path component that stays inside its directory, else raise."""
    if not isinstance(name, str) or not name or name in (".", "..") or name.startswith("."):
        raise ValueError(f"{what} {name!r} must be a non-empty name that does not start with '.'")
    if "/" in name or "\0" in name or (os.altsep and os.altsep in name) or os.sep in name:
        raise ValueError(f"{what} {name!r} must not contain path separators")
    return name


def check_file_name(name: str) -> str:
    """Return ``name`` if a step may hold a file of that name (:func:`check_name`), else raise. The manifest's name and
    the temporaries' suffix are ranksafe's: a file of the manifest's name would be replaced by the manifest, or on
    remote storage commit the step before its files are in; one with the suffix would be neither listed nor verified."""
    check_name(name, "file name")
    if name == MANIFEST:
        raise ValueError(f"file name {name!r} is the step's manifest, which ranksafe writes last; name it otherwise")
    if name.endswith(TMP_SUFFIX):
        raise ValueError(
            f"file name {name!r} ends in {TMP_SUFFIX}, the mark of ranksafe's temporaries, which a step neither lists "
            "nor verifies; name the file otherwise"
        )
    return name


def join(place: Place, name: str) -> Place:
    """``name`` inside ``place`` ('/'-separated relative names)."""
    return place.child(name) if isinstance(place, Remote) else os.path.join(place, *name.split("/"))


def name_of(place: Place) -> str:
    """The path or URL of ``place``, for messages and for the calls that take one."""
    return place.url if isinstance(place, Remote) else place


_WRITING: set[str] = set()  # the temporary places of this process's saves, from create() to the commit or the abort


def _key(place: Place) -> str:
    """``place`` as the registry knows it: a local path however it is reached (a link to the root), or a URL."""
    return place.url if isinstance(place, Remote) else os.path.realpath(place)


def being_written(place: Place) -> bool:
    """Whether a save of this process is writing ``place`` now: it looks like the debris of a crashed save, but is not
    (two managers of one root, one of them committing in the background)."""
    return _key(place) in _WRITING


class DirCommit(Protocol):
    """What :class:`~ranksafe.CheckpointManager` needs of a commit protocol (see the module's table)."""

    final: Place  # the committed directory
    tmp: Place  # where every rank writes the step's files before the commit
    committed: bool  # whether finalize() made the step visible, also when it raised after that (a failed fsync)

    def create(self) -> None: ...
    def finalize(self, manifest: Mapping[str, Any]) -> None: ...
    def abort(self) -> None: ...
    def recover(self) -> bool: ...
    def delete(self) -> None: ...


class AtomicDir:
    """The commit protocol on a file system: temporary sibling, manifest written last, rename into place.

    * ``AtomicDir(final)`` on every rank: both paths are derived from the final one, no file-system call;
    * ``create()`` on the writer only: removes the debris of an earlier crashed attempt, makes the temporary;
    * every rank may now write into ``tmp``;
    * ``finalize(manifest)`` on the writer only, after every rank is done: writes the manifest atomically,
      fsyncs, renames the temporary to the final name (an existing final directory is moved aside first
      and removed after) and fsyncs the parent;
    * ``abort()`` on the writer only: removes the temporary.

    A crash at any point leaves either the old committed directory (moved aside, if the crash came between the
    two renames: :meth:`recover` puts it back) or none, plus hidden debris that the next save removes.
    """

    PARTIAL, OLD = ".ranksafe-partial", ".ranksafe-old"

    def __init__(self, final: str | os.PathLike):
        self.final = os.path.abspath(os.fspath(final))
        self.parent, self.name = os.path.split(self.final)
        self.tmp = os.path.join(self.parent, f".{self.name}{self.PARTIAL}")
        self._old = os.path.join(self.parent, f".{self.name}{self.OLD}")
        self.committed = False

    def create(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        make_dirs(self.parent)
        os.mkdir(self.tmp)
        _WRITING.add(_key(self.tmp))

    def finalize(self, manifest: Mapping[str, Any]) -> None:
        with atomic_write(os.path.join(self.tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        fsync_dir(self.tmp)
        replaced = os.path.isdir(self.final)
        if replaced:
            shutil.rmtree(self._old, ignore_errors=True)
            # aside for a moment, not by a crash: recover() must not put it back meanwhile
            _WRITING.add(_key(self._old))
        try:
            if replaced:
                os.rename(self.final, self._old)
            os.rename(self.tmp, self.final)
            self.committed = True
            _WRITING.discard(_key(self.tmp))
            fsync_dir(self.parent)
            if replaced:
                shutil.rmtree(self._old, ignore_errors=True)
        finally:  # a failed rename leaves the old copy aside for recover() to put back
            _WRITING.discard(_key(self._old))

    def abort(self) -> None:
        try:
            shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            _WRITING.discard(_key(self.tmp))

    def recover(self) -> bool:
        """Put the committed directory back where a crash left it aside: between the two renames of
        :meth:`finalize` replacing it, only the old copy (moved aside) and the new one (still temporary) exist.
        True if it did; the new copy stays debris, as it would be had the crash come before the renames."""
        if os.path.isdir(self._old) and not os.path.exists(self.final) and not being_written(self._old):
            try:
                os.rename(self._old, self.final)
            except OSError:  # a save of this process finished its swap meanwhile: nothing is aside any more
                return False
            return True
        return False

    def delete(self) -> None:
        """Retention: the directory stops being committed (renamed to a temporary) before its files go. Not while a
        save of this process writes that temporary (the step saved again): the new copy replaces it."""
        if being_written(self.tmp):
            return
        os.rename(self.final, self.tmp)
        shutil.rmtree(self.tmp, ignore_errors=True)


class ObjectDir:
    """The commit protocol on remote storage: the step's files under its own prefix, the manifest last.

    Same calls as :class:`AtomicDir`; ``tmp`` is the final prefix itself. ``create()`` removes what an earlier
    attempt left there (a step a load found damaged is uncommitted first: its manifest goes before its files). The
    manager never creates a committed step again: with no rename, it would be gone before its replacement is in.
    """

    def __init__(self, final: Remote):
        self.final = self.tmp = final
        self.committed = False

    def create(self) -> None:
        self.delete()
        _WRITING.add(self.final.url)

    def finalize(self, manifest: Mapping[str, Any]) -> None:
        with open_for_commit(self.final.child(MANIFEST)) as f:
            f.write(json.dumps(manifest, indent=1).encode())
        self.committed = True
        _WRITING.discard(self.final.url)

    def abort(self) -> None:
        try:
            self.final.remove()
        finally:
            _WRITING.discard(self.final.url)

    def recover(self) -> bool:
        return False  # nothing is ever moved aside

    def delete(self) -> None:
        """No longer committed (the manifest goes first), then the files."""
        self.final.child(MANIFEST).remove()
        self.final.remove()


def open_for_commit(place: Place) -> contextlib.AbstractContextManager[IO[bytes]]:
    """A file written at ``place`` that appears complete or not at all (:func:`~ranksafe.files.atomic_write`, or
    one upload on remote storage: :func:`~ranksafe.remote.commit_object`)."""
    return remote.commit_object(place) if isinstance(place, Remote) else atomic_write(place)


def step_commit(final: Place) -> DirCommit:
    """The commit protocol for a step directory at ``final``."""
    return ObjectDir(final) if isinstance(final, Remote) else AtomicDir(final)


class StepWriter:
    """What every rank holds inside :meth:`~ranksafe.CheckpointManager.saving`: the step directory being written.

    Files written through :meth:`save` are checksummed while they stream out, and their size and CRC travel to
    the writer for the manifest; files written directly into :attr:`path` (a local directory only) are hashed by
    the writer at commit. Names are plain file names inside the step directory.
    """

    def __init__(self, commit: DirCommit, step: int):
        self.path = name_of(commit.tmp)
        self.step = step
        self.entries: dict[str, Entry] = {}
        self.metrics: dict[str, float] = {}  # what the manifest records (see CheckpointManager.saving)
        self.copies = 1  # how many writers commit a copy of this step (one per node with node-local storage)
        self.committed = False  # whether this writer's copy is committed (retention may still fail after it)
        self.save_id: str | None = None  # drawn by rank 0 for this save: every node's copy of the step records it
        self._tmp, self._final = commit.tmp, commit.final

    def file(self, name: str) -> str:
        """The path (or URL) of ``name`` inside the step directory being written."""
        return name_of(join(self._tmp, check_file_name(name)))

    def save(self, obj: Any, name: str) -> str:
        """Write ``obj`` as ``name``: bytes and str as they are, anything else with ``torch.save``. A failed write
        raises its ``OSError`` naming the file as it will be once committed, and the rank."""
        place = join(self._tmp, check_file_name(name))
        raw = obj.encode() if isinstance(obj, str) else obj
        final = name_of(join(self._final, name))
        with naming_target(f"cannot save step {self.step}:", final), open_for_commit(place) as f:
            whole = ChecksummingWriter(f)
            if isinstance(raw, (bytes, bytearray, memoryview)):
                whole.write(raw)
            else:  # torch.save + ranksafe footer, as atomic_save writes it
                save_with_footer(obj, whole)
        self.entries[name] = (whole.length, whole.crc)
        return name_of(place)


def _crc_file(place: Place) -> Entry:
    if isinstance(place, Remote):
        data = place.read()
        return len(data), zlib.crc32(data)
    crc, size = 0, 0
    with open(place, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
        os.fsync(f.fileno())  # side files written with a plain open(): make them durable before the commit
    return size, crc


def step_files(directory: Place) -> Iterator[str]:
    """Relative paths ('/'-separated) of the files under ``directory``, except the manifest."""
    if isinstance(directory, Remote):
        base = directory.path + "/"
        names = (p[len(base) :] for p in directory.fs.find(directory.path) if p.startswith(base))
        yield from sorted(n for n in names if n != MANIFEST)
        return
    for here, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(here, name), directory).replace(os.sep, "/")
            if rel != MANIFEST:
                yield rel


def size_of(place: Place) -> int:
    return place.size() if isinstance(place, Remote) else os.stat(place).st_size


def build_manifest(
    directory: Place,
    step: int,
    known: Mapping[str, Entry],
    metrics: Mapping[str, float] | None = None,
    save_id: str | None = None,
) -> dict[str, Any]:
    """The manifest of ``directory``: every file's size and CRC32 (from ``known`` when the writer reported it), the
    step's ``metrics`` if any, and the ``save_id`` that tells one save's copies of a step (one per node) from
    another's.

    Every rank's writes have ended by now, so a name :func:`check_file_name` refuses can only have been written
    straight into the step's directory, past it: ``ValueError``. A file of the manifest's name would be replaced (or
    commit the step early); a temporary's would be committed unverified.
    """
    taken = join(directory, MANIFEST)
    if taken.exists() if isinstance(taken, Remote) else os.path.lexists(taken):
        raise ValueError(f"{name_of(taken)}: a file under the name of the step's manifest, written last; rename it")
    files = {}
    for rel in step_files(directory):
        if rel.endswith(TMP_SUFFIX):
            raise ValueError(
                f"{name_of(join(directory, rel))}: a file named as ranksafe's temporaries, left by a write that never "
                "ended or written straight into the step's directory; a step would hold it unverified"
            )
        size, crc = known[rel] if rel in known else _crc_file(join(directory, rel))
        files[rel] = {"size": size, "crc32": f"{crc:08x}"}
    manifest = {"format": FORMAT, "step": step, "time": time.time(), "files": files}
    if metrics:
        manifest["metrics"] = dict(metrics)
    if save_id is not None:
        manifest["save_id"] = save_id
    return manifest


def resolve(place: str | os.PathLike | Remote, storage_options: dict[str, Any] | None) -> Place:
    if isinstance(place, Remote):
        return place
    return Remote.of(place, storage_options) if remote.is_url(place) else local_path(place)


def read_manifest(
    step_dir: str | os.PathLike | Remote, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The manifest of a committed step directory; :class:`CorruptCheckpoint` if missing or unreadable."""
    step_dir = resolve(step_dir, storage_options)
    path = join(step_dir, MANIFEST)
    try:
        if isinstance(path, Remote):
            manifest = json.loads(path.read())
        else:
            with open(path) as f:
                manifest = json.load(f)
    except FileNotFoundError:
        there = bool(step_dir.names()) if isinstance(step_dir, Remote) else os.path.isdir(step_dir)
        if not there:
            raise FileNotFoundError(f"no step directory {name_of(step_dir)}") from None
        raise CorruptCheckpoint(name_of(path), "no manifest: the save never committed") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(name_of(path), f"unreadable manifest ({e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not (isinstance(files, dict) and manifest.get("format") == FORMAT):
        raise CorruptCheckpoint(name_of(path), f"not a {FORMAT} manifest")
    if not isinstance(manifest.get("save_id", ""), str):
        raise CorruptCheckpoint(name_of(path), f"damaged save id {manifest['save_id']!r}"[:300])
    for rel, meta in files.items():  # valid JSON is not a sound manifest: a flipped bit can rename a key
        if not (_inside(rel) and isinstance(meta, dict) and _is_size(meta.get("size")) and _is_crc(meta.get("crc32"))):
            raise CorruptCheckpoint(name_of(path), f"damaged manifest entry {rel!r}: {meta!r}"[:300])
    return manifest


def _inside(rel: str) -> bool:
    """Whether a manifest's file name is a relative path that stays inside the step directory."""
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def _is_size(size: Any) -> bool:
    return type(size) is int and size >= 0


def _is_crc(crc: Any) -> bool:
    return isinstance(crc, str) and re.fullmatch("[0-9a-f]{8}", crc) is not None


def verify_step(
    step_dir: str | os.PathLike | Remote,
    deep: bool = True,
    storage_options: dict[str, Any] | None = None,
    share: tuple[int, int] = (0, 1),
) -> dict[str, Any]:
    """Check every file of a step directory against its manifest; return the manifest.

    Raises :class:`CorruptCheckpoint` naming the first bad file (missing, wrong size, or with ``deep``
    wrong CRC32), and ``FileNotFoundError`` when the directory does not exist. No collectives. ``step_dir`` may
    be a URL of remote storage (``storage_options`` for its file system). ``share=(i, n)``: only every ``n``-th
    file from the ``i``-th, in name order (``n`` ranks checking one step together).
    """
    step_dir = resolve(step_dir, storage_options)
    manifest = read_manifest(step_dir)
    index, count = share
    for rel, meta in sorted(manifest["files"].items())[index::count]:
        place = join(step_dir, rel)
        try:
            size = size_of(place)
        except FileNotFoundError:
            raise CorruptCheckpoint(name_of(place), "missing (listed in the manifest)") from None
        if size != meta["size"]:
            raise CorruptCheckpoint(name_of(place), f"size is {size} bytes, the manifest says {meta['size']}")
        if deep:
            crc = _crc_file(place)[1]
            if f"{crc:08x}" != meta["crc32"]:
                raise CorruptCheckpoint(
                    name_of(place), f"checksum mismatch (crc32 {crc:08x}, manifest says {meta['crc32']})"
                )
    return manifest


def names(directory: Place) -> list[str]:
    """The names in ``directory``, sorted; none when it does not exist. A local file in its place raises
    ``NotADirectoryError``: a root that cannot hold steps is not an empty one. (An object store may hold an object
    and a prefix of one name: there only the prefix counts.)"""
    if isinstance(directory, Remote):
        return directory.names()
    try:
        return sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
