"""A signal handler at each point where CPython may run one, one point per try: by default one that raises (Ctrl-C's
``KeyboardInterrupt``), or one that does something and returns.

CPython runs a Python signal handler (Ctrl-C's raises ``KeyboardInterrupt``) on the main thread at a few kinds of
instruction only: on entering a Python function, when a call into C returns, and at a loop's back edge.
:class:`InterruptAt` runs its handler at the n-th such point of the code in the files it is given, so that a test
can try every point of a short protocol, one run each, instead of hoping that a real signal lands in a window of a
few instructions. The entry of a function that our code calls counts (the handler runs before its first line); what
runs inside the standard library does not: its own windows (a ``threading.Condition`` taken by ``with`` and not
yet released) are not ours to close, only to stay out of.
"""

from __future__ import annotations

import dis
import sys
from collections.abc import Callable

_JUMP_BACKWARD = dis.opmap["JUMP_BACKWARD"]


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


class InterruptAt:
    """Run ``handler`` (by default: raise ``KeyboardInterrupt``) at the ``n``-th interruptible point met in a file whose
    path contains one of ``paths``, while active (:meth:`start` to :meth:`stop`). :attr:`seen` counts the points met;
    :attr:`where` names the one interrupted."""

    def __init__(self, n: int, paths: tuple[str, ...], handler: Callable[[], None] = _raise_keyboard_interrupt) -> None:
        self.n, self.paths, self.handler = n, paths, handler
        self.seen, self.where = 0, ""
        self._due: set = set()  # frames whose next instruction follows a call into C or a back edge

    def _ours(self, frame) -> bool:
        return any(p in frame.f_code.co_filename for p in self.paths)

    def _profile(self, frame, event: str, arg) -> None:
        if event in ("c_return", "c_exception") and self._ours(frame):
            self._due.add(frame)

    def _trace(self, frame, event: str, arg):
        if not self._ours(frame):
            if event == "call" and frame.f_back is not None and self._ours(frame.f_back):
                self._point(frame, event)  # entering a function our code calls: a point of ours, not inside it
            return None
        if event == "call":
            frame.f_trace_opcodes = True
            self._point(frame, event)
        elif event == "opcode":
            if frame in self._due:
                self._due.discard(frame)
                self._point(frame, event)
            if frame.f_code.co_code[frame.f_lasti] == _JUMP_BACKWARD:
                self._due.add(frame)
        return self._trace

    def _point(self, frame, event: str) -> None:
        self.seen += 1
        if self.seen == self.n:
            self.stop()
            self.where = f"{event} in {frame.f_code.co_name}, line {frame.f_lineno}"
            self.handler()

    def start(self) -> None:
        sys.setprofile(self._profile)
        sys.settrace(self._trace)

    def stop(self) -> None:
        sys.settrace(None)
        sys.setprofile(None)


def interrupt_each_point(
    action: Callable[[], object],
    paths: tuple[str, ...],
    after: Callable[[str], None],
    handler: Callable[[], None] = _raise_keyboard_interrupt,
) -> int:
    """Run ``action`` once per interruptible point of ``paths`` it meets, ``handler`` run there, until a run reaches its
    end before its point; after each interrupted run, ``after(where)`` checks what it left (not interrupted).
    Returns the number of points tried."""
    tried = 0
    while True:
        interrupt = InterruptAt(tried + 1, paths, handler)
        interrupt.start()
        try:
            action()
        except KeyboardInterrupt:
            pass
        finally:
            interrupt.stop()
        if not interrupt.where:
            return tried
        tried += 1
        after(interrupt.where)
