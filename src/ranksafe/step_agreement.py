"""What every rank agrees on about a root's steps before a load: which steps every writer's copy has committed, and
whether a step verifies. Each is one exchange, and what a writer met there (a root it cannot list, a damaged file)
is raised on every rank, or returned to every rank alike. :func:`loadable` and :func:`first_good` pick, from these
answers, the step a load reads.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .collectives import exchange_outcome
from .commit import Place, name_of, verify_step
from .errors import CorruptCheckpoint, error_naming_target
from .sharded import verify_shares
from .steps import StepDirs, check_step

if TYPE_CHECKING:
    from .retention import KeptSteps


@dataclass(frozen=True)
class Committed:
    """The steps of a root, as the writers listed them."""

    everywhere: list[int]  # committed on every writer's copy, newest first: the same on every rank
    here_only: set[int]  # committed on this rank's writer's copy and missing from another (another writer failed)


def committed_everywhere(dirs: StepDirs, writer: bool, root: str, timeout: float | None = None) -> Committed:
    """The steps committed on every writer's copy of ``dirs``. A writer lists its copy (``writer``); one that cannot (a
    file in the way, an I/O error) fails every rank. Collective."""
    mine, error = None, None
    if writer:
        try:
            mine = dirs.committed()
        except OSError as e:
            error = error_naming_target(e, "cannot list the checkpoints in", root)
    what = f"checkpoint {root}: steps"
    everywhere = exchange_outcome("checkpoint: steps", mine, error, _newest_common, timeout, what=what)
    return Committed(everywhere, set(mine or ()) - set(everywhere))


def _newest_common(listed: list[list[int] | None]) -> list[int]:
    """The steps every writer listed (non-writers list ``None``), newest first."""
    sets = [set(steps) for steps in listed if steps is not None]
    return sorted(set.intersection(*sets), reverse=True) if sets else []


def loadable(committed: list[int], step: int | None, fallback: bool, root: str) -> list[int]:
    """The steps a load may read, in the order it tries them: ``step``, or the newest of ``committed`` (the steps
    committed everywhere, newest first) and, with ``fallback``, every older one. ``FileNotFoundError`` when there is
    none; the same on every rank, as ``committed`` is."""
    if step is not None:
        if check_step(step) not in committed:
            raise FileNotFoundError(f"step {step} is not committed on every node under {root}")
        return [step]
    if not committed:
        raise FileNotFoundError(f"no committed checkpoint under {root}")
    return committed if fallback else committed[:1]


def first_good(
    dirs: StepDirs, candidates: list[int], writer: bool, sharded: bool, timeout: float | None, kept: KeptSteps
) -> int:
    """The first of ``candidates`` whose files every node verified (:func:`verdict`). A corrupt one is skipped with a
    warning while another is left, and passed over in ``kept`` (it holds no lower save back); the last one's error is
    raised on every rank. Collective: one exchange per step tried."""
    for s, older in itertools.pairwise(candidates):
        if (error := verdict(dirs.place(s), s, writer, sharded, timeout)) is None:
            return s
        warnings.warn(f"{error}; falling back to step {older}", RuntimeWarning, stacklevel=3)
        kept.passed_over.add(s)
    last = candidates[-1]
    if (error := verdict(dirs.place(last), last, writer, sharded, timeout)) is not None:
        raise error
    return last


def verdict(
    place: Place, step: int, writer: bool, split: bool = False, timeout: float | None = None
) -> Exception | None:
    """The agreed verdict on step ``step`` at ``place``: None, or the damage every rank is to raise (or fall back on):
    a :class:`CorruptCheckpoint` or ``FileNotFoundError``. The writer checks every file against the manifest; with
    ``split`` (a sharded step) every rank checks its share of the files instead. Any other error (an I/O error,
    remote storage refusing, a rank missing from the exchange, a failure out of step) says nothing about the step: it
    raises. Collective.

    With a writer per node, copies of the step from different saves (the manifests' ``save_id``) must also hold the
    same files. Copies from one save may differ (each node's writer writes its own node's state), but a step saved
    again, whose new copy was committed on some nodes and failed on others, would resume each node from another
    state: it is damaged."""
    exc, copy = None, None
    if split or writer:
        try:
            if split:
                verify_shares(place)
            else:
                copy = _copy_of(verify_step(place))
        except Exception as e:  # whatever the writer met, every rank must hear of it in the exchange below
            exc = e
    try:
        # named after the kind of load: ranks of which some pass into= and some do not meet a CollectiveMismatch
        # here, at once, instead of parting into DCP's collectives and a plain load's
        kind = "sharded, into=" if split else "whole"
        copies = exchange_outcome(
            f"checkpoint {step}: verify, {kind}", copy, exc, _posted, timeout, what=f"verify step {step}"
        )
    except (CorruptCheckpoint, FileNotFoundError) as e:  # RankFailure[...]; in a single process, the writer's own
        if getattr(e, "out_of_step", False):  # a rank's failure in another block: it says nothing about the step
            raise
        return e
    saves, contents = {save for save, _ in copies}, {files for _, files in copies}
    if len(saves) > 1 and len(contents) > 1:
        return CorruptCheckpoint(
            name_of(place),
            f"the nodes' copies of step {step} come from {len(saves)} different saves and hold different files, so "
            "each node would resume from another state (a save of the step again that failed on some nodes, or "
            "copies made apart); save the step again, or fall back to an older one",
        )
    return None


def _copy_of(manifest: dict) -> tuple[str, str]:
    """What tells copies of a step apart: the save that wrote it ("" before saves had ids) and a digest of its files'
    names, sizes and checksums."""
    files = json.dumps(manifest["files"], sort_keys=True).encode()
    return manifest.get("save_id", ""), hashlib.sha256(files).hexdigest()


def _posted(values: list[tuple[str, str] | None]) -> set[tuple[str, str]]:
    """The copies the writers posted (the other ranks post None)."""
    return {v for v in values if v is not None}
