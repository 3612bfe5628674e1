"""Collectives that never hang and never let ranks diverge: barrier, agree, broadcast, together.

Every function here is a *collective*: all ranks call it, in the same order. Each runs over exchanges on the
process group's store (:mod:`ranksafe.exchange`; one each, except ``main_first`` and the block of ``together``): a
timeout that names the ranks that never arrived, a :class:`~ranksafe.CollectiveMismatch` when ranks reach
different collectives, and one outcome for every rank. In a single process each function is a local no-op with
the same return value.

:func:`abort` and the exit hook cover the ranks that fail, or leave, outside any collective: the others raise at
their next collective within seconds instead of waiting for the timeout.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

from . import topology
from .choice import Choice
from .errors import Failure, RankFailure, rank_failure
from .exchange import Session, checked_timeout, default_timeout, exchange, existing_session, post_abort
from .process_exit import at_exit

__all__ = [
    "AgreeOp", "abort", "abort_on_error", "agree", "all_gather", "barrier", "broadcast", "checked_timeout",
    "default_timeout", "exchange", "exchange_outcome", "main_first", "share_outcome", "together",
]  # fmt: skip

T = TypeVar("T")


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

    The failing rank chains its own exception as the cause. It raises ``exc`` itself, unchanged, in a single
    process, when ``exc`` is no ``Exception`` (Ctrl-C, ``sys.exit``: stock ``except Exception`` clauses must not
    catch them), and when ``exc`` is a :class:`RankFailure` that every failed rank posted alike (a collective that
    failed inside this one already raised it on every rank, with its type), or one marked ``out_of_step`` (every rank
    left the block with it: no exchange is made). A failing rank posts its failure as an abort first, so that a rank
    still inside the block, in a collective of its own, gets it too. The values are not reduced when a rank failed.
    ``name`` and ``what`` as in :func:`exchange`.
    """
    if isinstance(exc, RankFailure) and exc.out_of_step:
        raise exc  # every rank left the block with it already: an exchange now would meet none of them
    mine = None if exc is None else Failure.from_exception(topology.rank(), exc)
    if exc is not None:
        # posted first: a rank still inside the block, in a collective of its own, meets this post under another
        # name, and must raise this failure, not a mismatch (the abort is withdrawn once every rank posts here)
        abort(exc)
    shared = None
    try:
        result, failures = exchange(name, (value, mine), _values_and_failures(reduce), timeout, what, exc is not None)
    except RankFailure as e:
        if exc is None:
            raise
        shared, failures = e, e.failures  # decided without the values: a rank gone, or ranks out of step
    if failures:
        if exc is not None and (topology.world_size() == 1 or not isinstance(exc, Exception)):
            raise exc
        if isinstance(exc, RankFailure) and all(
            (f.type_name, f.message) == (mine.type_name, mine.message) for f in failures
        ):
            raise exc
        raise (shared or rank_failure(what or name, failures)) from exc
    return result


def barrier(name: str = "", timeout: float | None = None, what: str | None = None) -> None:
    """Wait until every rank arrives; raise :class:`~ranksafe.BarrierTimeout` naming the missing ranks otherwise."""
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
    if op is not AgreeOp.MAIN:
        value = _as_number(value)
    return exchange(f"agree[{op}]:{name}", value, _OPS[op], timeout)


def _as_number(value: Any) -> Any:
    """A one-element tensor or numpy value as a Python number, so that every rank reduces plain numbers.

    Anything else is posted as it is: a value the reduction cannot combine fails there, alike on every rank,
    where raising here would fail this rank alone.
    """
    if getattr(value, "ndim", None) is not None and getattr(value, "size", None) is not None:
        with contextlib.suppress(ValueError, RuntimeError):  # more than one element
            return value.item()
    return value


def broadcast(obj: T, src: int = 0, *, name: str = "", timeout: float | None = None) -> T:
    """Rank ``src``'s ``obj`` on every rank (a small picklable object; use torch for big tensors)."""
    if not 0 <= src < topology.world_size():
        raise ValueError(f"broadcast: src={src} is not a rank of this group (0 to {topology.world_size() - 1})")
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
    next collective. Blocks that nest need names of their own: a rank that left the outer block with its failure
    would meet the others in an inner block of the same name as if it were the outer one.

    The same exchange can carry a value: each rank's :attr:`value` (given here or set inside the block) goes in, and
    after the block :attr:`result` is ``reduce(values in rank order)``, the same on every rank (``None`` without
    ``reduce``), for a check whose inputs are only known once the block ran.
    """

    def __init__(
        self,
        name: str = "together",
        timeout: float | None = None,
        what: str | None = None,
        value: Any = None,
        reduce: Callable[[list], Any] | None = None,
    ):
        self.name, self.timeout, self.what = name, timeout, what
        self.value, self.reduce = value, reduce
        self.result: Any = None

    def __enter__(self) -> together:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.reduce is None:
            share_outcome(self.name, exc, self.timeout, self.what)
        else:
            self.result = exchange_outcome(
                f"outcome:{self.name}", self.value, exc, self.reduce, self.timeout, self.what or self.name
            )
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


EXIT_WAIT = 10.0
"""At most this many seconds rank 0 stays at exit, until the other ranks have left or failed (it may host the
store they need to read the last outcome and its failure)."""

EXITED = "ranksafe.Exited"
"""The type name of the failure a rank posts for itself as it exits (see :func:`_at_exit`)."""


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
    if isinstance(exc, RankFailure) or not topology.with_other_ranks():
        return
    post_abort(Failure.from_exception(topology.rank(), exc), replace=True)


@contextmanager
def abort_on_error() -> Iterator[None]:
    """Run a block (a training loop, a ``fit``) so that an exception in it reaches every rank within seconds.

    Any exception escaping the block is posted with :func:`abort` and re-raised: the other ranks raise
    :class:`RankFailure` at their next (or current) ranksafe collective instead of waiting for a rank that
    is gone. The integrations do the same for a ``fit``: fastai's ``fit``, Lightning's ``on_exception``. A rank
    that catches the error and goes on meets the others again at its next collective, which they reach once they
    have left theirs with its failure.
    """
    try:
        yield
    except BaseException as e:
        abort(e)
        raise


def _at_exit() -> None:
    """At exit, a rank that took part in a ranksafe collective of this group says it is gone, as :func:`abort`
    does (a rank that posted a failure keeps it): a collective it never reaches (a call guarded by
    ``if rank == 0:``, fastai's stock idiom for ``export``) gives up after the grace, naming it, instead of
    waiting for the timeout. Then rank 0 stays (:func:`_stay_for_the_others`). A process that never ran a
    collective makes no store request at exit."""
    s = existing_session()
    if s is None or not _store_answers(s.store):
        return
    post_abort(Failure(s.rank, EXITED, "the process ended without reaching this collective"), replace=False)
    if s.rank == 0:
        _stay_for_the_others(s)


at_exit(_at_exit, priority=50)  # also in a forked launcher's ranks, which end with os._exit


def _stay_for_the_others(s: Session) -> None:
    """On rank 0 at exit: wait, at most :data:`EXIT_WAIT` seconds, until every rank that posted to the last
    exchange has posted that it failed or exited.

    Under ``mp.spawn`` and Lightning's ddp the store lives in rank 0's process. A rank 0 that left at once took
    it along: the others lost it before reading the last outcome, or the failure rank 0 had posted, or its exit
    marker (a collective only they reach), and raised "lost the rendezvous store", naming no cause.
    """
    deadline = time.monotonic() + EXIT_WAIT
    others = [r for r in s.present if r != 0]
    with contextlib.suppress(dist.DistError):
        while time.monotonic() < deadline:
            if s.store.check([s.abort_key(r) for r in others]):  # one request while some rank has posted nothing
                others = [r for r in others if s.standing_abort(r) is None]  # a withdrawn mark: not gone yet
                if not others:
                    break
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
