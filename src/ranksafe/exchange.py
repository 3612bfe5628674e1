"""One exchange over the process group's store: every rank posts a value, every rank leaves with one outcome.

The building block of every ranksafe collective (:mod:`ranksafe.collectives`). It runs over the key-value store
that every launcher sets up (the c10d ``TCPStore``), not over the backend's collectives, for three reasons:

* a timeout is ours to choose, and when it expires we know *which* ranks never arrived;
* a decision (a bool, a float, a small object) needs no device tensors, whatever the backend (gloo, NCCL);
* every post carries the collective's name, so ranks that reach *different* collectives at the same point
  (diverged control flow, the root of most hangs) get :class:`~ranksafe.CollectiveMismatch`, not a deadlock.

Each rank posts its value; rank 0 waits for all of them, reduces them, and writes one
:data:`~ranksafe.outcomes.Outcome` that every rank reads. Rank 0 does O(world) store operations, every other rank
O(1). The outcome is written once (``compare_set`` on an absent key): normally by rank 0; a rank that gives up
waiting (a timeout, or an aborted rank that is missing) writes its verdict instead, and rank 0, arriving later,
reads it. So every rank leaves an exchange with the same outcome, never "ok" on some and an error on others.

A rank that fails outside any exchange posts an *abort* (:func:`post_abort`): an exchange that misses that rank
gives up after :data:`ABORT_GRACE` instead of the timeout.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from . import topology
from .errors import Failure, RankFailure
from .options import checked_timeout, default_timeout
from .outcomes import Abort, Agreed, Diverged, Failed, Outcome, TimedOut, Wait
from .torch_compat import default_store

T = TypeVar("T")

ABORT_GRACE = 2.0
"""Once a rank has aborted, seconds an exchange still waits for the ranks it misses (ranks that all failed alike
still meet)."""


# -- the session: this process's state in one process group -----------------------------------------------


_WITHDRAWN = b"ranksafe: withdrawn"
"""What a withdrawn abort's key holds (a pickle never starts so)."""


class Session:
    """Per-process-group state: the store, a key prefix unique to this group's lifetime, the call count."""

    def __init__(self) -> None:
        self.group_id = id(dist.group.WORLD)
        self.pid = os.getpid()  # a process forked from a rank (a DataLoader worker) inherits this object: not its own
        self.store = default_store()
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # A store can outlive a process group (torchrun's agent store, re-initialised groups): number the
        # sessions so keys of an earlier group are never read. Ranks of one group all draw from the same
        # block of `world` tickets, so they compute the same session index.
        ticket = self.store.add("ranksafe/sessions", 1)
        self.prefix = f"ranksafe/{(ticket - 1) // self.world}/"
        self.aborts_key = f"{self.prefix}aborts"  # how many ranks have an abort posted (one store op to poll)
        self.seq = 0
        self.lock = threading.Lock()  # one exchange at a time in this process, whatever the thread
        self.inside: tuple[int, str] | None = None  # (thread ident, name) of the exchange holding the lock
        self.hosts: list[str] = []
        self.present: list[int] = list(range(self.world))  # on rank 0: the ranks that posted to the last exchange
        self.notices: dict[str, int] = {}  # step notices in use, per name (they are numbered in order of first use)

    def abort_key(self, rank: int) -> str:
        """Rank ``rank``'s :class:`Abort`."""
        return f"{self.prefix}abort/{rank}"

    def standing_abort(self, rank: int) -> Abort | None:
        """Rank ``rank``'s :class:`Abort`, unless it has none or it was withdrawn (:func:`_clear_stale_aborts`)."""
        key = self.abort_key(rank)
        if not self.store.check([key]):
            return None
        data = self.store.get(key)
        return None if data == _WITHDRAWN else pickle.loads(data)

    def current(self) -> bool:
        """Whether this session belongs to the process group in use now, in this very process."""
        return self.pid == os.getpid() and topology.is_distributed() and self.group_id == id(dist.group.WORLD)


@dataclass(frozen=True)
class _Keys:
    """The store keys of exchange ``seq``: each rank's post, and the outcome."""

    posts: list[str]
    outcome: str

    @classmethod
    def of(cls, s: Session, seq: int) -> _Keys:
        base = f"{s.prefix}{seq}"
        return cls([f"{base}/{r}" for r in range(s.world)], f"{base}/result")


# The one piece of module state: the session of the process group in use, made on first use (under the lock:
# a signal handler, or another thread, may get here too; re-entrant, see _inside).
_session: Session | None = None
_session_lock = threading.RLock()


def session(timeout: float | None, what: str | None = None) -> Session | None:
    """The current group's session, or None in a single process.

    A new session starts with an exchange of host names (local ranks, nodes), under the caller's timeout.
    """
    global _session
    if not topology.is_distributed():
        if topology.world_size() > 1:
            raise RuntimeError(
                f"the launcher says this job has {topology.world_size()} processes but no "
                "torch.distributed process group is initialised here; call "
                "torch.distributed.init_process_group() before ranksafe's collectives"
            )
        return None
    if dist.get_world_size() == 1:
        return None
    with _session_lock:
        if _session is not None and _session.pid != os.getpid() and _session.group_id == id(dist.group.WORLD):
            raise RuntimeError(
                f"ranksafe's collectives run in the ranks: this process was forked from rank {_session.rank} (a "
                "DataLoader worker?), and shares that rank's connection to the store"
            )
        if _session is None or not _session.current():
            _session = Session()
        if not _session.hosts:
            # named after the caller's collective: a rank missing here is missing there
            _session.hosts = _exchange_in(_session, "ranksafe:hosts", topology.hostname(), list, timeout, what)
            topology.record_host_exchange(_session.hosts)
        return _session


def learn_nodes(timeout: float | None = None, what: str | None = None) -> None:
    """Make this rank's local rank and node known before a decision takes them: where no launcher variable says
    them (``mp.spawn``), the host-name exchange that starts a group's session learns them (until then a second node
    would have no local writer). A collective the first time in a process group; local after that."""
    if topology.needs_host_exchange() and topology.is_distributed():
        session(timeout, what)


def lost_store(s: Session, what: str, e: dist.DistError) -> RankFailure:
    lost = (
        f"lost the rendezvous store ({str(e).splitlines()[0]}); the process hosting it exited: rank 0 "
        "under mp.spawn or Lightning ddp, the launcher's agent under torchrun"
    )
    return RankFailure(what, [Failure(s.rank, "ConnectionError", lost)])


# -- one exchange ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _inside(s: Session, name: str) -> Iterator[None]:
    """The exchange ``name`` holds the session's lock. Raises, instead of deadlocking, when this thread is inside an
    exchange already: only a signal handler gets here (Lightning saves a checkpoint from its SLURM requeue handler),
    on the thread it interrupted, which holds the lock and waits for the other ranks; and the ranks, each
    interrupted at a different point, would pair different collectives."""
    inside = s.inside
    if inside is not None and inside[0] == threading.get_ident():
        raise RuntimeError(
            f"ranksafe: collective {name!r} started while this thread is inside collective {inside[1]!r} (from a "
            "signal handler?): its ranks could never meet; set a flag in the handler and act on it in the "
            "training loop"
        )
    with s.lock:
        s.inside = (threading.get_ident(), name)
        try:
            yield
        finally:
            s.inside = None


def _exchange_in(
    s: Session,
    name: str,
    value: Any,
    reduce: Callable[[list], Any],
    timeout: float | None,
    what: str | None = None,
    reporting: bool = False,
) -> Any:
    what = what or name
    timeout = default_timeout() if timeout is None else timeout  # checked by exchange(); None from a step notice
    with _inside(s, name):
        skipped = True
        while skipped:
            s.seq += 1
            keys = _Keys.of(s, s.seq)
            try:
                s.store.set(keys.posts[s.rank], _post(s, name, value))
                outcome = _lead(s, keys, reduce, timeout) if s.rank == 0 else _follow(s, keys, timeout)
                skipped = not reporting and _skipped(s, name, outcome)
            except dist.DistError as e:
                raise lost_store(s, what, e) from e
    return outcome.settle(what, timeout)


def _skipped(s: Session, name: str, outcome: Outcome) -> bool:
    """Whether ``outcome`` ended a collective of the others that this rank never entered: it failed alone before it
    (its abort stands), its caller had that error and went on (this exchange reports none), and its collective is
    another one. Its own is then the next exchange, where the others come once they have raised (design.md, row 19).
    """
    if not (isinstance(outcome, Failed) and outcome.out_of_step and outcome.collectives):
        return False
    mine = s.standing_abort(s.rank)
    return mine is not None and mine.failure in outcome.failures and name not in outcome.collectives


@dataclass(frozen=True)
class _Unposted:
    """Posted in place of a value that cannot be pickled: rank 0 decides its failure for every rank, where raising on
    the spot would fail this rank alone and leave the others waiting for its post."""

    failure: Failure


def _post(s: Session, name: str, value: Any) -> bytes:
    try:
        return pickle.dumps((name, value))
    except Exception as e:  # pickle raises TypeError, AttributeError, PicklingError... for what it cannot take
        return pickle.dumps((name, _Unposted(Failure.from_exception(s.rank, e))))


def _decide(s: Session, keys: _Keys, proposal: Outcome | None) -> Outcome:
    """Write ``proposal`` as the exchange's outcome unless one is there already; return the one that is.

    The first writer decides for every rank: rank 0 with the reduced values, or a rank that gave up waiting.
    ``None`` proposes nothing (another rank decided already).
    """
    if proposal is None:
        return pickle.loads(s.store.get(keys.outcome))
    try:
        data = pickle.dumps(proposal)
    except Exception as e:  # a reduction that returned what cannot be pickled: no rank gets it
        data = pickle.dumps(Failed((Failure.from_exception(s.rank, e),)))
    return pickle.loads(s.store.compare_set(keys.outcome, "", data))


def _lead(s: Session, keys: _Keys, reduce: Callable[[list], Any], timeout: float) -> Outcome:
    """Rank 0's part: collect, decide, and clean up the previous exchange once every rank has moved past it."""
    outcome = _decide(s, keys, _collect(s, keys, reduce, timeout))
    missing = [] if isinstance(outcome, Agreed) else _missing(s, keys)
    s.present = [r for r in range(s.world) if r not in missing]
    if s.seq > 1 and not missing:  # each rank read the previous outcome before posting here
        old = _Keys.of(s, s.seq - 1)
        for k in [*old.posts, old.outcome]:
            s.store.delete_key(k)
    return outcome


def _collect(s: Session, keys: _Keys, reduce: Callable[[list], Any], timeout: float) -> Outcome | None:
    """Rank 0's proposal for the outcome: the reduced values, or why there are none (None: already decided)."""
    deadline = time.monotonic() + timeout
    while (state := _wait_for(s, keys.posts, deadline, keys.outcome)) is Wait.GRACE_OVER:
        gone = _gone(s, keys)
        if gone:
            return _given_up(s, keys, gone)
    if state is Wait.DECIDED:
        return None
    if state is Wait.TIMED_OUT:
        return TimedOut(tuple(_missing(s, keys)))
    return _reduce(s, keys, reduce)


def _reduce(s: Session, keys: _Keys, reduce: Callable[[list], Any]) -> Outcome:
    """Rank 0's proposal once every rank has posted."""
    posted = [pickle.loads(b) for b in s.store.multi_get(keys.posts)]
    names = tuple(n for n, _ in posted)
    if len(set(names)) > 1:
        # A rank that failed and left a shared block (or failed alone, caught its error and went on) posts its next
        # collective where the others still wait in theirs: its failure (posted since the exchange before this one)
        # is the cause, the mismatch only its symptom. Every rank leaves the collective it is in with it, and is in
        # step again (Failed.out_of_step). Its abort stands: should it die now, a later exchange gives up on it after
        # the grace, not the timeout.
        fresh = tuple(a.failure for a in _aborts(s) if a.at >= s.seq - 1)
        if not fresh:
            return Diverged(names)
        failed = {f.rank for f in fresh}
        theirs = tuple(sorted({n for r, n in enumerate(names) if r not in failed}))
        return Failed(fresh, out_of_step=True, collectives=theirs)
    _clear_stale_aborts(s)
    if unposted := tuple(v.failure for _, v in posted if isinstance(v, _Unposted)):
        return Failed(unposted)
    try:
        return Agreed(reduce([v for _, v in posted]))
    except Exception as e:  # a reduction that cannot combine the values (e.g. max of mixed types)
        return Failed((Failure.from_exception(0, e),))


def _follow(s: Session, keys: _Keys, timeout: float) -> Outcome:
    """A non-main rank's outcome: rank 0's, or, if this rank gives up first, its own verdict, written for all. When
    the grace ends and no aborted rank is gone (:func:`_gone`), the wait goes on: the outcome is on the way, and
    deciding an abort would name no rank."""
    deadline = time.monotonic() + timeout
    while True:
        state = _wait_for(s, [keys.outcome], deadline)
        if state is Wait.ARRIVED:
            return _decide(s, keys, None)
        if state is Wait.TIMED_OUT:
            return _decide(s, keys, TimedOut(tuple(_missing(s, keys) or [0])))
        gone = _gone(s, keys)
        if gone:
            return _decide(s, keys, _given_up(s, keys, gone))


def _wait_for(s: Session, keys: list[str], deadline: float, decided: str | None = None) -> Wait:
    """Wait until every key exists, the outcome key ``decided`` exists (someone gave up), ``deadline`` passes,
    or, once a rank has aborted, :data:`ABORT_GRACE` seconds pass. A rank that aborted may be gone for good; the
    grace lets ranks that all failed alike (and all take part in the next exchange) meet as usual.

    Polls with ``check`` (cheap, and silent where ``store.wait`` logs each timeout; ``wait`` cannot watch two
    keys at once either), backing off to a ceiling that grows with the world, so that a quick collective stays
    quick and a long wait (a writer saving gigabytes) costs the store server a bounded rate of requests in all.
    """
    grace_ends: float | None = None
    ceiling = min(1.0, 0.005 * max(1.0, s.world / 16))
    pause = 0.0002
    while not s.store.check(keys):
        if decided is not None and s.store.check([decided]):
            return Wait.DECIDED
        now = time.monotonic()
        if grace_ends is None and s.store.add(s.aborts_key, 0) > 0:
            grace_ends = now + ABORT_GRACE
        if grace_ends is not None and now >= grace_ends:
            return Wait.GRACE_OVER
        if now >= deadline:
            return Wait.TIMED_OUT
        time.sleep(pause)
        pause = min(pause * 2, ceiling)
    return Wait.ARRIVED


def _missing(s: Session, keys: _Keys) -> list[int]:
    return [r for r, k in enumerate(keys.posts) if not s.store.check([k])]


def _aborts(s: Session) -> list[Abort]:
    """The aborts standing now, in rank order."""
    return [a for r in range(s.world) if (a := s.standing_abort(r)) is not None]


def _given_up(s: Session, keys: _Keys, gone: list[Failure]) -> Failed:
    """The outcome when the grace ends with ``gone`` ranks missing: their failures and those of the ranks that failed
    since the exchange before and posted here (news too), in rank order; out of step (see :class:`Failed`), with the
    collectives of the ranks that posted here and did not fail."""
    failures = {a.failure.rank: a.failure for a in _aborts(s) if a.at >= s.seq - 1}
    failures.update({f.rank: f for f in gone})
    posted = [k for r, k in enumerate(keys.posts) if r not in failures and s.store.check([k])]
    theirs = sorted({pickle.loads(b)[0] for b in s.store.multi_get(posted)}) if posted else []
    return Failed(tuple(failures[r] for r in sorted(failures)), out_of_step=True, collectives=tuple(theirs))


def _gone(s: Session, keys: _Keys) -> list[Failure]:
    """The failures of the aborted ranks that this exchange waits for in vain: those that did not post to it, and
    those that failed in it or after it. A rank that failed earlier, caught its error and posted here (the ranks
    out of step after it, its abort standing) is not gone: a late arrival of the others must not fail on it."""
    return [a.failure for a in _aborts(s) if a.at >= s.seq or not s.store.check([keys.posts[a.failure.rank]])]


def _clear_stale_aborts(s: Session) -> None:
    """On rank 0, once every rank has posted to this exchange, the same collective: a rank that aborted before it
    has come back in step (it caught its error and goes on), so its abort no longer stands for a rank that is
    gone."""
    if s.store.add(s.aborts_key, 0) <= 0:
        return
    for r in range(s.world):
        if (standing := s.standing_abort(r)) is not None and standing.at < s.seq:
            # overwritten, not deleted: a waiting rank may be reading it (between its check and its get), and a
            # get of a deleted key waits for the store's timeout
            s.store.set(s.abort_key(r), _WITHDRAWN)
            s.store.add(s.aborts_key, -1)


def exchange(
    name: str,
    value: Any,
    reduce: Callable[[list], T],
    timeout: float | None = None,
    what: str | None = None,
    reporting: bool = False,
) -> T:
    """Post ``value``, get ``reduce(values of all ranks in rank order)`` back on every rank.

    The primitive under every ranksafe collective. ``name`` says which collective this is and must be the
    same on all ranks at this call (else :class:`~ranksafe.CollectiveMismatch`); ``what`` (default: ``name``) is
    the rank's own description for error messages, and may differ per rank (a per-rank path, say). ``reporting``:
    ``value`` carries this rank's own failure, which the exchange reports (see :func:`_skipped`).
    """
    timeout = default_timeout() if timeout is None else checked_timeout(timeout)  # one process refuses it too
    s = session(timeout, what or name)
    if s is None:
        return reduce([value])
    return _exchange_in(s, name, value, reduce, timeout, what, reporting)


def existing_session() -> Session | None:
    """The session of the process group in use, if this process has made one; never makes one."""
    s = _session
    return s if s is not None and s.current() else None


def post_abort(failure: Failure, replace: bool) -> None:
    """Post ``failure`` under this rank's abort key, and count it, unless one is there and not ``replace``."""
    global _session
    with contextlib.suppress(dist.DistError), _session_lock:
        if _session is not None and _session.pid != os.getpid():
            return  # a process forked from a rank is not one: it must not speak for its rank
        if _session is None or not _session.current():
            _session = Session()  # the host exchange waits for the next collective, which will raise
        s = _session
        posted = s.standing_abort(s.rank) is not None
        if posted and not replace:
            return
        s.store.set(s.abort_key(s.rank), pickle.dumps(Abort(s.seq, failure)))
        if not posted:
            s.store.add(s.aborts_key, 1)
