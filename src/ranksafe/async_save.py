"""Checkpoints written in the background: the caller is blocked only while a snapshot is taken.

:class:`AsyncSaver` snapshots the state into reusable staging buffers (under the read side of a
:class:`~ranksafe.lock.StateDictLock`, so never mid-step) and hands the snapshot to a writer thread that
commits it with the same atomic protocol as a synchronous save (:func:`ranksafe.checkpoint_file.save_file`).

Failures travel like every ranksafe failure: the background thread records its exception, and every rank
raises the same :class:`~ranksafe.RankFailure`, at the next step with :meth:`AsyncSaver.poll`, or in
:meth:`AsyncSaver.check` and :meth:`AsyncSaver.close` (how: :mod:`ranksafe.saver_failures`). The background
thread itself never runs a collective: it would race the training thread's collectives for the shared sequence.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from . import remote
from .after_commit import AfterCommit, WriteState
from .checkpoint_file import probe_write, save_file
from .choice import Choice
from .collectives import checked_timeout, together
from .errors import naming_target
from .files import local_path
from .lock import StateDictLock
from .notice import StepNotice
from .parked_thread import ParkedThread
from .process_exit import at_exit
from .saver_failures import check_savers, poll_savers
from .saving import Writer, is_writer
from .sharded import refuse_sharded
from .snapshot import Captured, StagingBuffers


class BusyPolicy(Choice):
    """What :meth:`AsyncSaver.save` does while the previous write still runs: ``wait`` for its commit, or ``skip``."""

    WAIT = "wait"
    SKIP = "skip"


OnCommit = Callable[[Any], None]

_live: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()


class AsyncSaver:
    """Save checkpoints from a background thread; at most one write in flight.

    Args:
        lock: the :class:`StateDictLock` the training loop holds (write side) around the optimizer step;
            snapshots take its read side. ``None``: snapshots take no lock (the caller guarantees no
            concurrent step, e.g. it saves from the training thread between steps).
        policy: what :meth:`save` does when the previous write is still running. ``"wait"`` blocks until
            it is committed, then snapshots (no checkpoint is ever dropped); ``"skip"`` returns ``False``
            at once and saves nothing (training never waits on the disk; a checkpoint may be dropped).
        on_commit: called on the writer thread after every successful commit, with the committed path
            (:meth:`save`) or the value ``write_fn`` returned (:meth:`submit`). Delete older checkpoints
            here, never before: the previous checkpoint must survive until the new one is committed.
        writer: which ranks write (``"main"``, ``"local"``, ``"all"``, as :func:`ranksafe.save`). Every
            rank may call :meth:`save`; on the others it does nothing. With ``"local"`` in a process group started
            without launcher variables (``mp.spawn``), the nodes are learned from the ranks' host names the first
            time: call :meth:`warmup`, or the first save, on every rank.
        name: names the collectives of this saver (every rank must use the same).
        timeout: how long its collectives (:meth:`warmup`, :meth:`check`, :meth:`close`) wait for the other ranks,
            in seconds (None: ``RANKSAFE_TIMEOUT``, else 30 minutes).

    Local calls (any rank, any time; but see ``writer``): :meth:`save`, :meth:`submit`, :meth:`after_commit`,
    :meth:`stage`, :meth:`wait`, :meth:`shutdown`, :attr:`failed`. Collectives (every rank, same order):
    :meth:`warmup`, :meth:`check`, :meth:`close`, and :meth:`poll`, once per training step.

    Thread: one writer, started by :meth:`warmup` or the first save and parked between saves;
    :meth:`close` or :meth:`shutdown` stops it, and a later save starts it again.
    """

    def __init__(
        self,
        lock: StateDictLock | None = None,
        policy: BusyPolicy | str = BusyPolicy.WAIT,
        on_commit: OnCommit | None = None,
        writer: Writer | str = Writer.MAIN,
        name: str = "async save",
        timeout: float | None = None,
    ) -> None:
        self.lock = lock
        self.timeout = checked_timeout(timeout)
        self.policy = BusyPolicy(policy)
        self.on_commit = on_commit
        self.writer = Writer(writer)
        self.name = name
        self.staging = StagingBuffers()
        # the paths save() was given since the last check: check() finds a path this rank's writer never saved
        self._asked: set[str] = set()
        # the unreported failure, in a cell shared with a finalizer: a saver dropped unchecked still reports it
        self._failure: list[BaseException | None] = [None]
        weakref.finalize(self, _report_unchecked, self._failure).atexit = False  # at exit: _wait_at_exit
        # read and set by ranksafe.saver_failures only: the notice poll() reads once per step, and the one this
        # rank posted its failure in that no rank has acted on yet
        self.notice = StepNotice(f"{name}: background failure")
        self.carried_by: StepNotice | None = None
        self._fresh_threads()
        _live.add(self)

    def _fresh_threads(self) -> None:
        """The writer thread and what synchronises with it: new ones (also in a forked child, where the parent's
        thread does not exist and its locks may be held by threads that do not exist either)."""
        self._worker = ParkedThread("ranksafe-async-save")  # its job: the write in flight
        self._submitting = threading.Lock()  # one snapshot at a time, whatever the calling thread
        self._submitter: int | None = None  # the thread inside submit(): a signal handler there must not wait
        self._error_lock = threading.Lock()  # the writer thread records, check() takes: never lose one
        self._after_commit = AfterCommit()  # a forked child has no write in flight

    # -- local ---------------------------------------------------------------------------------------
    @property
    def failed(self) -> bool:
        """Whether a background write (or a snapshot) failed and :meth:`check` has not reported it yet. Local."""
        return self._failure[0] is not None

    @property
    def error(self) -> BaseException | None:
        """The unreported failure of this rank, if any."""
        return self._failure[0]

    @property
    def in_flight(self) -> bool:
        """Whether a write is running now."""
        return self._worker.busy

    def save(self, state: Any, path: str | os.PathLike, on_commit: OnCommit | None = None, **torch_save_kwargs) -> bool:
        """Snapshot ``state`` and write it to ``path`` in the background, atomically. Local.

        Returns once the snapshot is taken: ``True`` when this rank queued a write, ``False`` when it is
        not a writer or the ``"skip"`` policy dropped this checkpoint. The answer is this rank's only:
        never branch into a collective on it. A rank that is not a writer passes the path its writer saves to (or
        none): the next :meth:`check` or :meth:`close` raises ``ValueError`` on every rank when one passed a path
        that its writer did not, where no file will be. The parent directory is created if needed. ``path`` may be a
        URL of remote storage (``storage_options=`` for its file system, among the keyword arguments).
        """
        storage_options = torch_save_kwargs.pop("storage_options", None)
        # a relative path is resolved now, as torch.save does: the write runs later, maybe after a chdir
        path = remote.file_url(path, storage_options) if remote.is_url(path) else os.path.abspath(local_path(path))

        if self.writer is not Writer.ALL:
            self._asked.add(path)
        write = functools.partial(save_file, path=path, storage_options=storage_options, **torch_save_kwargs)
        return self.submit(state, write, on_commit, what=remote.where(path))

    def submit(
        self, state: Any, write_fn: Callable[[Any], Any], on_commit: OnCommit | None = None, *, what: str = ""
    ) -> bool:
        """Snapshot ``state``, then call ``write_fn(snapshot)`` in the background. Local.

        For writers other than one file (a step directory with a commit marker): ``write_fn`` must commit
        atomically itself. Its return value goes to ``on_commit``. Same return value as :meth:`save`. ``what``
        names the save in a failed snapshot's error (Python 3.11+: a note, which every rank's error repeats).
        """
        self._not_from_writer_thread("submit")
        if self.writer is not Writer.ALL:  # on every rank, before the writers are picked: every rank raises alike
            refuse_sharded(state, self.name)
        if not is_writer(self.writer):
            return False
        callbacks = [cb for cb in (self.on_commit, on_commit) if cb is not None]
        if self._submitter == threading.get_ident() or (self.lock is not None and self.lock.waits_to_write()):
            self._write_now(state, write_fn, callbacks)
            return True
        with self._submitting:
            try:
                self._submitter = threading.get_ident()
                return self._submit(state, write_fn, callbacks, what)
            finally:
                self._submitter = None

    def _submit(self, state: Any, write_fn: Callable[[Any], Any], callbacks: list[OnCommit], what: str) -> bool:
        if self.in_flight:
            if self.policy is BusyPolicy.SKIP:
                return False
            self._worker.wait()
        try:
            captured = self._capture(state)
        except Exception as e:  # reported on every rank by the next check(), like a failed write
            if what and hasattr(e, "add_note"):
                e.add_note(f"the snapshot for {what}")
            self._record(e)
            self._after_commit.settle(committed=False)
            return False
        write = functools.partial(self._write, captured, write_fn, callbacks)
        try:
            self._after_commit.start()
            self._worker.hand(write)
        except BaseException:
            # No thread to run it (at interpreter shutdown), or a signal handler raised (Ctrl-C) on the way. Handed,
            # the write settles its actions itself, even if it has already returned; not handed, they are dropped.
            if not self._worker.holds(write) and self._after_commit.state is WriteState.IN_FLIGHT:
                self._after_commit.settle(committed=False)
            raise
        return True

    def _capture(self, state: Any) -> Captured:
        """``state`` copied into the staging buffers, under the read side of the lock (if any)."""
        if self.lock is None:
            return self.staging.capture(state)
        with self.lock.read():
            return self.staging.capture(state)

    def stage(self, example_state: Any) -> None:
        """Allocate the staging buffers for ``example_state`` and start the writer thread, as the first save would;
        local. After the write in flight, whose snapshot is in those buffers."""
        self._not_from_writer_thread("stage")
        with self._submitting:
            try:
                self._submitter = threading.get_ident()  # a signal handler's save meanwhile is written at once
                self._worker.wait()
                self._worker.start()  # the first save does not pay for starting the writer thread
                self._capture(example_state)
            finally:
                self._submitter = None

    def _write_now(self, state: Any, write_fn: Callable[[Any], Any], callbacks: list[OnCommit]) -> None:
        """A save from a signal handler (Lightning's SLURM requeue handler saves a checkpoint from one) that cannot
        wait for the snapshot in progress: the handler's thread is inside :meth:`submit` itself, or waits for the
        write side of the lock (its optimizer step), behind which another thread's snapshot may be queued, holding
        this saver. So the state is written now, on this thread, straight from the live tensors (training is paused
        in the handler), under the read side of the lock (which waits only for another thread's step in progress),
        after the write in flight (if one was handed: it holds older state, and must not commit over this one). The
        staging buffers are not touched: the interrupted snapshot may be half-way through them. Errors are raised
        here, as by a synchronous save."""
        self._worker.wait()
        with contextlib.nullcontext() if self.lock is None else self.lock.read():
            result = write_fn(state)
        for cb in callbacks:
            cb(result)

    def _not_from_writer_thread(self, call: str) -> None:
        """Refuse a call that waits for the write in flight when it comes from that write (an ``on_commit``
        callback): the write would wait for itself, and training would hang at the next save."""
        if self._worker.is_current():
            raise RuntimeError(
                f"AsyncSaver.{call}() called from its own writer thread (an on_commit callback): it would wait "
                "for the write that is calling it; call it from the training loop instead"
            )

    def _write(self, captured: Captured, write_fn: Callable[[Any], Any], callbacks: list[OnCommit]) -> None:
        committed = False
        try:
            result = write_fn(captured.assemble())  # assembled here: the caller is not kept waiting for it
            committed = True
            for cb in callbacks:
                cb(result)
            while (action := self._after_commit.next_or_settle()) is not None:
                action()
        except BaseException as e:
            self._after_commit.settle(committed)
            self._record(e)

    def after_commit(self, action: Callable[[], None]) -> bool:
        """Run ``action`` once this rank's latest background write has committed; local.

        While that write is in flight, ``action`` waits for it and runs on the writer thread after the commit
        (after the ``on_commit`` callbacks), or is dropped if the write fails; otherwise it runs now, unless that
        write failed. For what a new checkpoint makes way for: removing the one it replaces, or a link to it.
        A save the ``"skip"`` policy dropped, or a rank that is not a writer, makes no write. Returns False when
        ``action`` was dropped now; an error it raises on the writer thread is reported as the write's.
        """
        state = self._after_commit.add(action)
        if state is WriteState.COMMITTED:
            action()
        return state is not WriteState.FAILED

    def _record(self, e: BaseException) -> None:
        with self._error_lock:
            if self._failure[0] is None:  # the first failure is the cause; later ones usually follow from it
                self._failure[0] = e

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the write in flight (if any) is committed or failed; False on timeout. Local.

        Never raises the write's error: that is :meth:`check`'s job, on every rank at once. Raises
        ``RuntimeError`` when called from the write itself (an ``on_commit`` callback), which would never return.
        """
        self._not_from_writer_thread("wait")
        return self._worker.wait(timeout)

    def shutdown(self) -> None:
        """Wait for the write in flight, then stop this saver's thread; local. The saver stays usable."""
        self._not_from_writer_thread("shutdown")
        self.wait()
        self._worker.shutdown()

    # -- collectives ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """The per-step check for training loops: a background failure is raised on every rank at one step.

        Call it on every rank once per training step, after the step. While no rank has a failure it costs one
        non-blocking store read and waits for no rank. A rank whose write failed posts the failure in this call
        and returns; at the next call every rank, that one too, raises the same :class:`~ranksafe.RankFailure`
        (why the next and not this one: :class:`~ranksafe.notice.StepNotice`). Each failure is reported
        once, here or by :meth:`check`/:meth:`close`. In a single process the original error is raised at once.
        """
        self._not_from_writer_thread("poll")
        poll_savers([self])

    def check(self) -> None:
        """Raise :class:`~ranksafe.RankFailure` on every rank if any rank's background work failed.

        A collective costing one exchange, which waits for every rank: a barrier that also reports failures
        (at every step, :meth:`poll` costs less). Each failure is reported once, a failure that :meth:`poll`
        has posted but not yet raised included. In a single process the original error is raised unchanged.
        Raises ``ValueError`` on every rank when a rank gave :meth:`save` a path its writer did not since the last
        check (see :meth:`save`).
        """
        self._not_from_writer_thread("check")
        check_savers([self], self.name, timeout=self.timeout)

    def take_error(self) -> BaseException | None:
        """This rank's unreported failure, now marked as reported; local. :func:`~ranksafe.saver_failures.check_savers`
        shares it."""
        with self._error_lock:
            err, self._failure[0] = self._failure[0], None
        return err

    def take_asked(self) -> frozenset[str]:
        """The paths :meth:`save` was given since the last call; local. :func:`~ranksafe.saver_failures.check_savers`
        compares them with those of this rank's writer."""
        asked, self._asked = frozenset(self._asked), set()
        return asked

    def restore_asked(self, asked: frozenset[str]) -> None:
        """Keep ``asked`` (from :meth:`take_asked`) for the next check: the exchange that was to compare them failed.
        Local."""
        self._asked |= asked

    def restore_error(self, err: BaseException) -> None:
        """Mark ``err`` unreported again (its exchange failed), unless a newer failure took its place."""
        with self._error_lock:
            if self._failure[0] is None:
                self._failure[0] = err

    def warmup(
        self, example_state: Any, directory: str | os.PathLike, storage_options: dict[str, Any] | None = None
    ) -> None:
        """Allocate the staging buffers and try a write in ``directory`` before training; collective.

        A directory that cannot be created (a file in the way), a missing permission, a disk without room for one
        checkpoint, or a URL that cannot be written (no bucket, no credentials) fails here, on every rank, instead
        of at the first checkpoint.
        """
        url = remote.is_url(directory)
        directory = remote.Remote.of(directory, storage_options).url if url else local_path(directory)
        with together(f"{self.name}: warmup {directory}", self.timeout):
            if self.writer is not Writer.ALL:
                refuse_sharded(example_state, f"{self.name}: warmup {directory}")
            if is_writer(self.writer):
                self.stage(example_state)
                with naming_target("cannot write checkpoints to", directory):
                    probe_write(directory, storage_options, needs=self.staging.nbytes)

    def close(self) -> None:
        """Wait for the write in flight, stop the writer thread, then check as :meth:`check` does; collective.
        Call it at the end of training. The saver stays usable: a later save starts its thread again.

        Its exchange is named apart from :meth:`check`'s: a rank that stopped early (and closes) while another
        checks at its next step is a :class:`~ranksafe.CollectiveMismatch` on both, not a pair that goes on."""
        self.shutdown()
        self._not_from_writer_thread("close")
        check_savers([self], self.name, point="close", timeout=self.timeout)

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
        else:  # already failing: do not add a collective other ranks may never reach
            self.shutdown()


def _report_unchecked(failure: list[BaseException | None]) -> None:
    """Print a failure nobody checked (its saver was dropped, or the process exits)."""
    err, failure[0] = failure[0], None
    if err is not None:
        print(f"ranksafe: a background checkpoint write failed: {err!r}", file=sys.stderr)


def _wait_at_exit() -> None:
    """No checkpoint in flight is lost when the process exits; an unreported failure is printed (once).

    The writer threads are stopped and joined here, before the interpreter finalizes (see
    :class:`~ranksafe.parked_thread.ParkedThread`). Runs from ``atexit`` and from multiprocessing's exit handlers:
    a process that multiprocessing forked ends with ``os._exit``, which skips ``atexit``.
    """
    for saver in list(_live):
        saver.shutdown()
        _report_unchecked(saver._failure)


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: every saver gets its own, and nothing in flight (the
    parent's write is the parent's)."""
    for saver in list(_live):
        saver._worker.abandon()
        saver._fresh_threads()
        # what the parent has to report is the parent's: a DataLoader worker would print it again at its exit
        saver._failure[0], saver._asked, saver.carried_by = None, set(), None


at_exit(_wait_at_exit, priority=100)  # before collectives' hook: a write in flight is not a rank that is gone
os.register_at_fork(after_in_child=_after_fork_in_child)
