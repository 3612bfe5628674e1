"""Argument checks shared by the framework callbacks (``ranksafe.lightning``, ``ranksafe.fastai``) and the core, and
how long a collective waits when given no timeout (``RANKSAFE_TIMEOUT``).

Every rank makes its callback alike, so an argument refused when the callback is made fails every rank at once,
instead of at the first save, or never (an option that needs a directory to save into, given none, does nothing).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any


def positive_int(name: str, value: int | None, allow_none: bool = True) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int of at least 1 (or None, if allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, not {value!r}")


def positive_number(name: str, value: float | None) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number above 0, or None (a NaN read from a
    configuration would pass ``value <= 0`` and then never be reached)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(f"{name} must be a positive number or None, not {value!r}")


def needs_checkpoint_dir(checkpoint_dir: Any, **options: Any) -> None:
    """Raise ``ValueError`` naming the first of ``options`` that is set while ``checkpoint_dir`` is None."""
    if checkpoint_dir is None:
        for name, value in options.items():
            if value:
                raise ValueError(f"RankSafe({name}=...) needs a checkpoint_dir to save into")


DEFAULT_TIMEOUT = 1800.0
"""Seconds a collective waits for the slowest rank (``RANKSAFE_TIMEOUT`` overrides it)."""


def checked_timeout(timeout: Any, name: str = "timeout") -> float | None:
    """``timeout`` in seconds, or None; anything but a positive, finite number (or None) is a ``ValueError`` naming
    ``name``: a zero or negative timeout would report every rank missing at once, an infinite one never."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds or None, not {timeout!r}")
    return float(timeout)


def default_timeout() -> float:
    """Seconds a collective waits when no timeout is given: ``RANKSAFE_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`."""
    text = os.environ.get("RANKSAFE_TIMEOUT")
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan  # refused below, with the variable's text
    if not 0 < seconds < math.inf:
        raise ValueError(f"RANKSAFE_TIMEOUT must be a positive number of seconds, not {text!r}")
    return seconds
