"""The lock between the optimizer step and snapshots: the step holds the *write* side, a snapshot the *read*
side, so a snapshot never copies weights half-way through an update, and a waiting step is never starved by a
stream of snapshots. Local: no collectives.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class StateDictLock:
    """Reader/writer lock between the optimizer step (writer) and snapshots (readers).

    *Writer-preferring*: once a writer waits, new readers queue behind it, so a step is delayed by at most
    the snapshot already running, never by a stream of them. Re-entrant for the thread that holds the write
    side (including taking the read side inside it: that thread is the only one that could change the
    weights), and for nested reads. A read on a thread that waits for the write side (a signal handler's save) does
    not queue behind that write. Upgrading a read to a write would deadlock, so it raises instead.

    Use the context managers ``write()`` / ``read()``, or the ``acquire_*`` / ``release_*`` pairs where the
    two ends live in different callbacks (``before_step`` / ``after_step``).
    """

    def __init__(self) -> None:
        # Re-entrant: a signal handler runs on the thread it interrupts, which may be inside this lock's own
        # bookkeeping, holding the mutex (a plain lock hung there). So at each point where a handler can run (a call)
        # a side is held or given back, never half-way, and a release wakes the waiting threads *before* it gives
        # back (a handler that lands once it is given back may wait for one of them), in a ``try`` whose ``finally``
        # gives back even when the handler raises (Ctrl-C).
        self._cond = threading.Condition(threading.RLock())
        self._readers = 0
        self._writer: int | None = None  # ident of the thread holding the write side
        self._write_depth = 0
        # how many waits for the write side each thread is in (a handler's inside its thread's): a dict, left with no
        # call
        self._writers_waiting: dict[int, int] = {}
        self._local = threading.local()  # this thread's read depth

    def _reads(self) -> int:
        return getattr(self._local, "reads", 0)

    def waits_to_write(self) -> bool:
        """Whether the calling thread waits for the write side: true only in a signal handler that interrupted that
        wait, as nothing else runs on a thread while it waits."""
        return threading.get_ident() in self._writers_waiting

    def acquire_write(self, timeout: float | None = None) -> bool:
        """Take the write side; False if ``timeout`` seconds passed first."""
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._write_depth += 1
                return True
            if self._reads():
                raise RuntimeError(
                    "StateDictLock: this thread holds the read side; taking the write side would deadlock"
                )
            self._writers_waiting[me] = self._writers_waiting.get(me, 0) + 1
            granted = False
            try:
                granted = self._cond.wait_for(lambda: self._writer is None and self._readers == 0, timeout)
            finally:  # no call until the side is taken: no handler sees this thread neither waiting nor writing
                if waits := self._writers_waiting[me] - 1:
                    self._writers_waiting[me] = waits
                else:
                    del self._writers_waiting[me]
                if granted:
                    self._writer, self._write_depth = me, 1
                else:  # a timeout, or a handler that raised in the wait: the readers queued behind it may go
                    self._cond.notify_all()
            return granted

    def release_write(self) -> None:
        """Give back the write side (once per acquire); wakes waiting snapshots when the last one is released."""
        with self._cond:
            if self._writer != threading.get_ident():
                raise RuntimeError("StateDictLock: release_write() by a thread that does not hold the write side")
            woke = False
            try:
                if self._write_depth == 1:
                    self._cond.notify_all()
                woke = True
            finally:
                self._write_depth -= 1
                if self._write_depth == 0:
                    self._writer = None
                    if not woke:  # a handler raised in the wakeup: the waiting threads would wait for ever
                        self._cond.notify_all()

    def acquire_read(self, timeout: float | None = None) -> bool:
        """Take the read side; False if ``timeout`` seconds passed first."""
        me = threading.get_ident()
        with self._cond:
            reads = self._reads()
            if not (self._writer == me or reads):  # else re-entrant
                # Queued behind waiting writers, except on a thread that waits to write itself: a signal handler (a
                # save, as Lightning's SLURM requeue handler makes one) interrupted that wait, and the write cannot
                # begin before the handler returns. Only another thread's write in progress is waited for.
                queued = me not in self._writers_waiting
                if not self._cond.wait_for(
                    lambda: self._writer is None and not (queued and self._writers_waiting), timeout
                ):
                    return False
            self._readers += 1
            self._local.reads = reads + 1
            return True

    def release_read(self) -> None:
        """Give back the read side (once per acquire); wakes a waiting step when the last reader leaves."""
        with self._cond:
            reads = self._reads()
            if not reads:
                raise RuntimeError("StateDictLock: release_read() by a thread that does not hold the read side")
            woke = False
            try:
                if self._readers == 1:
                    self._cond.notify_all()
                woke = True
            finally:
                self._readers -= 1
                self._local.reads = reads - 1
                if not woke:  # a handler raised in the wakeup: the waiting threads would wait for ever
                    self._cond.notify_all()

    @contextlib.contextmanager
    def write(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the write side for the block (around ``optimizer.step()``)."""
        if not self.acquire_write(timeout):
            raise TimeoutError(f"StateDictLock: write side not acquired within {timeout}s")
        try:
            yield
        finally:
            self.release_write()

    @contextlib.contextmanager
    def read(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the read side for the block (around a snapshot)."""
        if not self.acquire_read(timeout):
            raise TimeoutError(f"StateDictLock: read side not acquired within {timeout}s")
        try:
            yield
        finally:
            self.release_read()
