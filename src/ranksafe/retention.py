"""Which committed steps a :class:`~ranksafe.CheckpointManager` keeps: the newest few, every ``keep_period``-th,
and the best few by a metric. The writer applies it after each commit, never before: a step is deleted only once a
newer one is committed, and never the newest, one being loaded, or one a rule keeps. :class:`StepMetrics` holds the
values that rank the steps for ``best_metric``; :class:`KeptSteps`, what else a writer knows of its steps (which
count, which are being read), and applies the rules.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from . import remote
from .choice import Choice
from .commit import name_of, read_manifest, step_commit
from .errors import CorruptCheckpoint
from .options import positive_int
from .steps import StepDirs


class BestMode(Choice):
    """Which end of ``best_metric`` is best: the lowest (``min``, a loss) or the highest (``max``, an accuracy)."""

    MIN = "min"
    MAX = "max"


@dataclass(frozen=True)
class Retention:
    """The rules; :meth:`doomed` applies them.

    * ``keep``: the newest this many committed steps stay (``None``: every step stays, whatever the other rules);
    * ``keep_period``: steps divisible by it stay (a step every 1,000, say, for later evaluation);
    * ``best_metric``, ``best_mode``, ``keep_best``: the ``keep_best`` steps whose metric (given to ``save`` as
      ``metrics={best_metric: value}``) is lowest (``"min"``) or highest (``"max"``) stay. A step without the
      metric, or with NaN, is never among the best.
    """

    keep: int | None = 3
    keep_period: int | None = None
    best_metric: str | None = None
    best_mode: BestMode | str = BestMode.MIN
    keep_best: int = 0

    def __post_init__(self) -> None:
        positive_int("keep", self.keep)
        positive_int("keep_period", self.keep_period)
        if isinstance(self.keep_best, bool) or not isinstance(self.keep_best, int) or self.keep_best < 0:
            raise ValueError(f"keep_best must be a non-negative int, not {self.keep_best!r}")
        object.__setattr__(self, "best_mode", BestMode(self.best_mode))  # frozen: set once, here
        if self.keep_best and not self.best_metric:
            raise ValueError("keep_best needs best_metric: the name of the metric that ranks the steps")

    def doomed(
        self, committed: list[int], newest: int, protected: Iterable[int], metric: Callable[[int], float | None]
    ) -> list[int]:
        """The committed steps (oldest first) to delete now that ``newest`` is committed; ``protected`` ones (being
        loaded) stay. ``metric(step)`` is the step's value of ``best_metric``, or None."""
        if self.keep is None:
            return []
        kept = {newest, *protected, *committed[-self.keep :]}
        if self.keep_period:
            kept.update(s for s in committed if s % self.keep_period == 0)
        if self.keep_best:
            kept.update(self.best(committed, metric))
        return [s for s in committed if s not in kept]

    def best(self, steps: Iterable[int], metric: Callable[[int], float | None]) -> list[int]:
        """The ``keep_best`` best of ``steps`` by ``metric``, best first (a tie: the newer first)."""
        scored = []
        for s in steps:
            value = metric(s)
            if value is not None and not math.isnan(value):
                scored.append((value if self.best_mode is BestMode.MIN else -value, -s))
        return [-s for _, s in sorted(scored)[: self.keep_best]]


class StepMetrics:
    """The metrics of committed steps, as their manifests record them: what ranks the steps for ``best_metric``.

    The writer records a step's metrics when it commits it; a step committed by an earlier run is read from its
    manifest once, at ``manifest_of(step)``'s place. A step whose manifest is missing or corrupt has none: it is
    never among the best. Any other error reading it (an I/O error, remote storage refusing for a while) is raised
    and remembers nothing: no step is ranked on a metric that could not be read. No collectives.
    """

    def __init__(self, manifest_of: Callable[[int], Any]) -> None:
        self._manifest_of = manifest_of
        self._by_step: dict[int, dict[str, Any]] = {}

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """``step`` is committed with ``metrics``."""
        self._by_step[step] = dict(metrics)

    def forget(self, step: int) -> None:
        """``step`` is deleted."""
        self._by_step.pop(step, None)

    def value(self, step: int, name: str | None) -> float | None:
        """``step``'s value of metric ``name``, or None (no such metric, not a number, a missing or corrupt
        manifest); ``OSError`` when the manifest could not be read now."""
        if step not in self._by_step:
            try:
                metrics = read_manifest(self._manifest_of(step)).get("metrics")
            except (FileNotFoundError, CorruptCheckpoint):
                metrics = None
            self._by_step[step] = metrics if isinstance(metrics, dict) else {}
        value = self._by_step[step].get(name)  # type: ignore[arg-type]
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class KeptSteps:
    """What a rank knows of its root's committed steps besides their directories (:class:`~ranksafe.steps.StepDirs`),
    and the deletions :class:`Retention` makes after each commit (writers only). No collectives.

    * :attr:`passed_over`: steps that hold no lower save back and are not ranked for retention: a load fell back over
      them, or they are committed on this writer's node and missing on another (a commit that failed there). With a
      ``keep``, those below the newest step are deleted, as no load will take them.
    * steps being read (:meth:`reading`): never deleted meanwhile.
    * their metrics (:class:`StepMetrics`), recorded at each commit (:meth:`record_commit`).
    """

    def __init__(self, dirs: StepDirs, rules: Retention) -> None:
        self.dirs, self.rules = dirs, rules
        self.passed_over: set[int] = set()
        self._reading: set[int] = set()
        self._metrics = StepMetrics(dirs.place)

    @contextlib.contextmanager
    def reading(self, steps: Iterable[int]) -> Iterator[None]:
        """Retention deletes none of ``steps`` inside the block (a load reads them)."""
        steps = set(steps) - self._reading
        self._reading |= steps
        try:
            yield
        finally:
            self._reading -= steps

    def record_commit(self, step: int, metrics: dict[str, float]) -> None:
        """``step`` is committed, whole, with ``metrics``: it holds lower saves back again, and ranks by them."""
        self._metrics.record(step, metrics)
        self.passed_over.discard(step)

    def retain(self, newest: int, confirmed: bool) -> None:
        """Delete what the rules no longer keep, now that ``newest`` is committed. When a step's metric cannot be read
        now, nothing is deleted until a later save can rank the steps: deleting on a guess could take the best step.

        ``confirmed``: ``newest`` is known to be committed wherever it is read (one writer). With a writer per node,
        another node's commit of it may still fail: it is kept without being ranked until the next save, so that
        the steps every node holds are never fewer than ``keep`` (a load falls back to the older ones)."""
        metric = functools.partial(self._metrics.value, name=self.rules.best_metric)
        committed = self.dirs.committed()
        ranked = [s for s in committed if s not in self.passed_over and (confirmed or s != newest)]
        try:
            doomed = self.rules.doomed(ranked, newest, self._reading, metric)
        except OSError as e:
            root = remote.where(name_of(self.dirs.base))
            warnings.warn(f"{root}: retention waits for a later save: {e}", stacklevel=2)
            return
        if self.rules.keep is not None:
            doomed += [s for s in committed if s in self.passed_over and s < newest and s not in self._reading]
        for step in doomed:
            try:
                step_commit(self.dirs.place(step)).delete()  # no longer committed before its files go
            except OSError as e:  # raised on every rank: say that the step being saved is safe
                e.add_note(f"step {newest} is committed; retention could not delete step {step} after it")
                raise
            self._metrics.forget(step)
            self.passed_over.discard(step)
