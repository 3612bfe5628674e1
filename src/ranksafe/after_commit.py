"""What waits for a background write's commit: the removal of the checkpoint it replaces, a link to it.

:class:`AfterCommit` holds those actions for :meth:`ranksafe.AsyncSaver.after_commit`: the training thread adds
them, the writer thread runs them after the commit, in order, or drops them all when the write fails (what they made
way for never arrived). Its :class:`WriteState` is that of this rank's latest write. Local: no collectives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from enum import Enum


class WriteState(Enum):
    """This rank's latest background write, as :meth:`ranksafe.AsyncSaver.after_commit` sees it."""

    COMMITTED = "committed"  # or no write yet: an action runs at once
    IN_FLIGHT = "in flight"  # an action waits for the commit, and is dropped if the write fails
    FAILED = "failed"  # an action is dropped: what it made way for never arrived


class AfterCommit:
    """The actions waiting for the write in flight; the training thread adds, the writer thread settles."""

    def __init__(self) -> None:
        self.state = WriteState.COMMITTED
        self._actions: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def add(self, action: Callable[[], None]) -> WriteState:
        """Queue ``action`` if a write is in flight; return the state it was added in."""
        with self._lock:
            if self.state is WriteState.IN_FLIGHT:
                self._actions.append(action)
            return self.state

    def start(self) -> None:
        """A write was handed to the writer thread."""
        with self._lock:
            self.state, self._actions = WriteState.IN_FLIGHT, []

    def next_or_settle(self) -> Callable[[], None] | None:
        """After the commit: the next waiting action, in the order they came, or None once none is left, and
        then the write counts as committed. Until then a new action queues behind the others: run at once on
        the training thread, it would race the writer thread's (two links of ``last.ckpt``)."""
        with self._lock:
            if self._actions:
                return self._actions.pop(0)
            self.state = WriteState.COMMITTED
            return None

    def settle(self, committed: bool) -> None:
        """Record the write's outcome, dropping the actions still waiting (it failed, or an action did)."""
        with self._lock:
            self.state = WriteState.COMMITTED if committed else WriteState.FAILED
            self._actions = []
