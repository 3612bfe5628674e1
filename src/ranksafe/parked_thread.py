"""One thread kept for the background writes: started on first use, parked on a queue between jobs.

:class:`ParkedThread` serves :class:`~ranksafe.AsyncSaver`; the saver's exit hook joins it before the interpreter
finalizes.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from queue import SimpleQueue


def _serve(jobs: SimpleQueue) -> None:
    """The writer thread's life: run each job it is handed, until it is handed ``None``."""
    while True:
        job = jobs.get()
        if job is None:
            return
        job()
        del job  # a parked thread must not keep its last job, and the saver that job refers to, alive


def _stop(jobs: SimpleQueue, thread: list[threading.Thread], guard: threading.Lock, join: bool) -> None:
    """Hand the parked thread (if any) its ``None``; with ``join``, wait until it has exited. Under ``guard``, so a
    job handed meanwhile goes to this thread before its ``None`` or to a new thread after it, never behind it."""
    with guard:
        if thread:
            jobs.put(None)
            if join:
                thread[0].join()
            thread.clear()


class ParkedThread:
    """One thread, started on first use, then parked on a queue between jobs; stopped by :meth:`shutdown` or
    when this object is garbage-collected.

    Parked, not started per job: ``Thread.start()`` waits until the new thread first runs, and every save would
    pay that wait. A daemon thread, so that a parked one never holds up interpreter exit. The exit hook of
    :mod:`ranksafe.async_save` waits for the write in flight and joins the thread before the interpreter
    finalizes: a daemon thread still running then is killed where it stands, and if that is inside a C++
    destructor (of a tensor its last job freed), the process aborts.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: SimpleQueue = SimpleQueue()
        self._thread: list[threading.Thread] = []  # zero or one; a list, shared with the finalizer
        self._guard = threading.Lock()  # start/hand against stop: see _stop
        finalizer = weakref.finalize(self, _stop, self._jobs, self._thread, self._guard, False)
        finalizer.atexit = False  # at exit, async_save._wait_at_exit joins it instead

    def start(self) -> None:
        """Start the thread unless it runs (waiting until it does, so the first job does not pay for it)."""
        with self._guard:
            self._start()

    def _start(self) -> None:
        if not self._thread:
            t = threading.Thread(target=_serve, args=(self._jobs,), name=self.name, daemon=True)
            t.start()
            self._thread.append(t)

    def is_current(self) -> bool:
        """Whether the caller runs on this thread (inside one of its jobs)."""
        return bool(self._thread) and self._thread[0] is threading.current_thread()

    def hand(self, job: Callable[[], None]) -> None:
        """Queue ``job`` for the thread (started if needed); returns at once."""
        with self._guard:
            self._start()
            self._jobs.put(job)

    def shutdown(self) -> None:
        """Stop the thread once its queued jobs are done, and wait for it. :meth:`hand` starts a new one."""
        _stop(self._jobs, self._thread, self._guard, join=True)
