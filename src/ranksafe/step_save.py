"""One save of one step, as each rank runs it around the block in which the ranks write their files.

:meth:`CheckpointManager.saving <ranksafe.CheckpointManager.saving>` runs, in order:

1. :func:`open_step`, the first exchange: every rank checks its inputs while the writer(s) create the step's
   temporary place;
2. the block: every rank may write files into it (:class:`~ranksafe.commit.StepWriter`);
3. :func:`agree_written`, the second exchange: every rank says what it wrote, or how it failed; the writer(s)
   learn every file of their directory for the manifest;
4. :func:`commit_step`, the writer's alone: its files, the manifest, the commit, then retention. A synchronous save
   runs it inside a third exchange (:func:`commit_together`), which gives every rank its outcome (three exchanges in
   all, whatever the world size); with ``async_save`` the background saver runs it, and the next check (or save)
   raises a failure on every rank.

A failure anywhere before the commit aborts the step on every rank: no writer commits it.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from . import topology
from .collectives import exchange_outcome, together
from .commit import DirCommit, StepWriter, build_manifest, check_file_name, name_of
from .errors import BarrierTimeout, CollectiveMismatch, RankFailure, naming_target
from .remote import Remote
from .retention import KeptSteps
from .saving import paths_apart
from .sharded import dcp_files, refuse_sharded, require_shared
from .storage import Placement

if TYPE_CHECKING:
    from .async_save import AsyncSaver
    from .shards import StepShards

STATE = "state.pt"  # a step's whole state, written by the writer(s)


def open_step(
    commit: DirCommit,
    step: int,
    kept: KeptSteps,
    where: Placement,
    writer_files: Mapping[str, Any],
    metrics: Mapping | None,
    sharded: bool,
    timeout: float | None,
) -> dict[str, float]:
    """The first exchange: every rank checks its inputs while the writer(s) create the step's temporary place; a
    failure anywhere raises on every rank. Returns the metrics as floats.

    Its name says whether this rank's state holds DTensors: ranks that disagree (a DTensor on some ranks only)
    would go on to different protocols and wait for each other; they raise CollectiveMismatch here instead."""
    root = name_of(kept.dirs.base)
    state_kind = "a state with DTensors" if sharded else "no DTensors"
    created = False
    try:
        # each rank's root travels along: a rank whose writer writes under another root would never find its steps
        with together(
            f"checkpoint {step}: create, {state_kind}", timeout, f"checkpoint {step}: create",
            value=(where.group, (root,)), reduce=paths_apart,
        ) as outcome:  # fmt: skip
            if sharded:
                require_shared(where, root)  # the placement is agreed: every rank with DTensors raises alike
            for name in writer_files:  # every rank: the names may differ where only the writers' count
                check_file_name(name)
            refuse_sharded(writer_files, f"checkpoint {step}")  # every rank: the writers write theirs whole
            floats = {k: float(v) for k, v in (metrics or {}).items()}  # a bad value on any rank fails every rank
            if where.writer:
                _create(commit, step, kept)
                created = True
    except BaseException:
        if created:  # another rank failed: no save will use the temporary place (and `ls` would list it)
            commit.abort()
        raise
    if apart := outcome.result:
        if created:
            commit.abort()
        raise ValueError(f"checkpoint {step}: the ranks sharing a writer have different roots ({'; '.join(apart)})")
    return floats


def _create(commit: DirCommit, step: int, kept: KeptSteps) -> None:
    """The writer's part of the first exchange: clear what crashed saves left, refuse a step the root's newest step
    would shadow, or one whose committed copy a failed save would lose, then create the temporary place."""
    root = name_of(kept.dirs.base)
    with naming_target(f"cannot save step {step} under", root):  # a file where the root must go, a missing permission
        left = kept.dirs.clean_debris()
    if (newest := kept.dirs.newest(left - kept.passed_over)) is not None and step < newest:
        raise ValueError(
            f"checkpoint {step}: {root} holds step {newest} already: latest() and a resume would take step {newest}, "
            f"and retention would delete step {step} first. Save a new run under a new root, or remove the newer steps"
        )
    if step == newest and isinstance(kept.dirs.base, Remote):  # no rename: it would go before the new one
        raise ValueError(
            f"checkpoint {step}: step {step} is committed under {root} already, and remote storage cannot replace it "
            "in one move: a failed save would lose it. Save it under a new step number"
        )
    with naming_target(f"cannot save step {step} under", root):
        commit.create()


def agree_written(
    tx: StepWriter,
    commit: DirCommit,
    where: Placement,
    part: StepShards | None,
    metrics: dict[str, float],
    writer_files: Mapping[str, Any],
    exc: BaseException | None,
    timeout: float | None,
) -> None:
    """The second exchange: every rank says what it wrote (or how it failed); the writer(s) learn every file of their
    group for the manifest, and every rank rank 0's metrics and a token naming this save (every node's copy of the
    step records it). A failure anywhere, or two ranks that wrote one file of one directory, aborts the step on every
    rank."""
    step = tx.step
    try:
        posted = exchange_outcome(
            f"checkpoint {step}: written",
            (where.group, tx.entries, tuple(writer_files), metrics, secrets.token_hex(8)), exc, list, timeout,
            what=f"checkpoint {step}: write",
        )  # fmt: skip
        if clashes := _clashes([post[:3] for post in posted]):
            raise ValueError(
                f"checkpoint {step}: {'; '.join(clashes)}: one would replace the other in the step directory; "
                "give each rank's side files a name of their own (f'rng_{rank}.pt')"
            )
        every_name = {name for _, entries, names, *_ in posted for name in (*entries, *names)}
        if part is not None and (taken := dcp_files(every_name)):  # sharded: DCP writes its own after the block
            raise ValueError(
                f"checkpoint {step}: {', '.join(taken)}: torch.distributed.checkpoint writes files of these names "
                "in a step of sharded state, and would replace them; name them otherwise"
            )
        if part is not None and STATE in every_name:
            raise ValueError(
                f"checkpoint {step}: a file named {STATE} beside sharded state: a load without into= would take "
                "it for the state; name it otherwise"
            )
    except BaseException:
        if part is not None:
            part.given_up()
        if where.writer:
            commit.abort()
        raise
    for group, entries, *_ in posted:
        if group == where.group:
            tx.entries.update(entries)
    tx.metrics, tx.save_id = posted[0][3:]  # rank 0's, on every node
    tx.copies = len({group for group, *_ in posted})


def _clashes(posted: list[tuple[frozenset[int] | None, dict[str, Any], tuple[str, ...]]]) -> list[str]:
    """The files of one step directory that two ranks wrote, or that a rank wrote under a name the writers write
    after the block, described; ``posted``: each rank's group (the nodes sharing its directory), files, and the
    names of the writer files it passed (any rank's count, so that every rank finds the same clashes)."""
    writer_files = {name for _, _, names in posted for name in names}
    wrote: dict[tuple[frozenset[int] | None, str], list[int]] = {}
    clashes = []
    for rank, (group, entries, _) in enumerate(posted):
        for name in entries:
            if name in writer_files:
                clashes.append(f"rank {rank} wrote {name}, which the writer writes")
            wrote.setdefault((group, name), []).append(rank)
    both = [f"ranks {', '.join(map(str, ranks))} wrote {name}" for (_, name), ranks in wrote.items() if len(ranks) > 1]
    return clashes + both


def commit_step(commit: DirCommit, tx: StepWriter, writer_files: Mapping[str, Any], kept: KeptSteps) -> str:
    """The writer's part, no collectives: write ``writer_files``, commit the step, then apply retention (only once the
    step is committed); return its directory. Everything a background saver runs for a step, once the directory is
    open and every rank's files are in.

    A failure after the commit is marked with ``committed_step`` (see :class:`~ranksafe.errors.Failure`): the other
    writers need not pass the step over."""
    try:
        for name, obj in writer_files.items():
            tx.save(obj, name)
        with naming_target(f"cannot commit step {tx.step}:", name_of(commit.final)):
            try:
                commit.finalize(build_manifest(commit.tmp, tx.step, tx.entries, tx.metrics, tx.save_id))
            finally:  # in, also when what follows the commit inside finalize() failed (the fsync after it)
                tx.committed = commit.committed
            kept.record_commit(tx.step, tx.metrics)
        kept.retain(newest=tx.step, confirmed=tx.copies == 1)
    except BaseException as e:
        if tx.committed:
            e.committed_step = tx.step  # type: ignore[attr-defined]
        else:
            commit.abort()
        raise
    return name_of(commit.final)


def commit_together(
    commit: DirCommit,
    tx: StepWriter,
    writer: bool,
    writer_files: Mapping[str, Any],
    kept: KeptSteps,
    timeout: float | None,
) -> None:
    """The third exchange of a synchronous save: the writer(s) commit (:func:`commit_step`), and every rank leaves with
    the outcome. A failure elsewhere after this writer committed may leave the step on some nodes only: it is passed
    over in ``kept``."""
    try:
        with together(f"checkpoint {tx.step}: commit", timeout):
            if writer:
                commit_step(commit, tx, writer_files, kept)
    except BaseException as e:
        if tx.committed and tx.copies > 1 and copy_may_be_missing(e, tx.step):  # other nodes may lack it
            kept.passed_over.add(tx.step)
        raise


def copy_may_be_missing(e: BaseException, step: int) -> bool:
    """Whether a failure around the commit of ``step`` leaves another writer's copy of it in doubt: another rank
    failed (or never came), and not after committing ``step`` (a retention that failed after the commit)."""
    failures = getattr(e, "failures", None)
    if failures is None:  # no rank named: assume the worst
        return True
    return any(f.rank != topology.rank() and f.committed_step != step for f in failures)


@contextlib.contextmanager
def passing_over_a_partial_commit(handed: StepWriter | None, kept: KeptSteps, saver: AsyncSaver) -> Iterator[None]:
    """Around a report of background failures: with a writer per node, one may be another writer's copy of the step
    ``handed``, the last one this writer handed to its background saver. Once this writer's copy is committed, that
    step is passed over in ``kept``, as after a synchronous commit that failed elsewhere. Not for a timeout, a mismatch
    or a failure out of step, which say nothing about a commit, nor for this rank's own failure alone, nor for another
    writer's that came after its copy was committed (its retention failed)."""
    try:
        yield
    except RankFailure as e:
        about_a_commit = not (isinstance(e, (BarrierTimeout, CollectiveMismatch)) or e.out_of_step)
        if handed is not None and handed.copies > 1 and about_a_commit and copy_may_be_missing(e, handed.step):
            saver.wait()  # its commit may still be running
            if handed.committed:
                kept.passed_over.add(handed.step)
        raise
