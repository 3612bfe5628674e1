"""Collectives that never hang and never let ranks diverge: barrier, agree, broadcast, together.

Every function here is a *collective*: all ranks call it, in the same order. They run over the
process group's key-value store (the c10d ``TCPStore`` every launcher sets up), not over the backend's
collectives, for three reasons:

* a timeout is ours to choose, and when it expires we know *which* ranks never arrived;
* a decision (a bool, a float, a small object) needs no device tensors, whatever the backend (gloo, NCCL);
* every call carries its name, so ranks that reach *different* collectives at the same point (diverged
  control flow, the root of most hangs) get :class:`CollectiveMismatch` instead of a silent deadlock.

One *exchange* is the building block: each rank posts its value, rank 0 waits for all of them, reduces
them, and posts one :data:`Outcome` that every rank reads. Rank 0 does O(world) store operations, every other
rank O(1). In a single process each function is a local no-op with the same return value.

The outcome of an exchange is written once (``compare_set`` on an absent key): whoever writes it first decides
for every rank. Normally that is rank 0; a rank that gives up waiting (a timeout, or a rank that aborted and is
missing) writes its verdict instead, and rank 0, arriving later, reads it. So every rank that leaves an exchange
leaves it with the same outcome, never "ok" on some and an error on others. The states and transitions of this
failure path are one table in ``docs/design.md``.

:class:`StepNotice` is the per-step counterpart: one rank posts, every rank acts at the same later step boundary,
for one store read per boundary while nothing is posted.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import math
import numbers
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from . import topology
from .choice import Choice
from .errors import BarrierTimeout, CollectiveMismatch, Failure, RankFailure, rank_failure

T = TypeVar("T")

DEFAULT_TIMEOUT = 1800.0
"""Seconds a collective waits for the slowest rank (``RANKSAFE_TIMEOUT`` overrides it)."""

ABORT_GRACE = 2.0
"""Once a rank has aborted, seconds an exchange still waits for the ranks it misses (ranks that all failed alike
still meet)."""

EXIT_WAIT = 10.0
"""At most this many seconds rank 0 stays at exit, until the other ranks have left or failed (it may host the
store they need to read the last outcome and its failure)."""

EXITED = "ranksafe.Exited"
"""The type name of the failure a rank posts for itself as it exits (see :func:`_at_exit`)."""


def checked_timeout(timeout: Any, name: str = "timeout") -> float | None:
    """``timeout`` in seconds, or None; anything but a positive, finite number (or None) is a ``ValueError`` naming
    ``name``: a zero or negative timeout would report every rank missing at once, an infinite one never."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds or None, not {timeout!r}")
    return float(timeout)


def default_timeout() -> float:
    """Seconds a collective waits when no timeout is given: ``RANKSAFE_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`."""
    text = os.environ.get("RANKSAFE_TIMEOUT")
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan  # refused below, with the variable's text
    if not 0 < seconds < math.inf:
        raise ValueError(f"RANKSAFE_TIMEOUT must be a positive number of seconds, not {text!r}")
    return seconds


# -- outcomes: what an exchange decided, the same on every rank ---------------------------------------------


@dataclass(frozen=True)
class Agreed:
    """Every rank posted to the same collective; ``value`` is the reduction of their values."""

    value: Any

    def settle(self, what: str, timeout: float) -> Any:
        """The value, on every rank."""
        return self.value


@dataclass(frozen=True)
class TimedOut:
    """The timeout passed before the ``missing`` ranks posted."""

    missing: tuple[int, ...]

    def settle(self, what: str, timeout: float) -> Any:
        """Raise :class:`BarrierTimeout` naming the missing ranks."""
        raise BarrierTimeout(what, list(self.missing), timeout)


@dataclass(frozen=True)
class Diverged:
    """Every rank posted, to collectives of different ``names`` (in rank order): their control flow diverged."""

    names: tuple[str, ...]

    def settle(self, what: str, timeout: float) -> Any:
        """Raise :class:`CollectiveMismatch` naming each rank's collective."""
        raise CollectiveMismatch(
            what, [Failure(r, "ranksafe.CollectiveMismatch", f"was in {n!r}") for r, n in enumerate(self.names)]
        )


@dataclass(frozen=True)
class Failed:
    """Ranks failed: aborted ranks the exchange waited for in vain, or rank 0's reduction of the values."""

    failures: tuple[Failure, ...]

    def settle(self, what: str, timeout: float) -> Any:
        """Raise the same :class:`RankFailure` (of the failures' type, when they share one) on every rank."""
        raise rank_failure(what, list(self.failures))


Outcome = Agreed | TimedOut | Diverged | Failed


class Wait(enum.Enum):
    """How a wait for keys in the store ended (:func:`_wait_for`)."""

    ARRIVED = "every key awaited is there"
    DECIDED = "another rank wrote the outcome first"
    TIMED_OUT = "the timeout passed"
    GRACE_OVER = "a rank has aborted, and the abort grace passed"


@dataclass(frozen=True)
class Abort:
    """A rank's failure outside a shared section, posted under its abort key: it failed at or after exchange
    ``at`` (the number of exchanges it had entered), and why."""

    at: int
    failure: Failure


# -- the session: this process's state in one process group -----------------------------------------------


class _Session:
    """Per-process-group state: the store, a key prefix unique to this group's lifetime, the call count."""

    def __init__(self) -> None:
        self.group_id = id(dist.group.WORLD)
        self.store = dist.distributed_c10d._get_default_store()
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

    def current(self) -> bool:
        """Whether this session belongs to the process group in use now."""
        return topology.is_distributed() and self.group_id == id(dist.group.WORLD)


@dataclass(frozen=True)
class _Keys:
    """The store keys of exchange ``seq``: each rank's post, and the outcome."""

    posts: list[str]
    outcome: str

    @classmethod
    def of(cls, s: _Session, seq: int) -> _Keys:
        base = f"{s.prefix}{seq}"
        return cls([f"{base}/{r}" for r in range(s.world)], f"{base}/result")


# The one piece of module state: the session of the process group in use, made on first use (under the lock:
# a signal handler, or another thread, may get here too; re-entrant, see _refuse_nesting).
_session: _Session | None = None
_session_lock = threading.RLock()


def _get_session(timeout: float | None, what: str | None = None) -> _Session | None:
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
        if _session is None or not _session.current():
            _session = _Session()
        if not _session.hosts:
            # named after the caller's collective: a rank missing here is missing there
            _session.hosts = _exchange_in(_session, "ranksafe:hosts", topology.hostname(), list, timeout, what)
            topology.record_host_exchange(_session.hosts)
        return _session


def _lost_store(s: _Session, what: str, e: dist.DistError) -> RankFailure:
    lost = (
        f"lost the rendezvous store ({str(e).splitlines()[0]}); the process hosting it exited: rank 0 "
        "under mp.spawn or Lightning ddp, the launcher's agent under torchrun"
    )
    return RankFailure(what, [Failure(s.rank, "ConnectionError", lost)])


# -- one exchange ------------------------------------------------------------------------------------------


def _refuse_nesting(s: _Session, name: str) -> None:
    """Raise, instead of deadlocking, when this thread is already inside an exchange.

    Only a signal handler can get here (Lightning saves a checkpoint from its SLURM requeue handler): it runs
    on the thread it interrupted, which holds the lock and waits for the other ranks, so taking the lock again
    would wait forever; and the ranks, each interrupted at a different point, would pair different collectives.
    """
    inside = s.inside
    if inside is not None and inside[0] == threading.get_ident():
        raise RuntimeError(
            f"ranksafe: collective {name!r} started while this thread is inside collective {inside[1]!r} (from a "
            "signal handler?): its ranks could never meet; set a flag in the handler and act on it in the "
            "training loop"
        )


@contextlib.contextmanager
def _inside(s: _Session, name: str) -> Iterator[None]:
    s.inside = (threading.get_ident(), name)
    try:
        yield
    finally:
        s.inside = None


def _exchange_in(
    s: _Session, name: str, value: Any, reduce: Callable[[list], Any], timeout: float | None, what: str | None = None
) -> Any:
    what = what or name
    timeout = default_timeout() if timeout is None else timeout  # checked by exchange(); None from a step notice
    _refuse_nesting(s, name)
    with s.lock, _inside(s, name):
        s.seq += 1
        keys = _Keys.of(s, s.seq)
        try:
            s.store.set(keys.posts[s.rank], pickle.dumps((name, value)))
            outcome = _lead(s, keys, reduce, timeout) if s.rank == 0 else _follow(s, keys, timeout)
        except dist.DistError as e:
            raise _lost_store(s, what, e) from e
    return outcome.settle(what, timeout)


def _decide(s: _Session, keys: _Keys, proposal: Outcome | None) -> Outcome:
    """Write ``proposal`` as the exchange's outcome unless one is there already; return the one that is.

    The first writer decides for every rank: rank 0 with the reduced values, or a rank that gave up waiting.
    ``None`` proposes nothing (another rank decided already).
    """
    if proposal is None:
        return pickle.loads(s.store.get(keys.outcome))
    return pickle.loads(s.store.compare_set(keys.outcome, "", pickle.dumps(proposal)))


def _lead(s: _Session, keys: _Keys, reduce: Callable[[list], Any], timeout: float) -> Outcome:
    """Rank 0's part: collect, decide, and clean up the previous exchange once every rank has moved past it."""
    outcome = _decide(s, keys, _collect(s, keys, reduce, timeout))
    missing = [] if isinstance(outcome, Agreed) else _missing(s, keys)
    s.present = [r for r in range(s.world) if r not in missing]
    if s.seq > 1 and not missing:  # each rank read the previous outcome before posting here
        old = _Keys.of(s, s.seq - 1)
        for k in [*old.posts, old.outcome]:
            s.store.delete_key(k)
    return outcome


def _collect(s: _Session, keys: _Keys, reduce: Callable[[list], Any], timeout: float) -> Outcome | None:
    """Rank 0's proposal for the outcome: the reduced values, or why there are none (None: already decided)."""
    deadline = time.monotonic() + timeout
    while (state := _wait_for(s, keys.posts, deadline, keys.outcome)) is Wait.GRACE_OVER:
        gone = _gone(s, keys)
        if gone:
            return Failed(tuple(gone))
    if state is Wait.DECIDED:
        return None
    if state is Wait.TIMED_OUT:
        return TimedOut(tuple(_missing(s, keys)))
    return _reduce(s, keys, reduce)


def _reduce(s: _Session, keys: _Keys, reduce: Callable[[list], Any]) -> Outcome:
    """Rank 0's proposal once every rank has posted."""
    posted = [pickle.loads(b) for b in s.store.multi_get(keys.posts)]
    names = tuple(n for n, _ in posted)
    if len(set(names)) > 1:
        # A rank that failed alone, caught its error and went on posts its next collective where the others still
        # wait in theirs: its failure (posted since the exchange before this one) is the cause, the mismatch only
        # its symptom. Its abort stands: the ranks are out of step, and a later exchange it misses gives up after
        # the grace instead of the timeout.
        fresh = tuple(a.failure for a in _aborts(s) if a.at >= s.seq - 1)
        return Failed(fresh) if fresh else Diverged(names)
    _clear_stale_aborts(s)
    try:
        return Agreed(reduce([v for _, v in posted]))
    except Exception as e:  # a reduction that cannot combine the values (e.g. max of mixed types)
        return Failed((Failure.from_exception(0, e),))


def _follow(s: _Session, keys: _Keys, timeout: float) -> Outcome:
    """A non-main rank's outcome: rank 0's, or, if this rank gives up first, its own verdict, written for all.

    When the grace ends and no aborted rank is gone (:func:`_gone`: its abort stands for a rank that is here, or
    rank 0 withdrew it, once every rank had posted to this very exchange), the wait goes on: the outcome is on
    the way, and deciding an abort would name no rank.
    """
    deadline = time.monotonic() + timeout
    while True:
        state = _wait_for(s, [keys.outcome], deadline)
        if state is Wait.ARRIVED:
            return _decide(s, keys, None)
        if state is Wait.TIMED_OUT:
            return _decide(s, keys, TimedOut(tuple(_missing(s, keys) or [0])))
        gone = _gone(s, keys)
        if gone:
            return _decide(s, keys, Failed(tuple(gone)))


def _wait_for(s: _Session, keys: list[str], deadline: float, decided: str | None = None) -> Wait:
    """Wait until every key exists, the outcome key ``decided`` exists (someone gave up), ``deadline`` passes,
    or, once a rank has aborted, :data:`ABORT_GRACE` seconds pass. A rank that aborted may be gone for good; the
    grace lets ranks that all failed alike (and all take part in the next exchange) meet as usual.

    Polls with ``check`` (cheap, and silent where ``store.wait`` logs each timeout; ``wait`` cannot watch two
    keys at once either), backing off from 0.2 ms to a ceiling that grows with the world (5 ms up to 16 ranks,
    0.3 s at 1,000), so a quick collective stays quick and a long wait (a writer saving gigabytes) costs the
    store server at most a few thousand requests a second in all.
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


def _missing(s: _Session, keys: _Keys) -> list[int]:
    return [r for r, k in enumerate(keys.posts) if not s.store.check([k])]


def _aborts(s: _Session) -> list[Abort]:
    """The aborts posted now, in rank order."""
    keys = [s.abort_key(r) for r in range(s.world)]
    return [pickle.loads(s.store.get(k)) for k in keys if s.store.check([k])]


def _gone(s: _Session, keys: _Keys) -> list[Failure]:
    """The failures of the aborted ranks that this exchange waits for in vain: those that did not post to it, and
    those that failed in it or after it. A rank that failed earlier, caught its error and posted here (the ranks
    out of step after it, its abort standing) is not gone: a late arrival of the others must not fail on it."""
    return [a.failure for a in _aborts(s) if a.at >= s.seq or not s.store.check([keys.posts[a.failure.rank]])]


def _clear_stale_aborts(s: _Session) -> None:
    """On rank 0, once every rank has posted to this exchange, the same collective: a rank that aborted before it
    has come back in step (it caught its error and goes on), so its abort no longer stands for a rank that is
    gone."""
    if s.store.add(s.aborts_key, 0) <= 0:
        return
    for r in range(s.world):
        key = s.abort_key(r)
        if s.store.check([key]) and pickle.loads(s.store.get(key)).at < s.seq:
            s.store.delete_key(key)
            s.store.add(s.aborts_key, -1)


# -- the collectives -----------------------------------------------------------------------------------------


def exchange(
    name: str, value: Any, reduce: Callable[[list], T], timeout: float | None = None, what: str | None = None
) -> T:
    """Post ``value``, get ``reduce(values of all ranks in rank order)`` back on every rank.

    The primitive under every ranksafe collective. ``name`` says which collective this is and must be the
    same on all ranks at this call (else :class:`CollectiveMismatch`); ``what`` (default: ``name``) is
    the rank's own description for error messages, and may differ per rank (a per-rank path, say).
    """
    timeout = default_timeout() if timeout is None else checked_timeout(timeout)  # one process refuses it too
    s = _get_session(timeout, what or name)
    if s is None:
        return reduce([value])
    return _exchange_in(s, name, value, reduce, timeout, what)


def _values_and_failures(reduce: Callable[[list], T]) -> Callable[[list], tuple[T | None, list[Failure]]]:
    def split(posts: list[tuple[Any, Failure | None]]) -> tuple[T | None, list[Failure]]:
        failures = [f for _, f in posts if f is not None]
        return (None if failures else reduce([v for v, _ in posts])), failures

    return split


def exchange_outcome(
    name: str,
    value: Any,
    exc: BaseException | None,
    reduce: Callable[[list], Any] = list,
    timeout: float | None = None,
    what: str | None = None,
) -> Any:
    """Post ``value`` and whether this rank failed (``exc``); get ``reduce(values in rank order)`` on every rank,
    or the same :class:`RankFailure` on every rank when any rank posted a failure. Collective, one exchange.

    The failing rank chains its own exception as the cause; in a single process ``exc`` itself is raised. The
    values are not reduced when a rank failed. ``name`` and ``what`` as in :func:`exchange`.
    """
    mine = None if exc is None else Failure.from_exception(topology.rank(), exc)
    result, failures = exchange(name, (value, mine), _values_and_failures(reduce), timeout, what)
    if failures:
        if exc is not None and topology.world_size() == 1:
            raise exc
        raise rank_failure(what or name, failures) from exc
    return result


def barrier(name: str = "", timeout: float | None = None, what: str | None = None) -> None:
    """Wait until every rank arrives; raise :class:`BarrierTimeout` naming the missing ranks otherwise."""
    exchange(f"barrier:{name}", None, lambda _: None, timeout, what)


def _nan_aware(fn: Callable[[list], Any]) -> Callable[[list], Any]:
    # Python's max/min answer depends on where a NaN sits in the list; a NaN anywhere must win everywhere.
    def reduce(values: list) -> Any:
        if any(isinstance(v, float) and math.isnan(v) for v in values):
            return math.nan
        return fn(values)

    return reduce


class AgreeOp(Choice):
    """How :func:`agree` combines the ranks' values."""

    ALL = "all"
    ANY = "any"
    MAX = "max"
    MIN = "min"
    SUM = "sum"
    MEAN = "mean"
    MAIN = "main"


_OPS: dict[AgreeOp, Callable[[list], Any]] = {
    AgreeOp.ALL: lambda vs: all(bool(v) for v in vs),
    AgreeOp.ANY: lambda vs: any(bool(v) for v in vs),
    AgreeOp.MAX: _nan_aware(max),
    AgreeOp.MIN: _nan_aware(min),
    AgreeOp.SUM: _nan_aware(sum),
    AgreeOp.MEAN: _nan_aware(lambda vs: sum(vs) / len(vs)),
    AgreeOp.MAIN: lambda vs: vs[0],
}


def agree(value: Any, op: AgreeOp | str = AgreeOp.ALL, *, name: str = "", timeout: float | None = None) -> Any:
    """Combine ``value`` across ranks so that every rank gets the same answer.

    ``all``/``any`` for booleans, ``max``/``min``/``sum``/``mean`` for numbers (a NaN on any rank gives NaN
    on all), ``main`` for rank 0's value of any picklable object. Use it before any branch that decides
    whether ranks reach a collective: a new best?, stop?, retry?, does the file exist?
    """
    op = AgreeOp(op)
    if hasattr(value, "item") and callable(value.item):  # a 0-d tensor or numpy scalar
        value = value.item()
    return exchange(f"agree[{op}]:{name}", value, _OPS[op], timeout)


def broadcast(obj: T, src: int = 0, *, name: str = "", timeout: float | None = None) -> T:
    """Rank ``src``'s ``obj`` on every rank (a small picklable object; use torch for big tensors)."""
    mine = obj if topology.rank() == src else None
    return exchange(f"broadcast[{src}]:{name}", mine, lambda vs: vs[src], timeout)


def all_gather(obj: Any, *, name: str = "", timeout: float | None = None) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    return exchange(f"all_gather:{name}", obj, list, timeout)


def share_outcome(name: str, exc: BaseException | None, timeout: float | None = None, what: str | None = None) -> None:
    """Tell every rank whether this rank failed; raise :class:`RankFailure` everywhere if any did.

    The failing rank's own exception is chained as the cause. In a single process the original
    exception is re-raised unchanged.
    """
    exchange_outcome(f"outcome:{name}", None, exc, lambda _: None, timeout, what or name)


class together:
    """Run a block on every rank; if it raises on any rank, raise :class:`RankFailure` on all of them.

    One small collective when nothing fails. The failing rank chains its original exception. Use it
    around any block whose failure on one rank would otherwise leave the others waiting forever in the
    next collective.
    """

    def __init__(self, name: str = "together", timeout: float | None = None, what: str | None = None):
        self.name = name
        self.timeout = timeout
        self.what = what

    def __enter__(self) -> together:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        share_outcome(self.name, exc, self.timeout, self.what)
        return False


@contextmanager
def main_first(name: str = "main_first", timeout: float | None = None) -> Iterator[None]:
    """Run the block on rank 0 first, then on the others (downloads, caches, directory creation).

    If rank 0's block raises, the other ranks raise :class:`RankFailure` instead of running theirs; if
    another rank's block raises, every rank raises it. No rank is ever left waiting.
    """
    main = topology.is_main()
    if not main:
        share_outcome(f"{name}:main", None, timeout)  # returns once main's block is done, raises if it failed
    exc: BaseException | None = None
    try:
        yield
    except BaseException as e:
        exc = e
    if main:
        share_outcome(f"{name}:main", exc, timeout)
    share_outcome(f"{name}:others", None if main else exc, timeout)


# -- a rank that fails alone, or leaves ----------------------------------------------------------------------


def abort(exc: BaseException) -> None:
    """Tell every rank that this rank failed outside a shared section: their collectives raise now.

    A rank that raises on its own (a log write, a user callback) never reaches the next collective, and
    the others would wait there until the timeout. After ``abort``, a collective that misses a rank (waiting,
    or started later in this process group) raises :class:`RankFailure` naming this rank and its error on
    every rank, 2 seconds (the grace) after it noticed the abort, instead of waiting for the timeout.
    Collectives that every rank reaches in time still run: ranks that all failed alike (a signal, an error
    in the same batch) can still take part in an exception-time save together, and a rank that caught its
    error and takes part again withdraws its abort. A :class:`RankFailure` is already known everywhere and is
    not posted again. Local; never raises.
    """
    if isinstance(exc, RankFailure) or not topology.is_distributed() or dist.get_world_size() == 1:
        return
    _post_abort(Failure.from_exception(topology.rank(), exc), replace=True)


def _post_abort(failure: Failure, replace: bool) -> None:
    """Post ``failure`` under this rank's abort key, and count it, unless one is there and not ``replace``."""
    global _session
    with contextlib.suppress(dist.DistError), _session_lock:
        if _session is None or not _session.current():
            _session = _Session()  # the host exchange waits for the next collective, which will raise
        s = _session
        key = s.abort_key(s.rank)
        posted = s.store.check([key])
        if posted and not replace:
            return
        s.store.set(key, pickle.dumps(Abort(s.seq, failure)))
        if not posted:
            s.store.add(s.aborts_key, 1)


@contextmanager
def abort_on_error() -> Iterator[None]:
    """Run a block (a training loop, a ``fit``) so that an exception in it reaches every rank within seconds.

    Any exception escaping the block is posted with :func:`abort` and re-raised: the other ranks raise
    :class:`RankFailure` at their next (or current) ranksafe collective instead of waiting for a rank that
    is gone. The integrations wrap ``fit`` in it.
    """
    try:
        yield
    except BaseException as e:
        abort(e)
        raise


@atexit.register
def _at_exit() -> None:
    """At exit, a rank that took part in a ranksafe collective of this group says it is gone, as :func:`abort`
    does (a rank that posted a failure keeps it): a collective it never reaches (a call guarded by
    ``if rank == 0:``, fastai's stock idiom for ``export``) gives up after the grace, naming it, instead of
    waiting for the timeout. Then rank 0 stays (:func:`_stay_for_the_others`). A process that never ran a
    collective makes no store request at exit."""
    s = _session
    if s is None or not s.current() or not _store_answers(s.store):
        return
    _post_abort(Failure(s.rank, EXITED, "the process ended without reaching this collective"), replace=False)
    if s.rank == 0:
        _stay_for_the_others(s)


def _stay_for_the_others(s: _Session) -> None:
    """On rank 0 at exit: wait, at most :data:`EXIT_WAIT` seconds, until every rank that posted to the last
    exchange has posted that it failed or exited.

    Under ``mp.spawn`` and Lightning's ddp the store lives in rank 0's process. A rank 0 that left at once took
    it along: the others lost it before reading the last outcome, or the failure rank 0 had posted, or its exit
    marker (a collective only they reach), and raised "lost the rendezvous store", naming no cause.
    """
    deadline = time.monotonic() + EXIT_WAIT
    others = [s.abort_key(r) for r in s.present if r != 0]
    with contextlib.suppress(dist.DistError):
        while others and not s.store.check(others) and time.monotonic() < deadline:
            time.sleep(0.01)


def _store_answers(store: dist.Store) -> bool:
    """Whether the TCP store's server still accepts connections (one plain connect): under ``mp.spawn`` it lives
    in rank 0's process, and a request to it once rank 0 has exited prints a C++ error trace (c10d's), which
    Python cannot catch. True for other stores."""
    while hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if not (isinstance(store, dist.TCPStore) and host and port):
        return True
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


# -- step notices ----------------------------------------------------------------------------------------------


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

    def _where(self) -> tuple[_Session, str] | None:
        """The session and this notice's key now; None in a single process."""
        s = _get_session(None, f"step notice {self.name}")
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
def _store_errors(s: _Session, name: str) -> Iterator[None]:
    try:
        yield
    except dist.DistError as e:
        raise _lost_store(s, f"step notice {name}", e) from e
