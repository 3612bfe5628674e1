"""Numbered step directories that appear complete or not at all, on every node: CheckpointManager.

Layout::

    root/step_00000010/state.pt        the state, written by the writer(s)
    root/step_00000010/...             side files any rank wrote during the save (RNG, data loader, user files)
    root/step_00000010/MANIFEST.json   every file with its size and CRC32; written last
    root/.step_00000011.ranksafe-partial   a save in progress (or the debris of a crashed one)

:class:`AtomicDir` is the one place that decides how a directory becomes visible (the directory analogue of
:class:`ranksafe.files.AtomicFile`). :class:`CheckpointManager` decides who runs which step of it: every
rank knows the temporary and final paths; the writer(s) chosen by :mod:`ranksafe.storage` create, commit
and delete; every rank may write side files between create and commit. A save costs three exchanges
whatever the world size, and ranks that write nothing make no file-system call.

With ``async_save=True`` the writer's local part of a save (write the files, the manifest, rename, apply
retention) runs on an :class:`~ranksafe.AsyncSaver` thread: :meth:`CheckpointManager.save` returns once the
state is snapshotted, and a background failure is raised on every rank by the next :meth:`~CheckpointManager.check`
(or the next save, which checks first).

:func:`verify_step` and :func:`list_steps` read a root without collectives (for ``ranksafe verify`` /
``ranksafe ls`` and for humans).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from . import topology
from .async_save import AsyncSaver
from .collectives import exchange_outcome, share_outcome, together
from .errors import BarrierTimeout, CollectiveMismatch, CorruptCheckpoint
from .files import (
    TMP_SUFFIX,
    ChecksummingWriter,
    atomic_write,
    fsync_dir,
    load_file,
    local_path,
    make_dirs,
    save_with_footer,
)
from .saving import error_naming_target
from .sharded import refuse_sharded
from .snapshot import StateDictLock
from .storage import Placement, Storage, placement

MANIFEST = "MANIFEST.json"
STATE = "state.pt"
FORMAT = "ranksafe-step/1"
_CHUNK = 8 << 20

Status = Literal["committed", "incomplete", "corrupt"]
Entry = tuple[int, int]  # size, crc32


def check_name(name: str, what: str = "name") -> str:
    """Return ``name`` if it is one plain path component that stays inside its directory, else raise."""
    if not isinstance(name, str) or not name or name in (".", "..") or name.startswith("."):
        raise ValueError(f"{what} {name!r} must be a non-empty name that does not start with '.'")
    if "/" in name or "\0" in name or (os.altsep and os.altsep in name) or os.sep in name:
        raise ValueError(f"{what} {name!r} must not contain path separators")
    return name


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, not {step!r}")
    return step


class AtomicDir:
    """The commit protocol for a directory: temporary sibling, manifest written last, rename into place.

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

    def create(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        make_dirs(self.parent)
        os.mkdir(self.tmp)

    def finalize(self, manifest: Mapping[str, Any]) -> None:
        with atomic_write(os.path.join(self.tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        fsync_dir(self.tmp)
        replaced = os.path.isdir(self.final)
        if replaced:
            shutil.rmtree(self._old, ignore_errors=True)
            os.rename(self.final, self._old)
        os.rename(self.tmp, self.final)
        fsync_dir(self.parent)
        if replaced:
            shutil.rmtree(self._old, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def recover(self) -> bool:
        """Put the committed directory back where a crash left it aside: between the two renames of
        :meth:`finalize` replacing it, only the old copy (moved aside) and the new one (still temporary) exist.
        True if it did; the new copy stays debris, as it would be had the crash come before the renames."""
        if os.path.isdir(self._old) and not os.path.exists(self.final):
            os.rename(self._old, self.final)
            return True
        return False


def _crc_file(path: str) -> Entry:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
        os.fsync(f.fileno())  # side files written with a plain open(): make them durable before the commit
    return size, crc


def _walk(directory: str) -> Iterator[str]:
    """Relative paths ('/'-separated) of the files under ``directory``, except the manifest and temporaries."""
    for here, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(here, name), directory).replace(os.sep, "/")
            if rel != MANIFEST and not name.endswith(TMP_SUFFIX):
                yield rel


def build_manifest(directory: str, step: int, known: Mapping[str, Entry]) -> dict[str, Any]:
    """The manifest of ``directory``: every file's size and CRC32 (from ``known`` when the writer reported it)."""
    files = {}
    for rel in _walk(directory):
        size, crc = known[rel] if rel in known else _crc_file(os.path.join(directory, rel))
        files[rel] = {"size": size, "crc32": f"{crc:08x}"}
    return {"format": FORMAT, "step": step, "time": time.time(), "files": files}


def read_manifest(step_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a committed step directory; :class:`CorruptCheckpoint` if missing or unreadable."""
    path = os.path.join(os.fspath(step_dir), MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        if not os.path.isdir(step_dir):
            raise
        raise CorruptCheckpoint(path, "no manifest: the save never committed") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(path, f"unreadable manifest ({e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not (isinstance(files, dict) and manifest.get("format") == FORMAT):
        raise CorruptCheckpoint(path, f"not a {FORMAT} manifest")
    for rel, meta in files.items():  # valid JSON is not a sound manifest: a flipped bit can rename a key
        if not (_inside(rel) and isinstance(meta, dict) and _is_size(meta.get("size")) and _is_crc(meta.get("crc32"))):
            raise CorruptCheckpoint(path, f"damaged manifest entry {rel!r}: {meta!r}"[:300])
    return manifest


def _inside(rel: str) -> bool:
    """Whether a manifest's file name is a relative path that stays inside the step directory."""
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def _is_size(size: Any) -> bool:
    return type(size) is int and size >= 0


def _is_crc(crc: Any) -> bool:
    return isinstance(crc, str) and re.fullmatch("[0-9a-f]{8}", crc) is not None


def verify_step(step_dir: str | os.PathLike, deep: bool = True) -> dict[str, Any]:
    """Check every file of a step directory against its manifest; return the manifest.

    Raises :class:`CorruptCheckpoint` naming the first bad file (missing, wrong size, or with ``deep``
    wrong CRC32), and ``FileNotFoundError`` when the directory does not exist. Local, no collectives.
    """
    step_dir = local_path(step_dir)
    manifest = read_manifest(step_dir)
    for rel, meta in manifest["files"].items():
        path = os.path.join(step_dir, *rel.split("/"))
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CorruptCheckpoint(path, "missing (listed in the manifest)") from None
        if size != meta["size"]:
            raise CorruptCheckpoint(path, f"size is {size} bytes, the manifest says {meta['size']}")
        if deep:
            crc = _crc_file(path)[1]
            if f"{crc:08x}" != meta["crc32"]:
                raise CorruptCheckpoint(path, f"checksum mismatch (crc32 {crc:08x}, manifest says {meta['crc32']})")
    return manifest


@dataclass(frozen=True)
class StepInfo:
    """One step directory as :func:`list_steps` sees it."""

    step: int
    path: str
    status: Status
    size: int  # bytes of the files found
    time: float  # commit time from the manifest, else the directory's modification time
    error: str | None = None


def _step_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^(\.)?{re.escape(prefix)}(\d+)({re.escape(AtomicDir.PARTIAL)})?$")


def list_steps(root: str | os.PathLike, prefix: str = "step_", deep: bool = False) -> list[StepInfo]:
    """Every step directory under ``root``, oldest first, as committed, incomplete or corrupt. Local.

    A step that disappears while it is being looked at (retention, a commit renaming it) is left out.
    """
    root = local_path(root)
    pattern = _step_pattern(prefix)
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        m = pattern.match(name)
        if not m or bool(m.group(1)) != bool(m.group(3)):
            continue
        with contextlib.suppress(FileNotFoundError):
            out.append(_step_info(os.path.join(root, name), int(m.group(2)), bool(m.group(3)), deep))
    return sorted(out, key=lambda s: (s.step, s.status != "committed"))


def _step_info(path: str, step: int, partial: bool, deep: bool) -> StepInfo:
    size = sum(os.stat(os.path.join(path, *rel.split("/"))).st_size for rel in _walk(path))
    status: Status = "committed"
    error, when = None, os.stat(path).st_mtime
    if partial or not os.path.isfile(os.path.join(path, MANIFEST)):
        status = "incomplete"  # a save in progress, a crashed one, or a directory that never committed
    else:
        try:
            written = verify_step(path, deep=deep).get("time")
            when = written if isinstance(written, (int, float)) else when
        except CorruptCheckpoint as e:
            status, error = "corrupt", str(e)
    return StepInfo(step, path, status, size, when, error)


class StepWriter:
    """What every rank holds inside :meth:`CheckpointManager.saving`: the temporary step directory.

    Files written through :meth:`save` are checksummed while they stream to disk, and their size and CRC
    travel to the writer for the manifest; files written directly into :attr:`path` are hashed by the
    writer at commit. Names are plain file names inside the step directory.
    """

    def __init__(self, commit: AtomicDir, step: int):
        self.path = commit.tmp
        self.step = step
        self.entries: dict[str, Entry] = {}
        self._final = commit.final

    def file(self, name: str) -> str:
        """The path of ``name`` inside the temporary step directory."""
        return os.path.join(self.path, check_name(name, "file name"))

    def save(self, obj: Any, name: str) -> str:
        """Write ``obj`` as ``name``: bytes and str as they are, anything else with ``torch.save``. A failed write
        raises its ``OSError`` naming the file as it will be once committed, and the rank."""
        path = self.file(name)
        raw = obj.encode() if isinstance(obj, str) else obj
        try:
            with atomic_write(path) as f:
                whole = ChecksummingWriter(f)
                if isinstance(raw, (bytes, bytearray, memoryview)):
                    whole.write(raw)
                else:  # torch.save + ranksafe footer, as files.atomic_save writes it
                    save_with_footer(obj, whole)
        except OSError as e:
            raise error_naming_target(e, f"cannot save step {self.step}:", os.path.join(self._final, name)) from e
        self.entries[name] = (whole.length, whole.crc)
        return path


def _shard(rank: int) -> str:
    return f"shard-{rank:05d}.pt"


class CheckpointManager:
    """Numbered checkpoints under ``root``: atomic step directories, agreed ``latest``, verified load, retention.

    Every method is a collective (all ranks call it, in the same order), except :meth:`wait`,
    :meth:`shutdown` and :meth:`step_dir`. ``storage``: ``auto`` probes once whether ``root`` is shared or node-local
    (:mod:`ranksafe.storage`); ``shared`` / ``local`` say so. ``keep``: committed steps to keep (``None``:
    all); only writers delete, never the newest committed step or one being loaded, and never before the
    new step is committed.

    ``async_save``: :meth:`save` returns once the state is snapshotted; the writer commits in the background
    (one save in flight: the next save, :meth:`latest` and :meth:`load` wait for it first). ``lock``: the
    :class:`~ranksafe.StateDictLock` the training loop holds around the optimizer step, so that a snapshot
    taken from another thread never sees a half-updated state. Call :meth:`check` regularly and
    :meth:`close` at the end of training.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        keep: int | None = 3,
        storage: Storage = "auto",
        prefix: str = "step_",
        timeout: float | None = None,
        async_save: bool = False,
        lock: StateDictLock | None = None,
    ):
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive int or None, not {keep!r}")
        check_name(prefix + "0", "step prefix")
        if storage not in ("auto", "shared", "local"):
            raise ValueError(f"storage must be 'auto', 'shared' or 'local', not {storage!r}")
        self.root = os.path.abspath(local_path(root))
        self.keep, self.storage, self.prefix, self.timeout = keep, storage, prefix, timeout
        self.loaded_step: int | None = None  # the step the last load() returned (after any fallback)
        self._loading: set[int] = set()
        self._pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")
        # the debris of this manager's steps only: another manager's prefix may extend this one (step_, step_best_)
        ends = "|".join(map(re.escape, (AtomicDir.PARTIAL, AtomicDir.OLD)))
        self._debris = re.compile(rf"^\.({re.escape(prefix)}\d+)(?:{ends})$")
        # writer="all": this manager, not the saver, decides who writes (the storage placement)
        self._saver = AsyncSaver(lock, writer="all", name="checkpoint") if async_save else None

    @property
    def async_save(self) -> bool:
        """Whether the writer commits in the background."""
        return self._saver is not None

    @property
    def saver(self) -> AsyncSaver | None:
        """The background saver with ``async_save`` (for :func:`~ranksafe.async_save.check_savers`), else None."""
        return self._saver

    @property
    def placement(self) -> Placement:
        """Who writes under ``root`` (a collective the first time, with ``storage="auto"``)."""
        return placement(self.root, self.storage, self.timeout)

    def step_dir(self, step: int) -> str:
        """The committed directory of ``step`` (the same path on every rank; no file-system call)."""
        return os.path.join(self.root, f"{self.prefix}{_check_step(step):08d}")

    # -- saving ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def saving(self, step: int, writer_files: Mapping[str, Any] | None = None) -> Iterator[StepWriter]:
        """Open step ``step`` for writing on every rank; commit it when every rank's block is done.

        The writer(s) create the temporary step directory before any rank enters the block, so every rank
        can write its side state into ``writer.path`` (RNG, data loader, user files). ``writer_files``
        (name -> bytes, str, or an object for ``torch.save``) are written by the writer(s) alone, after the
        block. If any rank fails, no rank commits and every rank raises :class:`RankFailure`. Three
        exchanges in all, whatever the world size.

        With ``async_save``: the first exchange is :meth:`check` (after the writer waited for the previous
        commit), and the block's end snapshots ``writer_files`` and hands the commit to the background
        thread instead of the third exchange.
        """
        writer_files = dict(writer_files or {})
        for name in writer_files:
            check_name(name, "file name")
        where = self.placement
        if self._saver is not None:
            if where.writer:
                self._saver.wait()  # create() removes temporaries: the commit in flight must be done first
            self.check()  # a failed background commit stops every rank here, not a step later
        commit = AtomicDir(self.step_dir(step))
        with together(f"checkpoint {step}: create", self.timeout):
            refuse_sharded(writer_files, f"checkpoint {step}")  # every rank: the writers write theirs whole
            if where.writer:
                self._clean_debris()
                commit.create()
        tx = StepWriter(commit, step)
        exc: BaseException | None = None
        try:
            yield tx
        except BaseException as e:
            exc = e
        try:
            posted = exchange_outcome(
                f"checkpoint {step}: written", (topology.node_rank(), tx.entries), exc, list, self.timeout,
                what=f"checkpoint {step}: write",
            )  # fmt: skip
        except BaseException:
            if where.writer:
                commit.abort()
            raise
        for node, entries in posted:
            if where.group is None or node in where.group:
                tx.entries.update(entries)
        if self._saver is None:
            with together(f"checkpoint {step}: commit", self.timeout):
                if where.writer:
                    self._commit(commit, tx, writer_files)
                    self._retain(newest=step)
        elif where.writer:  # the snapshot of writer_files is taken now; a failure is reported by check()
            self._saver.submit(
                writer_files, lambda snapshot: self._commit(commit, tx, snapshot), lambda _: self._retain(newest=step)
            )

    def _commit(self, commit: AtomicDir, tx: StepWriter, writer_files: Mapping[str, Any]) -> str:
        """Writer-local, no collectives: write ``writer_files`` and commit the step; return its directory.

        Everything a background saver has to run for a step, once the directory is open and every rank's
        side files are in. Retention (:meth:`_retain`) comes after, and only once this returned.
        """
        try:
            for name, obj in writer_files.items():
                tx.save(obj, name)
            try:
                commit.finalize(build_manifest(commit.tmp, tx.step, tx.entries))
            except OSError as e:
                raise error_naming_target(e, f"cannot commit step {tx.step}:", commit.final) from e
        except BaseException:
            commit.abort()
            raise
        return commit.final

    def save(self, step: int, state: Any, extra_files: Mapping[str, Any] | None = None, sharded: bool = False) -> str:
        """Save ``state`` as step ``step``; collective. Returns the committed step directory.

        The writer(s) write ``state`` as ``state.pt`` (``sharded=True``: every rank writes its own shard
        instead) and ``extra_files`` (name -> bytes, str, or an object for ``torch.save``). For per-rank
        side files use :meth:`saving`.

        With ``async_save`` it returns once ``state`` and ``extra_files`` are snapshotted: the directory it
        returns is committed later, in the background (:meth:`wait`). Shards and side files are written
        before it returns (every rank's files must be in before the writer commits).
        """
        files = {**({} if sharded else {STATE: state}), **(extra_files or {})}
        with self.saving(step, files) as tx:
            if sharded:
                tx.save(state, _shard(topology.rank()))
        return self.step_dir(step)

    def _committed(self) -> list[int]:
        """Steps committed in this rank's copy of ``root``, oldest first (file-system calls: writers only), with
        any committed step a crash left aside put back first (:meth:`AtomicDir.recover`)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        recovered = False
        for m in filter(None, map(self._debris.match, names)):
            recovered |= AtomicDir(os.path.join(self.root, m.group(1))).recover()
        if recovered:
            names = os.listdir(self.root)
        steps = (int(m.group(1)) for m in map(self._pattern.match, names) if m)
        return sorted(s for s in steps if os.path.isfile(os.path.join(self.step_dir(s), MANIFEST)))

    def _clean_debris(self) -> None:
        """Remove what crashed saves and deletions of this manager's steps left, once a committed step among it
        is put back (:meth:`AtomicDir.recover`)."""
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.root):
                m = self._debris.match(name)
                if m is None:
                    continue
                AtomicDir(os.path.join(self.root, m.group(1))).recover()
                path = os.path.join(self.root, name)
                if os.path.lexists(path):  # not the copy recover() just put back
                    shutil.rmtree(path, ignore_errors=True)

    def _retain(self, newest: int) -> None:
        if self.keep is None:
            return
        committed = self._committed()
        for step in committed[: -self.keep]:
            if step == newest or step in self._loading:
                continue
            doomed = AtomicDir(self.step_dir(step))
            os.rename(doomed.final, doomed.tmp)  # no longer committed before its files go
            shutil.rmtree(doomed.tmp, ignore_errors=True)

    # -- loading --------------------------------------------------------------------------------------

    def _common(self) -> list[int]:
        """Steps committed on every writer's copy, newest first; one exchange, agreed. A writer that cannot list
        its copy (a file in the way, an I/O error) fails every rank, in the same exchange."""
        mine, error = None, None
        if self.placement.writer:
            self.wait()  # the step in flight, and the retention after it, are done before listing
            try:
                mine = self._committed()
            except OSError as e:
                error = error_naming_target(e, "cannot list the checkpoints in", self.root)
        what = f"checkpoint {self.root}: steps"
        return exchange_outcome("checkpoint: steps", mine, error, _newest_common, self.timeout, what=what)

    def latest(self) -> int | None:
        """The newest step committed on every node, the same on every rank; ``None`` when there is none."""
        common = self._common()
        return common[0] if common else None

    def load(
        self,
        step: int | None = None,
        fallback: bool = False,
        map_location: Any = "cpu",
        weights_only: bool | None = True,
        sharded: bool = False,
    ) -> Any:
        """Load step ``step`` (default: :meth:`latest`) on every rank after verifying it; collective.

        The writer(s) check every file against the manifest first. A corrupt step raises
        :class:`CorruptCheckpoint` on every rank, naming the file, unless ``fallback`` is set (and ``step``
        is not): then the previous good step loads, with a warning. :attr:`loaded_step` says which step.
        """
        common = self._common()
        if step is not None:
            if _check_step(step) not in common:
                raise FileNotFoundError(f"step {step} is not committed on every node under {self.root}")
            candidates = [step]
        elif not common:
            raise FileNotFoundError(f"no committed checkpoint under {self.root}")
        else:
            candidates = common if fallback else common[:1]
        self._loading.update(candidates)  # retention must not delete what is being read
        try:
            for s in candidates:
                bad = self._verify(s)
                if bad is None:
                    break
                if s == candidates[-1]:
                    raise bad
                previous = candidates[candidates.index(s) + 1]
                warnings.warn(f"{bad}; falling back to step {previous}", RuntimeWarning, stacklevel=2)
            result = None
            with together(f"checkpoint {s}: load", self.timeout):
                path = os.path.join(self.step_dir(s), _shard(topology.rank()) if sharded else STATE)
                result = load_file(path, map_location=map_location, weights_only=weights_only)
        finally:
            self._loading.difference_update(candidates)
        self.loaded_step = s
        return result

    # -- background saves ------------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> bool:
        """Block until this rank's background commit (if any) is done; False on timeout. Local.

        Never raises the commit's error: :meth:`check` does, on every rank at once.
        """
        return True if self._saver is None else self._saver.wait(timeout)

    def shutdown(self) -> None:
        """Wait for this rank's background commit, then stop the saver's threads; local. Stays usable."""
        if self._saver is not None:
            self._saver.shutdown()

    def poll(self) -> None:
        """The per-step check for training loops: a failed background commit is raised on every rank at the next
        call (:meth:`~ranksafe.AsyncSaver.poll`). Every rank, once per step; one store read while no rank has a
        failure, and none without ``async_save``."""
        if self._saver is not None:
            self._saver.poll()

    def check(self) -> None:
        """Raise :class:`~ranksafe.RankFailure` on every rank if a background commit failed on any rank.

        Collective, one exchange (also without ``async_save``: every rank may call it unconditionally), which
        waits for every rank. It does not wait for the commit in flight; each failure is reported once. In a
        single process the original error is raised unchanged.
        """
        if self._saver is not None:
            self._saver.check()
        else:
            share_outcome("checkpoint: check", None, self.timeout)

    def close(self) -> None:
        """Wait for the commit in flight, then :meth:`check`; collective. Call it at the end of training.

        Afterwards no thread of this manager is running. The manager stays usable. Its exchange is named apart
        from :meth:`check`'s: a rank that stopped early and closes, while another checks at its next epoch, is a
        :class:`~ranksafe.CollectiveMismatch` on both instead of a pair that lets the other go on alone.
        """
        if self._saver is not None:
            self._saver.close()
        else:
            share_outcome("checkpoint: close", None, self.timeout)

    def _verify(self, step: int) -> BaseException | None:
        """The agreed verdict of the writers' deep check of ``step``: None, or the error to raise everywhere."""
        exc = None
        if self.placement.writer:
            try:
                verify_step(self.step_dir(step))
            except Exception as e:  # whatever the writer met, every rank must hear of it in the exchange below
                exc = e
        try:
            share_outcome(f"checkpoint {step}: verify", exc, self.timeout, what=f"verify step {step}")
        except (BarrierTimeout, CollectiveMismatch):  # a rank missing says nothing about the step: no fallback
            raise
        except Exception as e:  # RankFailure; in a single process, the writer's own error
            return e
        return None


def _newest_common(listed: list[list[int] | None]) -> list[int]:
    """The steps every writer listed (non-writers list ``None``), newest first."""
    sets = [set(steps) for steps in listed if steps is not None]
    return sorted(set.intersection(*sets), reverse=True) if sets else []
