"""Which committed steps a :class:`~ranksafe.CheckpointManager` keeps: the newest few, every ``keep_period``-th,
and the best few by a metric. The writer applies it after each commit, never before: a step is deleted only once a
newer one is committed, and never the newest, one being loaded, or one a rule keeps. :class:`StepMetrics` holds the
values that rank the steps for ``best_metric``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .choice import Choice
from .commit import read_manifest
from .errors import CorruptCheckpoint
from .options import positive_int


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
