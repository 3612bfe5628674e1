"""What one exchange can end with (:mod:`ranksafe.exchange`): one typed outcome, the same on every rank.

Rank 0 proposes an :data:`Outcome` once every rank has posted; a rank that gives up waiting proposes its own
verdict instead. Whoever writes first decides for all (``compare_set`` on an absent key), and every rank then
*settles* it: returns the agreed value, or raises the same error. The states and transitions of this failure path
are one table in ``docs/design.md``, each row with the test that proves it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .errors import BarrierTimeout, CollectiveMismatch, Failure, rank_failure


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
    """Ranks failed: aborted ranks the exchange waited for in vain, or rank 0's reduction of the values.

    ``out_of_step``: the ranks were not all in this collective: they had posted to different ones, and a rank's fresh
    failure explains why (it left a shared block, or caught its error and went on, while the others were still in
    the block's collectives); or the exchange gave up on aborted ranks that had not posted (one that comes late reads
    this outcome). The exchange ends the collective every rank was in: shared blocks around it end without an
    exchange of their own (:attr:`~ranksafe.RankFailure.out_of_step`), so that every rank is in step after it."""

    failures: tuple[Failure, ...]
    out_of_step: bool = False
    # out of step: the collectives that the ranks which had not failed were in. A failed rank that went on to
    # another one never entered theirs (exchange._skipped)
    collectives: tuple[str, ...] = ()

    def settle(self, what: str, timeout: float) -> Any:
        """Raise the same :class:`RankFailure` (of the failures' type, when they share one) on every rank."""
        error = rank_failure(what, list(self.failures))
        error.out_of_step = self.out_of_step
        raise error


Outcome = Agreed | TimedOut | Diverged | Failed


class Wait(enum.Enum):
    """How a wait for keys in the store ended (``exchange._wait_for``)."""

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
