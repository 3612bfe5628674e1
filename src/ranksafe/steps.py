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
from dataclasses import dataclass
from typing import Any

from .choice import Choice
from .commit import (
    MANIFEST,
    AtomicDir,
    Place,
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


def step_pattern(prefix: str) -> re.Pattern[str]:
    """Names of step directories: ``prefix`` and digits, or the hidden temporary of one (``.step_7.ranksafe-partial``).
    Group 1: the hidden dot; group 2: the step; group 3: the temporary's suffix."""
    return re.compile(rf"^(\.)?{re.escape(prefix)}(\d+)({re.escape(AtomicDir.PARTIAL)})?$")


def list_steps(
    root: str | os.PathLike, prefix: str = "step_", deep: bool = False, storage_options: dict[str, Any] | None = None
) -> list[StepInfo]:
    """Every step directory under ``root``, oldest first, as committed, incomplete or corrupt. No collectives.

    A step that disappears while it is being looked at (retention, a commit renaming it) is left out. ``root``
    may be a URL of remote storage.
    """
    base = resolve(root, storage_options)
    pattern = step_pattern(prefix)
    out = []
    for name in names(base):
        m = pattern.match(name)
        if not m or bool(m.group(1)) != bool(m.group(3)):
            continue
        with contextlib.suppress(FileNotFoundError):
            out.append(_step_info(join(base, name), int(m.group(2)), bool(m.group(3)), deep))
    return sorted(out, key=lambda s: (s.step, s.status is not StepStatus.COMMITTED))


def _step_info(place: Place, step: int, partial: bool, deep: bool) -> StepInfo:
    size = sum(size_of(join(place, rel)) for rel in step_files(place))
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


class StepDirs:
    """The step directories of one prefix under ``base``: ``base/{prefix}{step:08d}``.

    :meth:`place` and :meth:`step_of` make no file-system call; :meth:`committed` and :meth:`clean_debris` do, and
    run on writers only.
    """

    def __init__(self, base: Place, prefix: str):
        check_name(prefix + "0", "step prefix")
        self.base, self.prefix = base, prefix
        self._pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")
        # the debris of these steps only: another manager's prefix may extend this one (step_, step_best_)
        ends = "|".join(map(re.escape, (AtomicDir.PARTIAL, AtomicDir.OLD)))
        self._debris = re.compile(rf"^\.({re.escape(prefix)}\d+)(?:{ends})$")

    def place(self, step: int) -> Place:
        """Where ``step``'s committed directory is (or will be)."""
        return join(self.base, f"{self.prefix}{check_step(step):08d}")

    def step_of(self, place: str) -> int | None:
        """The step whose directory ``place`` (a canonical path or URL) is; None for any other place."""
        found = self._pattern.match(os.path.basename(place))
        if found is not None and name_of(self.place(int(found[1]))) == place:
            return int(found[1])
        return None

    def committed(self) -> list[int]:
        """Steps committed under ``base``, oldest first, with any committed step a crash left aside put back first
        (:meth:`AtomicDir.recover`)."""
        listed = self._names()
        recovered = False
        for m in filter(None, map(self._debris.match, listed)):
            recovered |= step_commit(join(self.base, m.group(1))).recover()
        if recovered:
            listed = self._names()
        steps = (int(m.group(1)) for m in map(self._pattern.match, listed) if m)
        return sorted(s for s in steps if self._has_manifest(s))

    def clean_debris(self) -> None:
        """Remove what crashed saves and deletions of these steps left, once a committed step among it is put back
        (:meth:`AtomicDir.recover`). On remote storage that is every step without its manifest."""
        listed = self._names()
        if isinstance(self.base, Remote):
            for m in filter(None, map(self._pattern.match, listed)):
                if not self._has_manifest(int(m.group(1))):
                    self.place(int(m.group(1))).remove()
            return
        for name in listed:
            m = self._debris.match(name)
            if m is None:
                continue
            AtomicDir(os.path.join(self.base, m.group(1))).recover()
            path = os.path.join(self.base, name)
            if os.path.lexists(path):  # not the copy recover() just put back
                shutil.rmtree(path, ignore_errors=True)

    def _names(self) -> list[str]:
        """What ``base`` holds; nothing when it does not exist yet (a base that cannot be listed raises)."""
        if isinstance(self.base, Remote):
            return names(self.base)
        try:
            return os.listdir(self.base)
        except FileNotFoundError:
            return []

    def _has_manifest(self, step: int) -> bool:
        return _exists(join(self.place(step), MANIFEST))
