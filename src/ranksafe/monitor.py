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
from collections.abc import Iterable, Mapping
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


def _scalar(value: Any) -> float | None:
    """``value`` as a number where it is one (a bool is not), or a tensor of one element; else None."""
    if isinstance(value, torch.Tensor):
        return _number(value) if value.numel() == 1 else None
    return None if isinstance(value, bool) else _number(value)


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
        gathered = all_gather(_number(value), name=f"monitor {name}", timeout=timeout)
        if self.op is MonitorOp.MAIN and gathered[0] is None and any(v is not None for v in gathered):
            raise ValueError(f"monitored metric {name!r} was not logged on rank 0; it cannot be agreed with op='main'")
        return self._settle(name, gathered, value)

    def agree_all(
        self, values: Mapping[str, Any], names: Iterable[str], timeout: float | None = None, reader: str = "metrics"
    ) -> dict:
        """``values`` (what a callback read of the logged metrics, name -> value) with the metrics ``names`` agreed as
        :meth:`agree` agrees one, in one exchange whatever their count: a checkpoint's monitored metric and those that
        name its file. One of them that another rank logged and this one did not is added; with ``op="main"``, one
        that rank 0 did not log is left out on every rank. Values that are not one number stay as they are, and so
        does every other metric. ``reader`` names the reading callback in the exchange, so that ranks at different
        reads mismatch."""
        mine = {name: number for name in names if (number := _scalar(values.get(name))) is not None}
        gathered = all_gather(mine, name=f"monitor: {reader}", timeout=timeout)
        agreed = dict(values)
        for name in sorted(set().union(*gathered)):
            per_rank = [numbers.get(name) for numbers in gathered]
            if self.op is MonitorOp.MAIN and per_rank[0] is None:
                agreed.pop(name, None)
            else:
                agreed[name] = self._settle(name, per_rank, values.get(name))
        return agreed

    def _settle(self, name: str, gathered: list[float | None], value: Any) -> Any:
        """The value every rank takes of ``name``, from every rank's number (None: not logged there), warning once per
        name where they differ or some rank logged none; ``value``, this rank's, when no rank logged one."""
        present = [v for v in gathered if v is not None]
        if not present:
            return value
        missing = len(present) < len(gathered)
        if (missing or not _same(present)) and name not in self._warned:
            self._warned.add(name)
            if topology.is_main():
                detail = "was not logged on every rank" if missing else f"differs across ranks ({_show(gathered)})"
                warnings.warn(
                    f"monitored metric {name!r} {detail}: log it with self.log(..., sync_dist=True). ranksafe gives "
                    f"every rank the {self.op} value so that checkpoint and stopping decisions agree.",
                    UnsyncedMetricWarning,
                    stacklevel=3,
                )
        agreed = _reduce(gathered if self.op is MonitorOp.MAIN else present, self.op)
        if isinstance(value, torch.Tensor):
            return torch.tensor(agreed, dtype=value.dtype, device=value.device)
        return torch.tensor(agreed) if value is None else type(value)(agreed)


def _show(values: list[float | None]) -> str:
    return ", ".join(f"rank {r}: {'missing' if v is None else f'{v:.6g}'}" for r, v in enumerate(values))
