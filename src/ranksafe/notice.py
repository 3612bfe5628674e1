"""Step notices: something any rank tells every rank between training steps, acted on by all at the same step.

The per-step counterpart of an exchange (:mod:`ranksafe.exchange`): no rank waits for another, and a step boundary
costs one non-blocking store read while nothing is posted. Used for a background write's failure
(:meth:`~ranksafe.AsyncSaver.poll`) and a preemption signal received by one rank.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from . import topology
from .exchange import Session, lost_store, session

_WITHDRAWN = b"ranksafe: withdrawn"
"""What a withdrawn notice's key holds (a pickle never starts so)."""


@dataclass(frozen=True)
class Notice:
    """What :meth:`StepNotice.post` wrote: ``rank`` posted ``payload``, due at step boundary ``at``."""

    at: int
    rank: int
    payload: Any


class StepNotice:
    """Something any rank tells every rank between steps, acted on by every rank at the same step boundary,
    for one non-blocking store read per boundary while nothing is posted.

    Every rank calls :meth:`poll` once per step boundary (after each training step), so its count of calls is the
    same step on every rank. A boundary follows a point every rank passes in step: an optimizer step's gradient
    all-reduce (with gradient accumulation, poll after the last micro-batch, not after each). A rank posts with
    :meth:`post` at its boundary ``n``; the notice is due at ``n + 1``, where :meth:`poll` returns it on every rank,
    the poster included. Why ``n + 1`` is safe in data-parallel training: another rank's boundary ``n + 1`` follows
    its step ``n + 1``, whose gradient all-reduce needs the poster's step ``n + 1``, which starts after the post; so
    every rank reads the notice in time. Acting at ``n`` on the poster alone would leave the others blocked in the
    next all-reduce, where nothing of ranksafe can reach them. A rank that reads a notice due at a boundary it has
    passed (ranks that do not meet every step) gets it at once. A notice is written once: while one stands, a later
    post returns it instead of replacing it; once acted on, the next post is a new notice.

    Uses: a background failure raised on every rank at the same step (:meth:`~ranksafe.AsyncSaver.poll`); a
    signal received by one rank, acted on by all at the same step. Notices of
    one name are told apart by the order of their first use, which must be the same on every rank. In a
    single process the notice stays in this object, with the same semantics.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0  # boundaries polled: the same on every rank
        self.generation = 0  # notices acted on: each gets a fresh key
        self._home: tuple[int, str] | None = None  # (group id, key prefix), from the first use in a group
        self._local: Notice | None = None  # a single process has no store

    def _where(self) -> tuple[Session, str] | None:
        """The session and this notice's key now; None in a single process."""
        s = session(None, f"step notice {self.name}")
        if s is None:
            return None
        if self._home is None or self._home[0] != s.group_id:
            index = s.notices[self.name] = s.notices.get(self.name, 0) + 1
            self._home = (s.group_id, f"{s.prefix}notice/{self.name}#{index}/")
        return s, f"{self._home[1]}{self.generation}"

    def _read(self) -> Notice | None:
        """The notice standing now, due or not: one store request while there is none."""
        where = self._where()
        if where is None:
            return self._local
        s, key = where
        with _store_errors(s, self.name):
            if not s.store.check([key]):
                return None
            data = s.store.get(key)
        return None if data == _WITHDRAWN else pickle.loads(data)

    def poll(self) -> Notice | None:
        """Count one step boundary; return the notice due now (or passed), else None. Every rank, once per
        boundary; one non-blocking store read while nothing is posted. A notice returned is acted on: the
        next :meth:`post` makes a new one."""
        self.count += 1
        notice = self._read()
        if notice is None or notice.at > self.count:
            return None
        self.generation += 1
        self._local = None
        return notice

    def post(self, payload: Any) -> Notice:
        """Post ``payload`` for the next boundary, unless a notice stands already; return the one that stands
        (this rank's, or another's posted first). Local: no waiting for other ranks."""
        notice = Notice(self.count + 1, topology.rank(), payload)
        where = self._where()
        if where is None:
            self._local = self._local or notice
            return self._local
        s, key = where
        data = pickle.dumps(notice)
        with _store_errors(s, self.name):
            standing = s.store.compare_set(key, "", data)
            if standing == _WITHDRAWN:  # a notice withdrawn at this generation: this one takes its place
                standing = s.store.compare_set(key, _WITHDRAWN, data)
        return pickle.loads(standing)

    def withdraw(self) -> None:
        """Take the standing notice back before it is due, on the rank that posted it, when its payload travels
        another way: a collective that every rank reaches before the next boundary, which reports it. Local.

        The key is overwritten with a mark, not deleted: another rank may be reading it at this boundary still
        (between its check and its get), and a get of a deleted key waits for it, or reads nothing."""
        where = self._where()
        if where is None:
            self._local = None
            return
        s, key = where
        with _store_errors(s, self.name):
            s.store.set(key, _WITHDRAWN)


@contextlib.contextmanager
def _store_errors(s: Session, name: str) -> Iterator[None]:
    try:
        yield
    except dist.DistError as e:
        raise lost_store(s, f"step notice {name}", e) from e
