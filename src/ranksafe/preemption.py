"""Stop signals, recorded: what a cluster sends before it takes the machines back (SLURM's ``--signal=USR1@90``
or SIGTERM before the time limit; Kubernetes and spot instances send SIGTERM).

A signal handler runs between two bytecodes of whatever the main thread was doing: inside a collective, a save,
an optimizer step. Nothing that talks to the other ranks can run there (they are each interrupted somewhere
else), so the handler only records the signal, and chains to the handler that was installed before it. The
decision to stop is taken at the next step boundary, agreed by every rank
(:meth:`ranksafe.CheckpointManager.reached_preemption`). Once that step is committed, a SLURM job that asked for it
is requeued from rank 0 (:func:`requeue_slurm_job`).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import warnings
import weakref
from collections.abc import Iterable
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What :class:`Signals` listens for unless told otherwise."""


_kept: signal.Signals | None = None
"""A signal that a fit's recorder received and no agreed stop answered (it came after the fit's last step boundary),
kept by :meth:`Signals.keep` for the next fit of this process, of any Learner or Trainer (:meth:`Signals.take_kept`),
which stops at its second step boundary."""


class Signals:
    """Record the first of ``signals`` that arrives, without stopping the process.

    :meth:`install` puts the handlers in place (main thread only, where Python runs signal handlers), keeping
    the ones they replace: a callable one is still called after the signal is recorded (a user's handler, a
    framework's); the default action (terminate) and ``SIG_IGN`` are not. :meth:`uninstall` puts them back, and so
    does dropping the last reference to this object (a manager nobody closed): the handler the signal module holds
    reaches it through a weak reference (:class:`_Handler`).
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        if uncatchable := [s.name for s in self.signals if s in (signal.SIGKILL, signal.SIGSTOP)]:
            raise ValueError(f"{', '.join(uncatchable)} cannot be handled by a process: preempt with another signal")
        self.received: signal.Signals | None = None
        self._handler: _Handler | None = None
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
        self._handler = handler = _Handler(self)
        self._recording = True
        weakref.finalize(self, handler.put_back)
        try:
            for s in self.signals:
                handler.previous[s] = signal.signal(s, handler)
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        """Stop recording, and put back the handlers :meth:`install` replaced where ours is still the one installed;
        idempotent. Where a later handler replaced ours, ours keeps passing signals on to what it replaced (that
        handler may chain to ours, or put ours back when it is uninstalled in turn)."""
        if self._handler is not None:
            self._handler.put_back()
        self._recording = False

    def keep(self) -> None:
        """Hand the signal received, if any, to the next fit of this process (:data:`_kept`)."""
        global _kept
        if self.received is not None:
            _kept, self.received = self.received, None

    def take_kept(self) -> None:
        """At a fit's start: act on the signal an earlier fit of this process kept (:meth:`keep`), if this recorder
        handles it."""
        global _kept
        if self.received is None and _kept in self.signals:
            self.received, _kept = _kept, None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._recording:
            if self.received is None:
                self.received = signal.Signals(signum)
            previous = self._handler.previous.get(signum) if self._handler is not None else None
            if callable(previous):
                previous(signum, frame)
        elif self._handler is not None:
            self._handler.hand_over(signum, frame)

    def __getstate__(self) -> dict[str, Any]:
        """Handlers belong to a process: a copy (a pickled Trainer, a spawned worker) starts without them."""
        return {"signals": self.signals, "received": None, "_handler": None, "_recording": False}


class _Handler:
    """What the signal module holds for one :meth:`Signals.install`: the handlers it replaced, and a weak reference to
    the :class:`Signals`. Once that one stopped recording, or is gone, a signal goes where it went before."""

    def __init__(self, owner: Signals) -> None:
        self.owner = weakref.ref(owner)
        self.previous: dict[int, Any] = {}

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        owner = self.owner()
        if owner is not None:
            owner._handle(signum, frame)
        else:
            self.hand_over(signum, frame)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (a handler chain pickled with a Trainer) passes nothing on, as a copied :class:`Signals` records
        nothing: handlers belong to a process."""
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.owner, self.previous = (lambda: None), {}

    def put_back(self) -> None:
        """The replaced handlers, where this one is still installed (and on the main thread: a collection elsewhere
        leaves it to :meth:`hand_over`, at the next signal)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s, previous in self.previous.items():
            if previous is not None and signal.getsignal(s) is self:  # None: installed outside Python
                signal.signal(s, previous)

    def hand_over(self, signum: int, frame: FrameType | None) -> None:
        """A signal after recording stopped: what would have happened without ranksafe. Reached where this handler
        is still installed (put back by a later handler that was uninstalled, or collected off the main thread), and
        where a later handler chains to it."""
        previous = self.previous.get(signum)
        if previous is not None and signal.getsignal(signum) is self:
            signal.signal(signum, previous)
            if previous == signal.SIG_DFL:
                signal.raise_signal(signum)  # the process ends, as it would have
                return
        if callable(previous):
            previous(signum, frame)


def slurm_job_id() -> str:
    """The id ``scontrol requeue`` takes, as Lightning's requeue handler reads it: ``<array job>_<task>`` in a job
    array. Raises ``KeyError`` naming the missing variable, ``ValueError`` for an id that is no SLURM job id."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_-]+", job_id):
        raise ValueError(f"not a SLURM job id: {job_id!r}")
    return job_id


def requeue_slurm_job() -> None:
    """Run ``scontrol requeue <job id>``: on rank 0 only, once the preemption step is committed. Never raises (rank 0
    alone runs it, and the other ranks must not be left in a collective): a requeue that fails is a warning, as in
    Lightning; the step is committed, and resubmitting the job resumes from it."""
    try:
        job_id = slurm_job_id()
        log.info(f"requeueing SLURM job {job_id}")
        code = subprocess.call(["scontrol", "requeue", job_id])
        failure = None if code == 0 else f"scontrol requeue {job_id} exited with status {code}"
    except (KeyError, ValueError, OSError) as e:
        failure = f"cannot requeue the SLURM job: {type(e).__name__}: {e}"
    if failure is not None:
        warnings.warn(f"{failure}; resubmit the job to resume from its last step", stacklevel=2)
