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

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        """Handle the signals from now on; idempotent. Raises ``RuntimeError`` off the main thread."""
        if self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("preemption signals can only be handled from the main thread")
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        """Put the handlers back that :meth:`install` replaced (those still ours); idempotent."""
        for s, previous in self._previous.items():
            if signal.getsignal(s) == self._handle:
                signal.signal(s, previous)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):
            previous(signum, frame)

    def __getstate__(self) -> dict[str, Any]:
        """Handlers belong to a process: a copy (a pickled Trainer, a spawned worker) starts without them."""
        return {"signals": self.signals, "received": None, "_previous": {}}
