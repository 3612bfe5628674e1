"""This process's random generators, saved and put back: Python's, NumPy's global one, torch's and CUDA's.

A resumed run that restores them draws the same batches, augmentations and dropout masks as the run that saved
them. The saved form is plain tensors and built-in types, so a ``weights_only`` load reads it back.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:  # not a dependency of torch's: a process without NumPy has no NumPy generator to keep
    import numpy as np
except ImportError:  # pragma: no cover - depends on the environment
    np = None  # type: ignore[assignment]


def random_state(saved: Any) -> tuple:
    """A ``random.Random`` state as ``setstate`` takes it (read back from a file, its tuples may be lists)."""
    version, internal, gauss = saved
    return version, tuple(internal), gauss


def rng_state() -> dict[str, Any]:
    """This process's random generators."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        _, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "gauss": (has_gauss, cached)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    random.setstate(random_state(state["python"]))
    if "numpy" in state and np is not None:
        n = state["numpy"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], *n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
