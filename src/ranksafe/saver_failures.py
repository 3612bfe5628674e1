"""How a background write's failure reaches every rank, for one :class:`~ranksafe.async_save.AsyncSaver` or several.

Two ways, both collectives. :func:`poll_savers`, once per training step: while no rank has a failure it reads one
flag in the store and waits for no rank; a rank whose write failed posts the failure in the first saver's
:class:`~ranksafe.notice.StepNotice`, and at the next step every rank raises the same
:class:`~ranksafe.RankFailure`. :func:`check_savers`, at a check point or at close: one exchange that waits for
every rank. Each failure is reported once, by whichever of the two comes first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from . import topology
from .collectives import exchange_outcome
from .errors import BarrierTimeout, CollectiveMismatch, Failure, RankFailure, rank_failure
from .notice import StepNotice
from .saving import paths_apart, refuse_paths_apart, writer_group

if TYPE_CHECKING:
    from .async_save import AsyncSaver


def check_savers(
    savers: Iterable[AsyncSaver], name: str = "async save", point: str = "check", timeout: float | None = None
) -> None:
    """:meth:`~ranksafe.AsyncSaver.check` for several savers at the price of one exchange; collective.

    Raises :class:`~ranksafe.RankFailure` on every rank if a background write of any of them failed on any
    rank. One failure per call is reported (the first saver's); another saver's stays pending for the next.
    ``point`` names where in training the check is (``check``, ``close``): ranks at different points mismatch.
    ``timeout``: how long to wait for the other ranks (None: the default, ``RANKSAFE_TIMEOUT``).
    The same exchange carries the paths each saver was given since the last check: where a rank gave one that its
    writer did not (``save(state, f"model_{rank}.pt")`` with one writer), every rank raises ``ValueError``.
    When the exchange itself fails (a rank missing, ranks elsewhere), the failure and the paths taken for it stay
    pending for the next check; so does the failure when the outcome was decided without it (a rank gone).
    """
    savers = list(savers)
    err, owner = None, None
    for saver in savers:
        err = saver.take_error()
        if err is not None:
            owner = saver
            break
    if owner is not None and owner.carried_by is not None:  # the exchange reports it: no rank acts on the notice
        owner.carried_by.withdraw()
        owner.carried_by = None
    asked = [(writer_group(saver.writer), saver.take_asked()) for saver in savers]
    try:
        apart = exchange_outcome(
            f"outcome:{name}: {point}", asked, err, _apart_per_saver, timeout, what=f"{name}: {point}"
        )
    except RankFailure as e:
        unexchanged = isinstance(e, (BarrierTimeout, CollectiveMismatch))
        # decided without this rank's failure (a rank gone, ranks out of step): reported later, or printed at exit
        if owner is not None and (unexchanged or topology.rank() not in e.ranks):
            owner.restore_error(err)
        if unexchanged or e.out_of_step:  # the paths were not compared: the next check compares them
            for saver, (_, paths) in zip(savers, asked, strict=True):
                saver.restore_asked(paths)
        raise
    for saver, paths in zip(savers, apart, strict=False):  # shorter where a rank passed fewer savers
        refuse_paths_apart(saver.writer, paths, saver.name)


def _apart_per_saver(posts: list[list[tuple]]) -> list[list[str]]:
    """For each saver, the paths a rank was given that its writer was not (:func:`~ranksafe.saving.paths_apart`)."""
    return [paths_apart(list(per_rank)) for per_rank in zip(*posts, strict=False)]


def poll_savers(savers: Sequence[AsyncSaver]) -> None:
    """:meth:`~ranksafe.AsyncSaver.poll` for several savers at the price of one store read; every rank, once per step.

    The first saver's notice carries a failure of any of them: pass the same savers in the same order at every
    step, and do not also poll the first one on its own. One failure is posted at a time; another stays
    pending for the next one (or for :func:`check_savers`).
    """
    if topology.world_size() == 1:  # no rank to keep in step: the failure is raised at once, as it is
        failed = next((saver for saver in savers if saver.failed), None)
        if failed is not None:
            raise failed.take_error()  # type: ignore[misc]
        return
    notice = savers[0].notice
    due = notice.poll()
    if due is not None:
        _raise_notice(savers, notice, due.payload)
    pending = next((saver for saver in savers if saver.failed and saver.carried_by is None), None)
    if pending is not None:
        failure = Failure.from_exception(topology.rank(), pending.error)  # type: ignore[arg-type]
        standing = notice.post((pending.name, failure))
        if standing.payload == (pending.name, failure):  # not another rank's, posted first
            pending.carried_by = notice


def _raise_notice(savers: Sequence[AsyncSaver], notice: StepNotice, payload: tuple[str, Failure]) -> None:
    """Raise the failure a rank posted in ``notice``, on every rank alike; the poster marks it reported."""
    err = None
    for saver in savers:
        if saver.carried_by is notice:
            saver.carried_by = None
            err = saver.take_error()
    if err is not None and topology.world_size() == 1:
        raise err
    name, failure = payload
    raise rank_failure(f"{name}: background write", [failure]) from err
