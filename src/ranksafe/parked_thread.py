"""One thread kept for the background writes: started on first use, parked between jobs.

:class:`ParkedThread` serves :class:`~ranksafe.AsyncSaver`; the saver's exit hook joins it before the interpreter
finalizes.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable


class _Slot:
    """What the thread and its owner share: at most one job, and which thread serves it. Not the
    :class:`ParkedThread` itself, so that the thread does not keep its owner alive."""

    def __init__(self) -> None:
        # Taken with ``with lock``, not ``with changed``: the lock's own enter and exit are C, where no signal
        # handler runs, and Condition's are Python, where one could raise before the release. Re-entrant: a signal
        # handler on the owner's thread may hand or wait while that thread holds it.
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.job: Callable[[], None] | None = None  # handed and not yet returned
        self.thread: threading.Thread | None = None  # the thread that serves it; None once told to stop


def _serve(slot: _Slot) -> None:
    """The thread's life: run each job handed to it, until it is no longer the slot's thread."""
    me = threading.current_thread()
    while True:
        with slot.lock:
            slot.changed.wait_for(lambda: slot.thread is not me or slot.job is not None)
            if slot.thread is not me:  # stopped only with no job in the slot: a later one is a new thread's
                return
            job = slot.job
        try:
            job()  # type: ignore[misc]  # not None: waited for
        finally:
            with slot.lock:
                slot.job = None
                slot.changed.notify_all()
            del job  # a parked thread must not keep its last job, and the saver that job refers to, alive


def _stop(slot: _Slot, join: bool) -> None:
    """Wait for the job in the slot (if any), then tell the slot's thread to stop, in one hold of the lock: a job
    handed in between would find no thread to run it. With ``join``, wait until the thread has exited."""
    with slot.lock:
        slot.changed.wait_for(lambda: slot.job is None)
        thread, slot.thread = slot.thread, None
        slot.changed.notify_all()
    if join and thread is not None and thread is not threading.current_thread():
        thread.join()


class ParkedThread:
    """One thread, started on first use, then parked between jobs; stopped by :meth:`shutdown` or when this object
    is garbage-collected. It runs one job at a time: :meth:`hand` refuses a second while the first runs.

    A job is handed by one assignment, which the thread clears once the job has returned. So whatever interrupts
    the owner (a signal handler raising ``KeyboardInterrupt`` half-way through :meth:`hand`), the job was either
    handed or not, and :meth:`holds` says which: nothing is left waiting for a job that never comes, and no job
    runs unnoticed.

    Parked, not started per job: ``Thread.start()`` waits until the new thread first runs, and every save would
    pay that wait. A daemon thread, so that a parked one never holds up interpreter exit. The exit hook of
    :mod:`ranksafe.async_save` waits for the job in flight and joins the thread before the interpreter
    finalizes: a daemon thread still running then is killed where it stands, and if that is inside a C++
    destructor (of a tensor its last job freed), the process aborts.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._slot = _Slot()
        self._finalizer = weakref.finalize(self, _stop, self._slot, False)
        self._finalizer.atexit = False  # at exit, async_save._wait_at_exit joins it instead

    def start(self) -> None:
        """Start the thread unless it runs (waiting until it does, so the first job does not pay for it)."""
        with self._slot.lock:
            self._start()

    def _start(self) -> None:
        if self._slot.thread is None:
            thread = threading.Thread(target=_serve, args=(self._slot,), name=self.name, daemon=True)
            thread.start()
            self._slot.thread = thread

    @property
    def busy(self) -> bool:
        """Whether a job is handed and has not returned yet."""
        return self._slot.job is not None

    def holds(self, job: Callable[[], None]) -> bool:
        """Whether ``job`` is handed and has not returned yet."""
        return self._slot.job is job

    def is_current(self) -> bool:
        """Whether the caller runs on this thread (inside one of its jobs)."""
        return self._slot.thread is threading.current_thread()

    def hand(self, job: Callable[[], None]) -> None:
        """Give ``job`` to the thread (started if needed); returns at once. ``RuntimeError`` while a job runs."""
        with self._slot.lock:
            if self._slot.job is not None:
                raise RuntimeError(f"{self.name}: a job is still running")
            self._start()
            # woken first, so that the job is handed awake or not at all: the thread waits for this lock, and then
            # finds the job (no signal handler runs between a Python call's return and the assignment)
            self._slot.changed.notify_all()
            self._slot.job = job  # handed, in one step

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no job runs; False on timeout."""
        with self._slot.lock:
            return self._slot.changed.wait_for(lambda: self._slot.job is None, timeout)

    def shutdown(self) -> None:
        """Wait for the job in flight, then stop the thread and wait until it has exited. :meth:`hand` starts a new
        one."""
        _stop(self._slot, join=True)

    def abandon(self) -> None:
        """In a forked child: forget the parent's thread, which does not exist here, without taking the slot's lock,
        which that thread may have held at the fork. The child's owner makes a new :class:`ParkedThread`."""
        self._finalizer.detach()
