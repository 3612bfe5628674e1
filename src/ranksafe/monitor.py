"""One monitored value for every rank, so that checkpoint and stopping decisions agree.

A metric logged without synchronisation (Lightning's ``self.log`` without ``sync_dist=True``, a metric each rank
computes on its own shard of the data) holds each rank's own value. A checkpoint callback then formats a different
file name on each rank (only rank 0's file exists), keeps a different top-k, and early-stopping counters drift apart.
:class:`MonitorAgreement` gathers the value from every rank when a monitoring callback reads it, warns once per
metric when the values differ, and gives every rank the same value: by default their mean, which is what a
synchronised log would have held.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from . import topology
from .choice import Choice
from .collectives import all_gather


class MonitorOp(Choice):
    """The value every rank gets: the ranks' ``mean`` (what ``sync_dist=True`` logs), rank 0's (``main``), the
    ``max`` or the ``min``."""

    MEAN = "mean"
    MAIN = "main"
    MAX = "max"
    MIN = "min"


class UnsyncedMetricWarning(UserWarning):
    """A monitored metric differs across ranks (logged without ``sync_dist=True``)."""


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean()) if value.numel() else None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _same(values: list[float]) -> bool:
    first = values[0]
    return all(v == first or (math.isnan(v) and math.isnan(first)) for v in values)


def _reduce(values: list[float], op: MonitorOp) -> float:
    if op is MonitorOp.MAIN:
        return values[0]
    if any(math.isnan(v) for v in values):
        return math.nan
    if op is MonitorOp.MEAN:
        return sum(values) / len(values)
    return max(values) if op is MonitorOp.MAX else min(values)


class MonitorAgreement:
    """Agrees monitored values across ranks; one small collective per read, warns once per metric name."""

    def __init__(self, op: MonitorOp | str = MonitorOp.MEAN):
        self.op = MonitorOp(op)
        self._warned: set[str] = set()

    def agree(self, name: str, value: Any, timeout: float | None = None) -> Any:
        """Every rank's ``value`` of metric ``name`` reduced to one; the input's type, dtype and device kept.

        ``value`` may be None on ranks that did not log the metric: they receive the agreed value of the
        others (and a warning), instead of skipping a collective the others enter. ``timeout``: how long to wait for
        the other ranks (None: the default, ``RANKSAFE_TIMEOUT``).
        """
        mine = _number(value)
        gathered = all_gather(mine, name=f"monitor {name}", timeout=timeout)
        present = [v for v in gathered if v is not None]
        if not present:
            return value
        if self.op is MonitorOp.MAIN and gathered[0] is None:
            raise ValueError(f"monitored metric {name!r} was not logged on rank 0; it cannot be agreed with op='main'")
        missing = len(present) < len(gathered)
        if (missing or not _same(present)) and name not in self._warned:
            self._warned.add(name)
            if topology.is_main():
                detail = "was not logged on every rank" if missing else f"differs across ranks ({_show(gathered)})"
                warnings.warn(
                    f"monitored metric {name!r} {detail}: log it with self.log(..., sync_dist=True). "
                    f"ranksafe gives every rank the {self.op} value so that checkpoint and stopping decisions agree.",
                    UnsyncedMetricWarning,
                    stacklevel=2,
                )
        agreed = _reduce(gathered if self.op is MonitorOp.MAIN else present, self.op)
        if isinstance(value, torch.Tensor):
            return torch.tensor(agreed, dtype=value.dtype, device=value.device)
        return torch.tensor(agreed) if value is None else type(value)(agreed)


def _show(values: list[float | None]) -> str:
    return ", ".join(f"rank {r}: {'missing' if v is None else f'{v:.6g}'}" for r, v in enumerate(values))
