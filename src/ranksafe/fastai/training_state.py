"""What a fastai run needs to continue where it stopped, and how it goes back in.

A checkpoint of :class:`~ranksafe.fastai.RankSafe` holds, in ``state.pt`` (written once): the model's
``state_dict``, the optimizer's state, MixedPrecision's GradScaler state (fp16), the epoch just completed, the
Recorder's values and where the fit stands in the run (which fit of the script wrote it, and the step number
of that fit's epoch 0, so that a re-run of a script with several fits knows which one to continue); and one
file per rank (``rng-00000.pt``, ...) with that rank's random generators (Python, NumPy, torch, CUDA, and each
data loader's own), so that
a resumed run draws the same augmentations and dropout masks as the uninterrupted one would, and its
Recorder's smoothed loss, which runs on across epochs (the ``train_loss`` of the first resumed epoch is the
uninterrupted run's). Everything is plain tensors and built-in types: it loads with ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from fastai.distributed import DistributedDL
from fastai.learner import Learner
from fastai.torch_core import get_model
from fastcore.foundation import L

STATE = "state.pt"
FIT, STEP_BASE = "fit", "step_base"
"""Keys of :func:`training_state`: the ordinal of the fit that wrote it; the step number of its epoch 0."""


def rng_file(rank: int) -> str:
    """The name of a rank's random-state file inside a step directory."""
    return f"rng-{rank:05d}.pt"


def _plain(x: Any) -> Any:
    """A recorded value as a built-in type (NumPy scalars would need a full unpickler)."""
    return x.item() if isinstance(x, (np.generic, torch.Tensor)) and x.ndim == 0 else x


def _plain_tree(x: Any) -> Any:
    """The optimizer's state with built-in containers and scalars only (tensors untouched): fastai's schedulers
    put NumPy floats in the hypers (``fit_one_cycle``), Lookahead (``ranger``) keeps fastcore ``L`` lists, and a
    weights-only load refuses both."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {k: _plain_tree(v) for k, v in x.items()}
    if isinstance(x, (L, list)):
        return [_plain_tree(v) for v in x]
    if type(x) is tuple:
        return tuple(_plain_tree(v) for v in x)
    return x


def training_state(learn: Learner, fit: int = 0, step_base: int = 0) -> dict[str, Any]:
    """The state written once per checkpoint: model, optimizer, completed epoch, recorded values.

    ``fit`` (the ordinal of the fit in the run) and ``step_base`` (the step of that fit's epoch 0) are
    recorded too: a checkpoint written before them lacks both keys.
    """
    recorder = getattr(learn, "recorder", None)
    values = [] if recorder is None else [[_plain(x) for x in v] for v in recorder.values]
    state = {
        "model": get_model(learn.model).state_dict(),
        "opt": _plain_tree(learn.opt.state_dict()),
        "epoch": learn.epoch,
        "recorder": values,
        FIT: fit,
        STEP_BASE: step_base,
    }
    scaler = getattr(learn, "scaler", None)  # MixedPrecision's GradScaler: the same on every rank
    if scaler is not None and scaler.is_enabled():
        state["scaler"] = scaler.state_dict()
    return state


def restore(learn: Learner, state: dict[str, Any]) -> None:
    """Put a :func:`training_state` back into ``learn`` (model, optimizer, and MixedPrecision's loss scale: a
    resumed fp16 run that started again from the initial scale would overflow and skip steps to find it)."""
    get_model(learn.model).load_state_dict(state["model"])
    scaler = getattr(learn, "scaler", None)  # set by MixedPrecision's before_fit, which runs before RankSafe's
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    opt = dict(state["opt"])
    if "hypers" in opt:  # a fastai Optimizer (OptimWrapper's state is torch's own)
        opt["hypers"] = L(opt["hypers"])
    if "slow_weights" in opt:  # Lookahead (ranger)
        opt["slow_weights"] = L(L(pg) for pg in opt["slow_weights"])
    learn.opt.load_state_dict(opt)


def _loaders(learn: Learner) -> list[Any]:
    """The fastai DataLoaders of ``learn`` that shuffle with a generator of their own (``DataLoader.rng``), unwrapped
    from fastai's ``DistributedDL``, in the order of ``learn.dls``."""
    found = []
    for dl in getattr(getattr(learn, "dls", None), "loaders", ()):
        dl = dl.dl if isinstance(dl, DistributedDL) else dl
        if isinstance(getattr(dl, "rng", None), random.Random):
            found.append(dl)
    return found


def rank_state(learn: Learner) -> dict[str, Any]:
    """This rank's own part of a checkpoint: :func:`rng_state`, the generators of its data loaders (a fastai
    ``DataLoader`` shuffles with its own, reseeded from itself at every epoch: a resumed run restored without it
    trained its epochs on other batches), and the Recorder's smoothed loss (the loss of this rank's batches,
    averaged over every batch so far)."""
    state = rng_state()
    state["loaders"] = [dl.rng.getstate() for dl in _loaders(learn)]
    smooth = getattr(getattr(learn, "recorder", None), "smooth_loss", None)
    if smooth is not None:
        val = torch.as_tensor(smooth.val).as_subclass(torch.Tensor)  # fastai's TensorBase needs a full unpickler
        state["smooth_loss"] = {"count": int(smooth.count), "val": val.detach().cpu()}
    return state


def set_rank_state(learn: Learner, state: dict[str, Any]) -> None:
    """Restore what :func:`rank_state` returned, after the Recorder's ``before_fit`` reset its smoothed loss
    (a file written before the smoothed loss was saved restores the generators only)."""
    set_rng_state(state)
    loaders = _loaders(learn)
    if len(loaders) == len(state.get("loaders", ())):  # other loaders now (or a file from before): as they are
        for dl, (version, internal, gauss) in zip(loaders, state["loaders"], strict=True):
            dl.rng.setstate((version, tuple(internal), gauss))
    smooth = getattr(getattr(learn, "recorder", None), "smooth_loss", None)
    if smooth is not None and "smooth_loss" in state:
        smooth.count, smooth.val = state["smooth_loss"]["count"], state["smooth_loss"]["val"]
        learn.smooth_loss = smooth.value


def rng_state() -> dict[str, Any]:
    """This process's random generators."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "gauss": (has_gauss, cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (the containers may come back as lists from a file)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], *n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
