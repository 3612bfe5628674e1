"""The step directories under one root: their names, which of them are committed, and what crashed saves left.

A step's names derive from its number with no file-system call (``root/step_00000010``, and its temporary
``root/.step_00000010.ranksafe-partial``). :func:`list_steps` reads a root without collectives (for ``ranksafe ls``,
and for humans); :class:`StepDirs` is what a :class:`~ranksafe.CheckpointManager`'s writers list, recover and
clean. :mod:`ranksafe.commit` holds how one step directory is committed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from .choice import Choice
from .commit import (
    MANIFEST,
    AtomicDir,
    Place,
    being_written,
    check_name,
    join,
    name_of,
    names,
    resolve,
    size_of,
    step_commit,
    step_files,
    verify_step,
)
from .errors import CorruptCheckpoint
from .files import TMP_SUFFIX
from .remote import Remote


class StepStatus(Choice):
    """A step directory as :func:`list_steps` finds it: ``committed`` (its manifest verifies), ``incomplete`` (no
    manifest: a save in progress, or a crashed one) or ``corrupt`` (a file differs from the manifest)."""

    COMMITTED = "committed"
    INCOMPLETE = "incomplete"
    CORRUPT = "corrupt"


@dataclass(frozen=True)
class StepInfo:
    """One step directory as :func:`list_steps` sees it."""

    step: int
    path: str
    status: StepStatus
    size: int  # bytes of the files found
    time: float  # commit time from the manifest, else the directory's modification time
    error: str | None = None


def list_steps(
    root: str | os.PathLike, prefix: str = "step_", deep: bool = False, storage_options: dict[str, Any] | None = None
) -> list[StepInfo]:
    """Every step directory under ``root``, oldest first, as committed, incomplete or corrupt. No collectives.

    A step that disappears while it is being looked at (retention, a commit renaming it) is left out, as is any
    name a manager with this ``prefix`` would not make (:meth:`StepDirs.parse`). ``root`` may be a URL of remote
    storage; a local file in its place raises ``NotADirectoryError``.
    """
    base = resolve(root, storage_options)
    if isinstance(base, Remote):  # each step's one listing answers for its files, not a request per file
        base = base.listed_afresh()
    dirs = StepDirs(base, prefix)
    listed = [(name, parsed) for name in names(dirs.base) if (parsed := dirs.parse(name)) is not None]
    placed = {parsed.step for _, parsed in listed if not parsed.suffix}
    out = []
    for name, parsed in listed:
        # a committed step set aside while it is saved again: not one more step, unless it is the only committed copy
        # (a crash between the two renames; the manager puts it back)
        if parsed.suffix == AtomicDir.OLD and parsed.step in placed:
            continue
        with contextlib.suppress(FileNotFoundError):
            out.append(_step_info(join(dirs.base, name), parsed.step, parsed.suffix == AtomicDir.PARTIAL, deep))
    return sorted(out, key=lambda s: (s.step, s.status is not StepStatus.COMMITTED))


def _step_info(place: Place, step: int, partial: bool, deep: bool) -> StepInfo:
    # a save's temporaries are left out: renamed between the listing and their size, they would hide the step
    size = sum(size_of(join(place, rel)) for rel in step_files(place) if not rel.endswith(TMP_SUFFIX))
    status = StepStatus.COMMITTED
    error, when = None, _mtime(place)
    if partial or not _exists(join(place, MANIFEST)):
        status = StepStatus.INCOMPLETE  # a save in progress, a crashed one, or a directory that never committed
    else:
        try:
            written = verify_step(place, deep=deep).get("time")
            when = written if isinstance(written, (int, float)) else when
        except CorruptCheckpoint as e:
            status, error = StepStatus.CORRUPT, str(e)
    return StepInfo(step, name_of(place), status, size, when, error)


def _exists(place: Place) -> bool:
    return place.exists() if isinstance(place, Remote) else os.path.isfile(place)


def _mtime(place: Place) -> float:
    if isinstance(place, Remote):
        return 0.0  # a prefix has no time of its own: the manifest's is used once there is one
    return os.stat(place).st_mtime


def check_step(step: Any) -> int:
    """``step``, when it is a non-negative int (ValueError otherwise)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, not {step!r}")
    return step


class StepName(NamedTuple):
    """A name under a root that belongs to a step: its directory (``suffix`` ""), or the hidden temporary
    (``AtomicDir.PARTIAL``) or set-aside copy (``AtomicDir.OLD``) of one."""

    step: int
    suffix: str  # "" for the step's directory itself


class StepDirs:
    """The step directories of one prefix under ``base``: ``base/{prefix}{step:08d}``.

    :meth:`place`, :meth:`step_of` and :meth:`parse` make no file-system call; :meth:`committed`,
    :meth:`clean_debris` and :meth:`newest` do, and run on writers only.
    """

    def __init__(self, base: Place, prefix: str):
        check_name(prefix + "0", "step prefix")
        if prefix[-1:].isdigit():  # "ckpt1" + "00000007" is also "ckpt" + "100000007": a manager of "ckpt" took it
            raise ValueError(
                f"step prefix {prefix!r} ends with a digit: its steps' names would read as steps of another prefix "
                f"({prefix[:-1]!r}), which would load or delete them; end it with another character ({prefix + '_'!r})"
            )
        self.base, self.prefix = base, prefix
        suffixes = "|".join(map(re.escape, (AtomicDir.PARTIAL, AtomicDir.OLD)))
        self._name = re.compile(rf"^(\.)?{re.escape(prefix)}(\d+)({suffixes})?$")

    def place(self, step: int) -> Place:
        """Where ``step``'s committed directory is (or will be)."""
        return join(self.base, f"{self.prefix}{check_step(step):08d}")

    def parse(self, name: str) -> StepName | None:
        """What ``name`` is among the names these steps' directories take; None for any other name, such as those of
        a manager whose prefix extends this one with a non-digit (``step_`` and ``step_best_``)."""
        found = self._name.match(name)
        if found is None or bool(found[1]) != bool(found[3]) or found[2] != f"{int(found[2]):08d}":
            return None  # hidden exactly when it has a suffix, and numbered as place() numbers
        return StepName(int(found[2]), found[3] or "")

    def step_of(self, place: str) -> int | None:
        """The step whose directory ``place`` (a canonical path or URL) is; None for any other place."""
        parsed = self.parse(os.path.basename(place))
        if parsed is not None and not parsed.suffix and name_of(self.place(parsed.step)) == place:
            return parsed.step
        return None

    def committed(self) -> list[int]:
        """Steps committed under ``base``, oldest first, with any committed step a crash left aside put back first
        (:meth:`AtomicDir.recover`)."""
        listed = self._parsed()
        recovered = [step_commit(self.place(p.step)).recover() for p in listed if p.suffix]
        if any(recovered):
            listed = self._parsed()
        return sorted(p.step for p in listed if not p.suffix and self._has_manifest(p.step))

    def newest(self, steps: Iterable[int]) -> int | None:
        """The highest of ``steps`` committed under ``base``, reading as few manifests as it can. ``steps``: what
        :meth:`clean_debris` returned, so that a save lists ``base`` once (on remote storage, one request less)."""
        return next((step for step in sorted(steps, reverse=True) if self._has_manifest(step)), None)

    def clean_debris(self) -> set[int]:
        """Remove what crashed saves and deletions of these steps left, once a committed step among it is put back
        (:meth:`AtomicDir.recover`). On remote storage that is every step without its manifest. A place that a save
        of this process is writing is no debris: another manager of the same root may be committing it. Returns the
        steps the listing named, less those removed whole: the places where a committed step may be now."""
        if isinstance(self.base, Remote):
            steps = {p.step for p in self._parsed() if not p.suffix}
            uncommitted = {s for s in steps if not self._has_manifest(s) and not being_written(self.place(s))}
            for step in uncommitted:
                self.place(step).remove()
            return steps - uncommitted
        steps = set()
        for name in names(self.base):
            parsed = self.parse(name)
            if parsed is None:
                continue
            steps.add(parsed.step)  # debris too: recover() may put the step's committed directory back
            if parsed.suffix and not being_written(debris := os.path.join(self.base, name)):
                AtomicDir(self.place(parsed.step)).recover()
                if os.path.lexists(debris):  # not the copy recover() just put back
                    shutil.rmtree(debris, ignore_errors=True)
        return steps

    def _parsed(self) -> list[StepName]:
        """The names of these steps in ``base`` (one not made yet holds none; a local file in its place raises)."""
        return [p for p in map(self.parse, names(self.base)) if p is not None]

    def _has_manifest(self, step: int) -> bool:
        return _exists(join(self.place(step), MANIFEST))
