"""Numbered step directories that appear complete or not at all, on every node: CheckpointManager.

Layout::

    root/step_00000010/state.pt        the state, written by the writer(s)
    root/step_00000010/...             side files any rank wrote during the save (RNG, data loader, user files)
    root/step_00000010/MANIFEST.json   every file with its size and CRC32; written last
    root/.step_00000011.ranksafe-partial   a save in progress (or the debris of a crashed one)

``root`` may be a URL of remote storage (``s3://bucket/run``): there a step's files go straight under its
prefix and the manifest, written last, commits it (:mod:`ranksafe.commit` holds both commit protocols).
:class:`CheckpointManager` decides who runs which part: the writer(s) chosen by :mod:`ranksafe.storage` create,
commit and delete; every rank may write side files between create and commit; ranks that write nothing make no
file-system call. A save's exchanges and the writer's commit are in :mod:`ranksafe.step_save`; which step a load
reads, in :mod:`ranksafe.step_agreement`; which steps stay, in :mod:`ranksafe.retention`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from . import remote, topology
from .async_save import AsyncSaver
from .checkpoint_file import load_file
from .collectives import checked_timeout, default_timeout, share_outcome, together
from .commit import DirCommit, Place, StepWriter, join, name_of, step_commit
from .files import local_path
from .flatten import Flattened
from .lock import StateDictLock
from .remote import Remote
from .retention import BestMode, KeptSteps, Retention
from .schedule import SaveSchedule
from .sharded import METADATA, for_dcp, require_shared
from .step_agreement import committed_everywhere, first_good, loadable
from .step_save import STATE, agree_written, commit_step, commit_together, open_step, passing_over_a_partial_commit
from .steps import StepDirs
from .storage import Placement, Storage, check_every_rank_sees, placement, probe_root

if TYPE_CHECKING:
    from .shards import StepShards

__all__ = ["STATE", "CheckpointManager"]


def _shard(rank: int) -> str:
    return f"shard-{rank:05d}.pt"


class CheckpointManager:
    """Numbered checkpoints under ``root``: atomic step directories, agreed ``latest``, verified load, retention.

    Every method is a collective (all ranks call it, in the same order), except :meth:`wait`, :meth:`shutdown`,
    :meth:`step_dir` and :meth:`step_of`. ``storage``: ``auto`` probes once whether ``root`` is shared or
    node-local (:mod:`ranksafe.storage`); ``shared`` / ``local`` say so. ``keep``: committed steps to keep (``None``:
    all); only writers delete, never the newest committed step or one being loaded, and never before the
    new step is committed. With a writer per node, the new step counts only from the next save on (until every
    node is known to hold it), so each node keeps up to ``keep + 1``.

    ``async_save``: :meth:`save` returns once the state is snapshotted; the writer commits in the background
    (one save in flight: the next save, :meth:`latest` and :meth:`load` wait for it first). ``lock``: the
    :class:`~ranksafe.StateDictLock` the training loop holds around the optimizer step, so that a snapshot
    taken from another thread never sees a half-updated state. Call :meth:`check` regularly and
    :meth:`close` at the end of training.

    ``root`` may be a URL of remote storage (``s3://bucket/run``; ``storage_options`` for its fsspec file
    system): every rank shares it, rank 0 writes, and a step is committed by its manifest, written last
    (:mod:`ranksafe.commit`). :meth:`warmup` checks before training that the root can be written.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        keep: int | None = 3,
        storage: Storage | str = Storage.AUTO,
        async_save: bool = False,
        save_interval_steps: int | None = None,
        save_interval_seconds: float | None = None,
        keep_period: int | None = None,
        best_metric: str | None = None,
        best_mode: BestMode | str = BestMode.MIN,
        keep_best: int = 0,
        preemption: bool | Iterable[int] = False,
        *,
        prefix: str = "step_",
        timeout: float | None = None,
        lock: StateDictLock | None = None,
        storage_options: dict[str, Any] | None = None,
    ):
        self.retention = Retention(keep, keep_period, best_metric, best_mode, keep_best)
        self.schedule = SaveSchedule(save_interval_steps, save_interval_seconds, preemption, f"checkpoint {prefix}")
        if not os.fspath(root):
            raise ValueError("root must name a directory, not ''")  # abspath('') would be the working directory
        storage = Storage(storage)
        if remote.is_url(root):
            placement(root, storage)  # refuses storage="local" now, not at the first save
            self._base: Place = Remote.of(root, storage_options)
        else:
            self._base = os.path.abspath(local_path(root))  # local_path expands ~, as ModelCheckpoint does
        self.root = name_of(self._base)
        self.storage_options = storage_options
        self.storage, self.prefix, self.timeout = storage, prefix, checked_timeout(timeout)
        self.loaded_step: int | None = None  # the step the last load() returned (after any fallback)
        self._handed: StepWriter | None = None  # the step this writer last handed to the background saver
        self._dirs = StepDirs(self._base, prefix)
        self._kept = KeptSteps(self._dirs, self.retention)  # which steps count, and retention after each commit
        # writer="all": this manager, not the saver, decides who writes (the storage placement)
        self._saver = AsyncSaver(lock, writer="all", name="checkpoint", timeout=self.timeout) if async_save else None
        self.schedule.install()

    # -- schedules and preemption ---------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``, the same on every rank: every ``save_interval_steps`` steps, when
        ``save_interval_seconds`` passed since the last save on rank 0's clock, and when :meth:`reached_preemption`.
        Every rank, at every step boundary (after the optimizer step); one store read per step at most."""
        return self.schedule.should_save(step)

    def reached_preemption(self, step: int) -> bool:
        """True on every rank from the first common step boundary after any rank received a preemption signal
        (``preemption=True``: SIGTERM or SIGUSR1). Then save this step (:meth:`should_save` says so too), leave the
        training loop and end the process normally: the next launch resumes from that step. Every rank, at every
        step boundary; one store read per step while no rank was signalled."""
        return self.schedule.reached_preemption(step)

    @property
    def preempted(self) -> bool:
        """Local: whether :meth:`reached_preemption` has returned True."""
        return self.schedule.preempted

    @property
    def keep(self) -> int | None:
        """Committed steps kept, newest first (``None``: all); see :attr:`retention` for the other rules."""
        return self.retention.keep

    @property
    def async_save(self) -> bool:
        """Whether the writer commits in the background."""
        return self._saver is not None

    @property
    def saver(self) -> AsyncSaver | None:
        """The background saver with ``async_save`` (for :func:`~ranksafe.saver_failures.check_savers`), else None."""
        return self._saver

    @property
    def placement(self) -> Placement:
        """Who writes under ``root`` (a collective the first time, with ``storage="auto"``; remote storage is
        shared by every rank: rank 0 writes)."""
        return placement(self.root, self.storage, self.timeout)

    def step_dir(self, step: int) -> str:
        """The committed directory (or URL) of ``step`` (the same on every rank; no file-system call)."""
        return name_of(self._dirs.place(step))

    def step_of(self, path: str | os.PathLike) -> int | None:
        """The step whose directory, or whose ``state.pt``, ``path`` is; None for any other path. Local."""
        place = remote.canonical(path)
        if place.endswith("/" + STATE):
            place = place[: -len(STATE) - 1]
        return self._dirs.step_of(place)

    def warmup(self, example_state: Any = None) -> None:
        """Before training, on every rank: fail now, not at the first save, when ``root`` cannot be written (a file
        in the way, a missing permission, a bucket that does not exist or no credentials) or, on remote storage,
        is not the same for every rank (``memory://`` lives in one process), or a local root has no room for
        ``example_state``'s tensors; with ``async_save``, also allocate the staging buffers for it. Collective."""
        where, probe = self.placement, None
        shards = None if example_state is None else for_dcp(example_state)
        if shards is not None:  # sharded state: refused now on storage that cannot hold it; every rank stages
            require_shared(where, self.root)
        with together(f"checkpoint {self.root}: warmup", self.timeout):
            if self._saver is not None and example_state is not None and (where.writer or shards is not None):
                self._saver.stage(example_state if shards is None else shards)  # after the write in flight
            if where.writer:  # room for the writer's files (about their tensors' bytes); each rank's shards not counted
                whole = example_state is not None and shards is None
                needs = sum(t.nbytes for t in Flattened(example_state).sources) if whole else 0
                probe = probe_root(self._base, needs)
        if isinstance(self._base, Remote):
            check_every_rank_sees(self._base, probe, self.timeout)

    # -- saving ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def saving(
        self,
        step: int,
        writer_files: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        *,
        shards: dict[str, Any] | None = None,
    ) -> Iterator[StepWriter]:
        """Open step ``step`` for writing on every rank; commit it when every rank's block is done.

        The writer(s) create the temporary step directory before any rank enters the block, so every rank
        can write its side state into ``writer.path`` (RNG, data loader, user files). ``writer_files``
        (name -> bytes, str, or an object for ``torch.save``) are written by the writer(s) alone, after the
        block. If any rank fails before the commit, no rank commits and every rank raises :class:`RankFailure`.
        With a writer per node, one writer's commit can fail after another's succeeded: every rank raises, and the
        step stays on that other node only, where :meth:`latest` (the newest step on every node) does not count it,
        nor holds a resumed run's lower saves back there.
        Three exchanges in all, whatever the world size.

        With ``async_save``: the first exchange is :meth:`check` (after the writer waited for the previous
        commit), and the block's end snapshots ``writer_files`` and hands the commit to the background
        thread instead of the third exchange.

        ``metrics`` (name -> number) go into the step's manifest, and rank 0's are taken on every node (they travel
        in the exchange that follows the block): with a ``best_metric`` they rank the steps for retention, and every
        node keeps the same steps.

        ``shards``: state holding ``DTensor`` objects, which every rank writes its part of with
        ``torch.distributed.checkpoint`` (:mod:`ranksafe.shards`) once every rank's block is done, before the
        commit (with ``async_save``: every rank snapshots it at the end of its block, and writes it in the
        background). The root must be shared by every rank.
        """
        writer_files = dict(writer_files or {})
        where = self.placement
        if self._saver is not None:
            if where.writer or shards is not None:  # sharded: every rank writes, so every rank waits
                self._saver.wait()  # the temporaries of a crashed save are removed next: the commit in flight first
            self.check()  # a failed background commit stops every rank here, not a step later
        commit = step_commit(self._dirs.place(step))
        metrics = open_step(commit, step, self._kept, where, writer_files, metrics, shards is not None, self.timeout)
        tx = StepWriter(commit, step)
        part = None if shards is None else self._shards(shards, commit, tx, where.writer)  # every rank
        exc: BaseException | None = None
        try:
            yield tx
            if part is not None:  # sharded: with async_save, every rank snapshots its part now
                part.after_block(writer_files)
        except BaseException as e:
            exc = e
        agree_written(tx, commit, where, part, metrics, writer_files, exc, self.timeout)
        self.schedule.saved()
        if part is not None:
            part.agreed()  # every rank writes its part now, or in the background (then the writer commits there)
        if self._saver is None:
            commit_together(commit, tx, where.writer, writer_files, self._kept, self.timeout)
        elif where.writer and part is None:  # the snapshot of writer_files is taken now; check() reports a failure
            self._submit(commit, tx, writer_files)

    def _submit(self, commit: DirCommit, tx: StepWriter, writer_files: Mapping[str, Any]) -> None:
        """Hand the commit of ``writer_files`` to the background saver; a snapshot that failed (which the next
        :meth:`check` reports) leaves no temporary directory behind, as no commit is coming to use it."""
        what = f"step {tx.step} of {remote.where(self.root)}"
        self._handed = tx
        try:
            handed = self._saver.submit(writer_files, functools.partial(self._commit, commit, tx), what=what)  # type: ignore[union-attr]
        except BaseException:  # Ctrl-C in the snapshot: unless it was handed on, no write will commit or abort it
            if not (commit.committed or self._saver.in_flight):  # type: ignore[union-attr]
                commit.abort()
            raise
        if not handed:  # the saver waits for a write in flight, never skips: False means the snapshot failed
            commit.abort()

    def _commit(self, commit: DirCommit, tx: StepWriter, writer_files: Mapping[str, Any]) -> str:
        """The writer's part of a save, for this manager's steps (:func:`~ranksafe.step_save.commit_step`)."""
        return commit_step(commit, tx, writer_files, self._kept)

    def _shards(self, shards: dict[str, Any], commit: DirCommit, tx: StepWriter, writer: bool) -> StepShards:
        """The sharded part of step ``tx.step`` (:class:`~ranksafe.shards.StepShards`); with ``async_save`` the
        writer commits (:meth:`_commit`) on the saver's thread once every rank's part is written."""
        from .shards import StepShards  # DCP, imported where a step holds sharded state (see ranksafe.shards)

        timeout = self.timeout or default_timeout()
        commit_in_background = functools.partial(self._commit, commit, tx)
        return StepShards(
            shards, tx.path, tx.step, tx.entries, writer, commit.abort, self._saver, commit_in_background, timeout
        )

    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None = None,
        *,
        extra_files: Mapping[str, Any] | None = None,
        sharded: bool = False,
    ) -> str:
        """Save ``state`` as step ``step``; collective. Returns the committed step directory.

        The writer(s) write ``state`` as ``state.pt`` (``sharded=True``: every rank writes its own shard
        instead) and ``extra_files`` (name -> bytes, str, or an object for ``torch.save``). For per-rank
        side files use :meth:`saving`.

        A ``state`` holding ``DTensor`` objects (FSDP2, tensor parallelism; a dict of the state dicts
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` returns, or of ``Stateful`` objects), or FSDP1's
        ``ShardedTensor`` objects (synchronous saves only), is saved with ``torch.distributed.checkpoint`` instead:
        every rank writes its own shards, plain tensors and other values go with them, and :meth:`load` with
        ``into=`` reads it back at any world size. The root must be shared by every rank.

        With ``async_save`` it returns once ``state`` and ``extra_files`` are snapshotted: the directory it
        returns is committed later, in the background (:meth:`wait`). Shards and side files are written
        before it returns (every rank's files must be in before the writer commits). ``metrics``: see
        :meth:`saving`.
        """
        shards = None if sharded else for_dcp(state)  # DTensors: every rank writes its part (ranksafe.sharded)
        whole = not sharded and shards is None  # else no state.pt: every rank writes its own part of the state
        files = {STATE: state, **(extra_files or {})} if whole else dict(extra_files or {})
        with self.saving(step, files, metrics, shards=shards) as tx:
            if STATE in (extra_files or {}):  # raised in the block: every rank hears of it after it
                raise ValueError(  # also where the state is sharded: a load without into= would take it for the state
                    f"checkpoint {step}: an extra file is named {STATE}, the name of a step's whole state; rename it"
                )
            if sharded:
                tx.save(state, _shard(topology.rank()))
        return self.step_dir(step)

    # -- loading --------------------------------------------------------------------------------------

    def _common(self) -> list[int]:
        """Steps committed on every writer's copy, newest first; agreed (:mod:`ranksafe.step_agreement`)."""
        writer = self.placement.writer
        if writer:
            self.wait()  # the step in flight, and the retention after it, are done before listing
        listed = committed_everywhere(self._dirs, writer, self.root, self.timeout)
        self._kept.passed_over |= listed.here_only  # training resumes below them: on this node, they must not stop it
        return listed.everywhere

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
        *,
        into: dict[str, Any] | None = None,
        read: Callable[[str], Any] | None = None,
    ) -> Any:
        """Load step ``step`` (default: :meth:`latest`) on every rank after verifying it; collective.

        The writer(s) check every file against the manifest first. A corrupt step raises
        :class:`CorruptCheckpoint` on every rank, naming the file, unless ``fallback`` is set (and ``step``
        is not): then the previous good step loads, with a warning. :attr:`loaded_step` says which step. Training
        may then save steps below the damaged one: a resume falls back over it again to the newest of them. Any
        other error (an I/O error, say) raises on every rank, with or without ``fallback``.

        ``into``: a step saved with sharded state loads in place into this state, which is returned (its
        ``DTensor`` objects get this rank's part, resharded to their current mesh and placements; ``Stateful``
        values get their state): build it as for saving, from the model and optimizer of this job, at any
        world size. Every rank checks its share of the step's files first.

        ``read``: what reads the verified step's ``state.pt`` (given its path) in place of ranksafe's reader: a
        framework's loader that puts the state into the model and optimizers as it reads (``map_location`` and
        ``weights_only`` are then its business).
        """
        if into is not None and not isinstance(into, Mapping):
            raise TypeError(f"into must be a dict of state to load into, not {type(into).__name__}")
        candidates = loadable(self._common(), step, fallback, self.root)
        if into is not None:
            require_shared(self.placement, self.root)
        with self._kept.reading(candidates):  # retention must not delete what is being read
            s = first_good(self._dirs, candidates, self.placement.writer, into is not None, self.timeout, self._kept)
            if into is not None:  # sharded: every rank reads its part in place (a failure is shared by DCP)
                from .shards import read_shards  # DCP, imported where a step holds sharded state

                result = read_shards(into, name_of(self._dirs.place(s)), f"checkpoint {s}: load", weights_only)
            else:
                with together(f"checkpoint {s}: load", self.timeout):
                    result = self._read_file(s, map_location, weights_only, sharded, read)
        self.loaded_step = s
        return result

    def _read_file(
        self, step: int, map_location: Any, weights_only: bool | None, per_rank: bool, read: Callable[[str], Any] | None
    ) -> Any:
        """Step ``step``'s ``state.pt``, or this rank's file; a step that holds sharded state instead says so."""
        place = self._dirs.place(step)
        path = name_of(join(place, _shard(topology.rank()) if per_rank else STATE))
        try:
            if read is not None:
                return read(path)
            return load_file(path, map_location, weights_only, storage_options=self.storage_options)
        except FileNotFoundError:
            if not per_rank and remote.exists(name_of(join(place, METADATA)), self.storage_options):
                raise ValueError(f"{name_of(place)} holds sharded state: load it with into=") from None
            raise

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
            with passing_over_a_partial_commit(self._handed, self._kept, self._saver):
                self._saver.poll()

    def check(self) -> None:
        """Raise :class:`~ranksafe.RankFailure` on every rank if a background commit failed on any rank.

        Collective, one exchange (also without ``async_save``: every rank may call it unconditionally), which
        waits for every rank. It does not wait for the commit in flight; each failure is reported once. In a
        single process the original error is raised unchanged.
        """
        if self._saver is not None:
            with passing_over_a_partial_commit(self._handed, self._kept, self._saver):
                self._saver.check()
        else:
            share_outcome("checkpoint: check", None, self.timeout)

    def close(self, keep_signal: bool = False) -> None:
        """Wait for the commit in flight, then :meth:`check`; collective. Call it at the end of training.

        Afterwards no thread of this manager is running, and the preemption signals are handled as they were before
        it. Until the commit is in, a signal is still only recorded: one that no agreed stop answered (it came after
        the last step boundary, or during this call) then gets the default action the recording held back (the
        process ends; a handler installed before had it when it came). ``keep_signal``: the next fit of the process
        gets it instead, and stops at its second step boundary (the fastai and Lightning callbacks close at each
        fit's end). The manager stays usable; it records preemption signals again once
        ``manager.schedule.install()`` is called (the fastai and Lightning callbacks call it at the start of each
        fit). Its exchange is named apart from :meth:`check`'s: a rank that stopped early and closes, while another
        checks at its next epoch, is a :class:`~ranksafe.CollectiveMismatch` on both instead of a pair that lets the
        other go on alone.
        """
        try:
            if self._saver is not None:
                with passing_over_a_partial_commit(self._handed, self._kept, self._saver):
                    self._saver.close()
            else:
                share_outcome("checkpoint: close", None, self.timeout)
        finally:
            self.schedule.uninstall()
            if keep_signal:  # also when the check raised
                self.schedule.pass_on_unanswered(keep=True)
        self.schedule.pass_on_unanswered()
