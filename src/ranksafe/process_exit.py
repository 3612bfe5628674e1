"""Hooks that run when a process ends: at ``atexit``, and also in a process that ``multiprocessing`` forked.

A forked child (``mp.start_processes(start_method="fork")``, Lightning's ``ddp_fork`` and ``ddp_notebook``, a
DataLoader worker) ends with ``os._exit``, which skips ``atexit``; multiprocessing runs its own exit handlers there
instead, and their registry starts empty in each child. :func:`at_exit` registers a hook with both.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util
import threading
from collections.abc import Callable

_owners: list[threading.Event] = []  # multiprocessing keeps after-fork hooks by weak reference to an owner


def at_exit(hook: Callable[[], None], priority: int) -> None:
    """Run ``hook`` once at the exit of this process, and of every process multiprocessing forks from it, whether it
    was imported before the fork or in the child. ``priority`` orders the hooks of such a child, highest first: give
    the later-imported module's hook the higher one, so that the order matches ``atexit``'s (latest first)."""
    ran: list[bool] = []  # not a lock or an Event: a forked child may inherit one held

    def once() -> None:
        if not ran:
            ran.append(True)
            hook()

    def in_child() -> None:
        multiprocessing.util.Finalize(None, once, exitpriority=priority)

    atexit.register(once)
    if multiprocessing.parent_process() is not None:  # imported in a child: multiprocessing may end it with os._exit
        in_child()
    owner = threading.Event()  # any object that lives as long as the process
    _owners.append(owner)
    multiprocessing.util.register_after_fork(owner, lambda _: in_child())
