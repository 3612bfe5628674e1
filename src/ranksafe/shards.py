"""Sharded state through ``torch.distributed.checkpoint`` (DCP) inside a step's commit: every rank writes its shards
with DCP's ``FileSystemWriter``, each file counted and CRC'd for the step's manifest, and reads them back with
``dcp.load``, resharded to the current placements. What is sharded, and why it needs this: :mod:`ranksafe.sharded`.

Imported where a step holds sharded state, not with ranksafe: DCP (and ``DTensor`` with it) costs most of a second at
import, in every process of a job, and most jobs never save a DTensor.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import IO, TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.futures import Future

from . import topology
from .checkpoint_file import ChecksummingWriter
from .collectives import together
from .commit import Entry
from .errors import Failure, RankFailure, UntrustedCheckpoint, error_naming_target, rank_failure
from .sharded import METADATA
from .torch_compat import DCP_METADATA_GLOBALS

if TYPE_CHECKING:
    from .async_save import AsyncSaver


# -- writing ----------------------------------------------------------------------------------------------


class _ShardFile(ChecksummingWriter):
    """A file DCP writes: counted and CRC'd on its way to disk, with the calls DCP makes of its stream."""

    def __init__(self, f: IO[bytes]):
        super().__init__(f)
        self.file = f

    def tell(self) -> int:
        return self.length  # a new file, written from its start: DCP records each item's offset

    def fileno(self) -> int:
        self.file.flush()  # DCP fsyncs this descriptor next: what its pickler wrote (.metadata) may still be buffered
        return self.file.fileno()

    def close(self) -> None:
        self.file.close()


class _CountingFileSystem(FileSystem):
    """DCP's local file system, remembering the size and CRC32 of every file written through it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, Entry] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as f:
            if "w" not in mode:
                yield f
                return
            out = _ShardFile(f)
            try:
                yield out
            except Exception as e:  # torch.save turns a failed write into a RuntimeError that names no cause
                if out.error is not None and e is not out.error:
                    raise error_naming_target(out.error, "cannot write", path) from e
                raise
        self.written[os.path.basename(path)] = (out.length, out.crc)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # the coordinator's .metadata.tmp becomes .metadata
        entry = self.written.pop(os.path.basename(path), None)
        if entry is not None:
            self.written[os.path.basename(new_path)] = entry


class _Files:
    """One rank's files, carried to DCP's coordinator among that rank's write results (and taken out there before
    DCP records the results in ``.metadata``)."""

    def __init__(self, written: dict[str, Entry]):
        self.written = written


class StepShardWriter(dcp.FileSystemWriter):
    """DCP's ``FileSystemWriter`` whose :attr:`entries` are the size and CRC32 of the files it knows of: this
    rank's own, and on DCP's coordinator every rank's, ``.metadata`` included, once the save is done."""

    def __init__(self, directory: str):
        super().__init__(directory)
        self.fs = _CountingFileSystem()
        self.entries: dict[str, Entry] = {}

    def write_data(self, plan: Any, planner: Any) -> Future:
        results = super().write_data(plan, planner).wait()  # written by now: the future is already complete
        self.entries.update(self.fs.written)
        done: Future = Future()
        done.set_result([*results, _Files(dict(self.fs.written))])
        return done

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        for ours in results:
            for files in (r for r in ours if isinstance(r, _Files)):
                self.entries.update(files.written)
        super().finish(metadata, [[r for r in ours if not isinstance(r, _Files)] for ours in results])
        self.entries.update(self.fs.written)  # .metadata


@contextlib.contextmanager
def _failures_shared_by_dcp(what: str) -> Iterator[None]:
    """DCP's failure, which every rank got from DCP's own collectives, as the same :class:`~ranksafe.RankFailure`
    on every rank (the failing rank chains its own error); in a single process, the error itself."""
    try:
        yield
    except dcp.CheckpointException as e:
        own = e.failures.get(topology.rank())
        if own is not None and topology.world_size() == 1:
            raise own[0] from None
        failures = [Failure.from_exception(rank, error) for rank, (error, _) in sorted(e.failures.items())]
        raise rank_failure(what, failures) from (own[0] if own else None)


def _no_dist() -> bool:
    return not topology.is_distributed()


def write_shards(
    state: dict[str, Any], directory: str, what: str, group: dist.ProcessGroup | None = None
) -> dict[str, Entry]:
    """Every rank: write this rank's shards of ``state`` into ``directory`` with ``dcp.save``; return the files this
    rank knows of (its own; on the coordinator, every rank's). ``group``: the process group for DCP's collectives
    (the default one when None).

    A failure on any rank raises the same :class:`~ranksafe.RankFailure` on every rank (its own error chained on
    the failing rank): DCP shares it. A rank that dies is a backend error on the others, after the group's timeout
    at worst: DCP's collectives are the backend's.
    """
    writer = StepShardWriter(directory)
    with _failures_shared_by_dcp(what):
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=_no_dist())
    return writer.entries


class _WriteGate:
    """What a background write of shards waits for: the exchange that tells whether every rank took its snapshot.
    A rank must not enter DCP's collectives alone: the others would wait there for the group's timeout."""

    def __init__(self) -> None:
        self._decided = threading.Event()
        self._go = False

    def settle(self, go: bool) -> None:
        """The training thread: write (``go``), or give the step up."""
        self._go = go
        self._decided.set()

    def wait(self) -> bool:
        """The writer thread: whether to write."""
        self._decided.wait()
        return self._go


_background: dict[int, dist.ProcessGroup] = {}


def background_group(timeout: float) -> dist.ProcessGroup | None:
    """A gloo process group for saves on a background thread, made once per default group; collective (every rank,
    from the training thread). The training thread's own collectives (FSDP's all-gathers) keep the default group,
    so no two threads pair their collectives on one group. None without a process group."""
    if _no_dist():
        return None
    key = id(dist.group.WORLD)
    if key not in _background:
        _background[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    return _background[key]


class StepShards:
    """The sharded part of one step's save, where :meth:`CheckpointManager.saving` calls it, on every rank:

    * :meth:`after_block`: with a background saver, this rank snapshots its part now, and its write waits for the
      exchange that follows (a snapshot that fails is this rank's failure there);
    * :meth:`agreed`, once that exchange agreed: the part is written now, or its background write goes ahead (then
      the writer commits: ``commit(writer_files)``);
    * :meth:`given_up`, when the exchange failed: the background write never starts.

    Made by every rank at an agreed point: with a background saver it may make the background group (a collective).
    ``entries`` (the step's file entries) gets the files written; ``abort`` removes the step's temporary (writer).
    """

    def __init__(
        self,
        state: dict[str, Any],
        directory: str,
        step: int,
        entries: dict[str, Entry],
        writer: bool,
        abort: Callable[[], None],
        saver: AsyncSaver | None,
        commit: Callable[[Mapping[str, Any]], Any],
        timeout: float,
    ):
        self.state, self.directory, self.step, self.entries, self.writer = state, directory, step, entries, writer
        self._abort, self._saver, self._commit = abort, saver, commit
        self._gate = _WriteGate()
        self._group = None if saver is None else background_group(timeout)
        self._what = f"checkpoint {step}: shards"

    def after_block(self, writer_files: Mapping[str, Any]) -> None:
        snapshot = (self.state, writer_files if self.writer else {})
        if self._saver is not None and not self._saver.submit(snapshot, self._background):
            raise self._saver.take_error() or RuntimeError(f"{self._what}: no snapshot")

    def given_up(self) -> None:
        self._gate.settle(go=False)

    def agreed(self) -> None:
        if self._saver is not None:
            self._gate.settle(go=True)
            return
        try:  # a failure on any rank is the same RankFailure on every rank (DCP shares it)
            self.entries.update(write_shards(self.state, self.directory, self._what))
        except BaseException:
            if self.writer:
                self._abort()
            raise

    def _background(self, snapshot: tuple[dict[str, Any], Mapping[str, Any]]) -> Any:
        """The writer thread, every rank: write this rank's part once every rank has its snapshot, then the writer
        commits. A failure of DCP's is reported by the ranks that failed (``check()`` or ``poll()`` raises it on
        every rank)."""
        if not self._gate.wait():  # a rank failed before the write: every rank gave the step up
            return None
        state, writer_files = snapshot
        try:
            self.entries.update(write_shards(state, self.directory, self._what, self._group))
        except BaseException as e:
            if self.writer:
                self._abort()
            if not isinstance(e, RankFailure):
                raise
            if topology.rank() in e.ranks:
                raise (e.__cause__ or e) from None
            return None
        return self._commit(writer_files) if self.writer else None


# -- loading ------------------------------------------------------------------------------------------------


class _WeightsOnlyPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner, whose non-tensor values (read with ``torch.load(weights_only=False)`` by DCP) must load
    with ``weights_only=True`` first: a checkpoint must not run code on load unless the caller trusts it."""

    def __init__(self, directory: str):
        super().__init__()
        self.directory = directory

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:  # torch's page of advice: the line naming the refused object matters
            lines = str(e).splitlines() or [type(e).__name__]
            why = next((line.strip() for line in lines if "WeightsUnpickler error" in line), lines[-1])
            reason = f"{read_item.dest_index.fqn}: {why.split('. Please use')[0]}"
            raise UntrustedCheckpoint(self.directory, reason) from None
        value.seek(0)
        super().load_bytes(read_item, value)


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` refusing any global but DCP's own metadata classes: DCP loads it with
    ``pickle.load``, where a checkpoint from elsewhere could run code."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}, which is no part of DCP's metadata")


class _CheckedMetadataFileSystem(FileSystem):
    """DCP's local file system, whose ``.metadata`` reaches DCP only once :class:`_MetadataUnpickler` has read it."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as f:
            if "r" not in mode or not os.fspath(path).endswith(METADATA):
                yield f
                return
            data = f.read()
            try:
                _MetadataUnpickler(io.BytesIO(data)).load()
            except pickle.UnpicklingError as e:
                raise UntrustedCheckpoint(path, str(e)) from None
            yield io.BytesIO(data)


def read_shards(into: dict[str, Any], directory: str, what: str, weights_only: bool | None = True) -> dict[str, Any]:
    """Every rank: load the DCP state in ``directory`` into ``into``, in place (``dcp.load``: resharded to the
    tensors' current placements, ``Stateful`` values given their state); return ``into``. Weights-only (unless
    ``weights_only=False``): DCP's index and the non-tensor values may name no class but theirs.

    A failure on any rank raises the same :class:`~ranksafe.RankFailure` on every rank, as :func:`write_shards`."""
    reader = dcp.FileSystemReader(directory)
    planner = None
    if weights_only is not False:
        reader.fs, planner = _CheckedMetadataFileSystem(), _WeightsOnlyPlanner(directory)
        # refused here, before DCP's collectives, with the same error on every rank (a rank alone would leave the
        # others waiting in DCP's)
        with (
            together(f"{what}: index", what=f"{what}: {METADATA}"),
            reader.fs.create_stream(os.path.join(directory, METADATA), "rb"),
        ):
            pass
    with _failures_shared_by_dcp(what):
        dcp.load(into, storage_reader=reader, planner=planner, no_dist=_no_dist())
    return into
