"""The private names of fastai and NumPy that ranksafe.fastai needs: each reached here, and only here.

:data:`PRIVATE_NAMES` lists them for ``tests/test_fastai_compat.py``, which fails naming the attribute when an
upstream release renames or removes one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from fastai.distributed import DistributedDL
from fastai.learner import Learner

_numpy_core: Any = getattr(np, "_core", None) or np.core  # NumPy 2 renamed numpy.core to numpy._core

PRIVATE_NAMES: dict[str, tuple[Any, str]] = {
    "fastai.learner.Learner._end_cleanup": (Learner, "_end_cleanup"),
    "fastai.distributed.DistributedDL._broadcast": (DistributedDL, "_broadcast"),
    "numpy._core.multiarray.scalar": (_numpy_core.multiarray, "scalar"),
}
"""Each private name by its dotted path: the object that holds it and the attribute."""


def end_cleanup(learn: Learner) -> None:
    """Drop the last batch, predictions and loss from ``learn``, as fastai's ``export`` does before pickling it
    (``Learner._end_cleanup``): an exported Learner must not carry training tensors."""
    learn._end_cleanup()


def set_broadcast(dl: DistributedDL, broadcast: Callable[[list, int], list]) -> None:
    """Give one ``DistributedDL`` its own way to share rank 0's sample order (``DistributedDL._broadcast``).

    fastai's version sends a CUDA tensor whatever the backend, so it fails under gloo on a CPU-only machine;
    ``get_idxs`` calls it through the instance, so setting it on one loader changes no other.
    """
    dl._broadcast = broadcast


def numpy_scalar() -> Callable[..., Any]:
    """NumPy's scalar reconstructor (``numpy._core.multiarray.scalar``): fastai's own ``load_model`` allows it in
    a weights-only load, since its model files can hold NumPy scalars."""
    return _numpy_core.multiarray.scalar
