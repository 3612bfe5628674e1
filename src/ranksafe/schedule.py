"""When to save, decided alike on every rank: every N steps, every T seconds by rank 0's clock, and when the
cluster preempts the job.

A decision that ranks took each on their own would split them: clocks differ between nodes (one rank finds the
interval over, another not), and a stop signal reaches ranks at different moments, or only some of them. A rank
that decides to save or to stop then waits in a collective the others never enter. Here the step interval needs no
exchange (every rank counts the same steps); the two others are :class:`~ranksafe.notice.StepNotice`\\ s: the
rank that knows (rank 0 for the clock, a signalled rank for a preemption) posts at its step boundary ``n``, and
every rank acts at ``n + 1``. While nothing is posted a step costs one non-blocking store read per notice.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable

from . import topology
from .notice import StepNotice
from .options import positive_int, positive_number
from .preemption import DEFAULT_SIGNALS, Signals


class SaveSchedule:
    """The save and stop decisions of one :class:`~ranksafe.CheckpointManager`; every method is called by every
    rank, at every step boundary, with the same step numbers.

    Args:
        save_interval_steps: :meth:`should_save` is True at steps divisible by it.
        save_interval_seconds: ... and at the first common boundary after this many seconds passed since the last save,
            by rank 0's ``clock`` (other ranks' clocks are never read).
        preemption: handle these signals (True: SIGTERM and SIGUSR1) by recording them (:class:`Signals`): from
            the first common boundary after any rank received one, :meth:`reached_preemption` is True on every rank.
        name: tells this schedule's notices apart from other schedules' (the same on every rank).
    """

    def __init__(
        self,
        save_interval_steps: int | None = None,
        save_interval_seconds: float | None = None,
        preemption: bool | Iterable[int] = False,
        name: str = "checkpoint",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        positive_int("save_interval_steps", save_interval_steps)
        positive_number("save_interval_seconds", save_interval_seconds)
        self.save_interval_steps, self.save_interval_seconds, self.clock = (
            save_interval_steps,
            save_interval_seconds,
            clock,
        )
        chosen = DEFAULT_SIGNALS if preemption is True else () if preemption is False else tuple(preemption)
        self.signals = Signals(chosen) if chosen else None
        self.preempted = False  # sticky: once the ranks agreed to stop, they stay stopped
        self._stop = StepNotice(f"{name}: preemption")
        self._timer = StepNotice(f"{name}: save interval")
        self._last_save = clock()  # rank 0's
        self._posted = {"stop": False, "timer": False}  # this rank posted a notice that is not due yet
        self._answered: dict[str, tuple[int, bool]] = {}  # each decision's last step and answer: asked twice, one read

    def install(self, fit: bool = False) -> None:
        """Start recording the preemption signals (main thread); idempotent. ``fit``: at a fit's start, which also acts
        on a signal an earlier fit of the process kept (:meth:`pass_on_unanswered`)."""
        if self.signals is not None:
            self.signals.install()
            if fit:
                self.signals.take_kept()

    def uninstall(self) -> None:
        """Put back the signal handlers :meth:`install` replaced."""
        if self.signals is not None:
            self.signals.uninstall()

    def pass_on_unanswered(self, keep: bool = False) -> None:
        """Once the handlers are put back (:meth:`uninstall`): the signal this rank recorded that no agreed stop
        answered (it came after the last step boundary) gets the default action the recording held back, where that
        is the handler now (the process ends); a callable handler had it when it came. ``keep``: the next fit of this
        process gets it instead (:meth:`Signals.keep`). Once: the record is cleared."""
        if self.signals is None or self.preempted or self.signals.received is None:
            return
        if keep:
            self.signals.keep()
            return
        received, self.signals.received = self.signals.received, None
        if signal.getsignal(received) == signal.SIG_DFL:
            signal.raise_signal(received)

    def reached_preemption(self, step: int) -> bool:
        """True on every rank from the first common step boundary after any rank received a preemption signal;
        one store read per step while none did. Asked again for the same step, the same answer, no read."""
        if self.signals is None or self.preempted:
            return self.preempted
        if (last := self._answered.get("stop")) is not None and last[0] == step:
            return last[1]
        due = self._stop.poll()
        if due is not None:
            self.preempted = True
        elif self.signals.received is not None and not self._posted["stop"]:
            self._stop.post(signal.Signals(self.signals.received).name)
            self._posted["stop"] = True
        self._answered["stop"] = (step, self.preempted)
        return self.preempted

    def should_save(self, step: int) -> bool:
        """True on every rank at the same steps: every ``save_interval_steps``, when ``save_interval_seconds`` passed on
        rank 0's clock (at the boundary after rank 0 found it), and when the ranks reached a preemption."""
        if (last := self._answered.get("save")) is not None and last[0] == step:
            return last[1]
        save = bool(self.save_interval_steps) and step % self.save_interval_steps == 0  # type: ignore[operator]
        if self.save_interval_seconds is not None:
            if self._timer.poll() is not None:
                save, self._posted["timer"] = True, False
            elif not save and self._interval_over():  # a step-rule save restarts the interval anyway
                self._timer.post(step)
                self._posted["timer"] = True
        save = self.reached_preemption(step) or save
        self._answered["save"] = (step, save)
        return save

    def _interval_over(self) -> bool:
        """On rank 0, with no notice of its own pending: whether ``save_interval_seconds`` passed since the last
        save."""
        if not topology.is_main() or self._posted["timer"]:
            return False
        return self.clock() - self._last_save >= self.save_interval_seconds  # type: ignore[operator]

    def saved(self) -> None:
        """A save was made: the seconds interval starts again (rank 0's clock)."""
        self._last_save = self.clock()
