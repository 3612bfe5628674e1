"""The errors ranksafe raises, and how a failure on one rank becomes the same error on every rank.

A failure travels between ranks as a :class:`Failure` record (rank, exception type name, message), never
as a pickled exception: the receiving ranks rebuild the error from plain strings, so no rank unpickles
a class it did not expect, and an exception that cannot be pickled still reaches everyone.
"""

from __future__ import annotations

import builtins
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

from . import remote


def error_naming_target(e: OSError, action: str, path: str | os.PathLike) -> OSError:
    """The same kind of OSError, with a message that names the target (not a temporary) and the rank, and the
    target as its ``path`` (which :class:`RankFailure` carries to every rank)."""
    msg = f"{action} {remote.where(path)}: {e.strerror or e}"
    try:
        error = type(e)(e.errno, msg) if e.errno is not None else type(e)(msg)
    except Exception:  # a subclass that is made otherwise (aiohttp's connection errors, under gcsfs and adlfs)
        error = OSError(e.errno, msg) if e.errno is not None else OSError(msg)
    error.path = os.fspath(path)
    return error


@contextmanager
def naming_target(action: str, path: str | os.PathLike) -> Iterator[None]:
    """Raise an ``OSError`` from the block as :func:`error_naming_target` names it: a temporary file's name, or
    none, means nothing to the user, who asked for ``path``. Another error keeps its type (a ``TypeError`` of pickle
    is no ``OSError``) and gets a note naming ``path`` and the rank (Python 3.11+), which every rank's
    :class:`RankFailure` repeats; ranksafe's own errors name what they are about already."""
    try:
        yield
    except OSError as e:
        raise error_naming_target(e, action, path) from e
    except Exception as e:
        if not isinstance(e, RankSafeError) and hasattr(e, "add_note"):
            e.add_note(f"{action} {remote.where(path)}")
        raise


class RankSafeError(Exception):
    """Base class of every error ranksafe defines.

    Each one also subclasses what the stock call raises for the same cause, so that ``except`` clauses written
    for stock PyTorch keep working: :class:`CorruptCheckpoint` is a ``RuntimeError`` and a
    ``pickle.UnpicklingError`` (what ``torch.load`` raises on a damaged zip archive, and on bytes that are no
    pickle), :class:`EmptyCheckpoint` an ``EOFError`` as well (an empty file), :class:`UntrustedCheckpoint` a
    ``pickle.UnpicklingError`` (``torch.load(weights_only=True)``), and :class:`RankFailure` a ``RuntimeError``
    (what a rank that waits for a failed one gets from the backend: a timeout or a closed connection), also an
    ``OSError`` when the rank that failed raised one.
    """


class CorruptCheckpoint(RankSafeError, RuntimeError, pickle.UnpicklingError):
    """A checkpoint file exists but cannot be read back: truncated, bit-flipped, or not a checkpoint."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"corrupt checkpoint {self.path}: {reason}")

    def __reduce__(self):  # pickled by worker pools (mp.spawn, DataLoader workers): rebuilt from its arguments
        return (type(self), (self.path, self.reason))


class EmptyCheckpoint(CorruptCheckpoint, EOFError):
    """A checkpoint file with no bytes at all (a writer that died before its first write, without ranksafe's atomic
    commit): also an ``EOFError``, which ``torch.load`` raises for it."""


class UntrustedCheckpoint(RankSafeError, pickle.UnpicklingError):
    """A checkpoint holds pickled objects and was loaded with ``weights_only=True``.

    Loading arbitrary pickles runs code; ranksafe only does it when the caller opts in explicitly.
    """

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(
            f"{self.path} holds objects that weights_only loading refuses ({reason}). If you trust the "
            "file, load it with weights_only=False (or trusted=True in the integrations)."
        )

    def __reduce__(self):
        return (type(self), (self.path, self.reason))


@dataclass(frozen=True)
class Failure:
    """What one rank reports about an exception it raised inside a shared section."""

    rank: int
    type_name: str  # "module.QualName"
    message: str
    path: str | None = None  # the file the error is about, when it says (CorruptCheckpoint.path, OSError.filename)
    errno: int | None = None  # OSError's code, so that `e.errno == errno.ENOSPC` works on every rank
    reason: str | None = None  # CorruptCheckpoint's and UntrustedCheckpoint's, without the path
    committed_step: int | None = None  # a step this rank had committed when it failed after (an fsync, retention)

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> Failure:
        t = type(exc)
        path = getattr(exc, "path", None) or getattr(exc, "filename", None)
        code = getattr(exc, "errno", None)
        reason = getattr(exc, "reason", None) if isinstance(exc, RankSafeError) else None
        committed = getattr(exc, "committed_step", None)
        message = " ".join([str(exc), *(f"({note})" for note in getattr(exc, "__notes__", ()))])
        return cls(
            rank, f"{t.__module__}.{t.__qualname__}", message, None if path is None else str(path),
            code if isinstance(code, int) else None, reason if isinstance(reason, str) else None,
            committed if type(committed) is int else None,
        )  # fmt: skip

    @property
    def short_type(self) -> str:
        return self.type_name.rsplit(".", 1)[-1]

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.short_type}: {self.message}"


class RankFailure(RankSafeError, RuntimeError):
    """Raised on every rank when any rank failed inside a shared section (a save, a load, ``together``).

    ``failures`` lists each failed rank with its exception type and message. On the rank that failed,
    the original exception is chained as ``__cause__``. When all failures have the same built-in or
    ranksafe type (``FileNotFoundError``, ``CorruptCheckpoint``...), the raised object is also an
    instance of that type, so ``except FileNotFoundError`` works on every rank, not only the failing one.
    """

    out_of_step = False
    """Decided where the ranks were not all in one collective (a rank had left a shared block with its failure while
    the others were still inside, or had aborted and not come): every rank left the collective it was in, and a shared
    block around it ends without another exchange (:func:`~ranksafe.collectives.exchange_outcome`). Let it leave the
    block: caught inside it, the block would exchange once more, with ranks that are past it."""

    def __init__(self, what: str, failures: list[Failure]):
        self.what = what
        self.failures = list(failures)
        detail = "; ".join(str(f) for f in self.failures)
        # Exception.__init__, not super(): in a mixed class the next base (OSError, CorruptCheckpoint...)
        # has its own signature
        Exception.__init__(self, f"{what} failed on {self.ranks_text()}: {detail}")

    @property
    def ranks(self) -> list[int]:
        """The failed ranks, in the order the failures are listed (rank order)."""
        return [f.rank for f in self.failures]

    def ranks_text(self) -> str:
        """``rank 3`` or ``ranks 1, 2``: the failed ranks, for messages."""
        r = self.ranks
        return f"rank {r[0]}" if len(r) == 1 else f"ranks {', '.join(map(str, r))}"

    def __str__(self) -> str:  # OSError subclasses format their own str; keep ours
        return self.args[0] if self.args else ""

    def __reduce__(self):
        return (_rebuild_rank_failure, (self.what, self.failures))


class BarrierTimeout(RankFailure):
    """A collective did not complete in time: ``missing`` are the ranks that never arrived."""

    def __init__(self, what: str, missing: list[int], timeout: float):
        self.missing = sorted(missing)
        self.timeout = timeout
        failures = [Failure(r, "ranksafe.BarrierTimeout", f"did not arrive within {timeout:g}s") for r in missing]
        RankSafeError.__init__(
            self,
            f"{what}: timed out after {timeout:g}s waiting for rank(s) {', '.join(map(str, self.missing))}",
        )
        self.what, self.failures = what, failures

    def __reduce__(self):
        return (BarrierTimeout, (self.what, self.missing, self.timeout))


class CollectiveMismatch(RankFailure):
    """Ranks entered different collectives at the same point: their control flow diverged."""

    def __reduce__(self):
        return (CollectiveMismatch, (self.what, self.failures))


def _rebuild_rank_failure(what: str, failures: list[Failure]) -> RankFailure:
    return rank_failure(what, failures)


def _resolve(type_name: str) -> type[BaseException] | None:
    """The exception class named by ``type_name`` if it is a built-in or a ranksafe error, else None."""
    module, _, name = type_name.rpartition(".")
    if module == "builtins":
        t = getattr(builtins, name, None)
    elif module.startswith("ranksafe"):
        t = globals().get(name)
    else:
        return None
    ok = isinstance(t, type) and issubclass(t, Exception) and not issubclass(t, RankFailure)
    return t if ok else None


@cache
def _shared_type(t: type[BaseException]) -> type[RankFailure]:
    """A class that is both a RankFailure and ``t`` (e.g. ``RankFailure[FileNotFoundError]``)."""

    def __init__(self, what: str, failures: list[Failure]):
        RankFailure.__init__(self, what, failures)
        self.path = next((f.path for f in failures if f.path), None)  # as CorruptCheckpoint.path would be
        if isinstance(self, OSError):
            self.errno = next((f.errno for f in failures if f.errno is not None), None)
        if isinstance(self, (CorruptCheckpoint, UntrustedCheckpoint)):
            self.reason = next((f.reason for f in failures if f.reason is not None), None)

    ns = {"__init__": __init__, "__module__": __name__, "__qualname__": f"RankFailure[{t.__name__}]"}
    return type(f"RankFailure[{t.__name__}]", (RankFailure, t), ns)


def rank_failure(what: str, failures: list[Failure]) -> RankFailure:
    """Build the error every rank raises for ``failures``; same object type on every rank."""
    kinds = {f.type_name for f in failures}
    if len(kinds) == 1:
        t = _resolve(kinds.pop())
        if t is not None:
            try:
                return _shared_type(t)(what, failures)
            except TypeError:  # a class whose layout does not mix with RankFailure
                pass
    return RankFailure(what, failures)
