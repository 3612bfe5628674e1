"""Stop signals, recorded: what a cluster sends before it takes the machines back (SLURM's ``--signal=USR1@90``
or SIGTERM before the time limit; Kubernetes and spot instances send SIGTERM).

A signal handler runs between two bytecodes of whatever the main thread was doing: inside a collective, a save,
an optimizer step. Nothing that talks to the other ranks can run there (they are each interrupted somewhere
else), so the handler only records the signal, and chains to the handler that was installed before it. The
decision to stop is taken at the next step boundary, agreed by every rank
(:meth:`ranksafe.CheckpointManager.reached_preemption`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What :class:`Signals` listens for unless told otherwise."""


class Signals:
    """Record the first of ``signals`` that arrives, without stopping the process.

    :meth:`install` puts the handlers in place (main thread only, where Python runs signal handlers), keeping
    the ones they replace: a callable one is still called after the signal is recorded (a user's handler, a
    framework's); the default action (terminate) and ``SIG_IGN`` are not. :meth:`uninstall` puts them back.
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._recording = False

    @property
    def installed(self) -> bool:
        return self._recording

    def install(self) -> None:
        """Handle the signals from now on; idempotent, all or none. Raises ``RuntimeError`` off the main thread,
        and what ``signal.signal`` raises for a signal that cannot be handled (``SIGKILL``)."""
        if self._recording:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("preemption signals can only be handled from the main thread")
        self._previous = {}
        try:
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        except BaseException:
            self._recording = True
            self.uninstall()
            raise
        self._recording = True

    def uninstall(self) -> None:
        """Stop recording, and put back the handlers :meth:`install` replaced where ours is still the one installed;
        idempotent. Where a later handler replaced ours, ours keeps passing signals on to what it replaced (that
        handler may chain to ours, or put ours back when it is uninstalled in turn)."""
        for s, previous in self._previous.items():
            if previous is not None and signal.getsignal(s) == self._handle:  # None: installed outside Python
                signal.signal(s, previous)
        self._recording = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        received = signal.Signals(signum)
        previous = self._previous.get(received)
        if self._recording:
            if self.received is None:
                self.received = received
        elif previous is not None and signal.getsignal(received) == self._handle:
            # uninstalled under a later handler, which has since put ours back: hand over to what ours replaced
            signal.signal(received, previous)
            if previous == signal.SIG_DFL:
                signal.raise_signal(received)  # what would have happened without us: the process ends
                return
        if callable(previous):
            previous(signum, frame)

    def __getstate__(self) -> dict[str, Any]:
        """Handlers belong to a process: a copy (a pickled Trainer, a spawned worker) starts without them."""
        return {"signals": self.signals, "received": None, "_previous": {}, "_recording": False}
