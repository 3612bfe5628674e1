"""What a fastai run needs to continue where it stopped, and how it goes back in.

A checkpoint of :class:`~ranksafe.fastai.RankSafe` holds ``state.pt``, written once (model, optimizer, MixedPrecision's
loss scale, GradientAccumulation's gradients not yet stepped, the epoch, the Recorder's values, which fit of the
script wrote it), and one file per rank (``rng-00000.pt``, ...) with that rank's random generators, its data loaders'
own and the Recorder's smoothed loss: a resumed run draws the same batches, augmentations and dropout masks as the
uninterrupted one, and logs the same ``train_loss``. Everything is plain tensors and built-in types, so it loads with
``weights_only=True``. A checkpoint taken inside an epoch also holds where that epoch stood (:mod:`.mid_epoch`).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from fastai.callback.training import GradientAccumulation
from fastai.distributed import DistributedDL
from fastai.learner import Learner
from fastai.torch_core import get_model
from fastcore.foundation import L

from ..rng import random_state, rng_state, set_rng_state

# keys of state.pt: the ordinal of the fit that wrote it, the step number of that fit's epoch 0, the optimizer steps
# of the run (what the save schedule counts), fastai's count of the fit's training batches
FIT, STEP_BASE, STEPS, TRAIN_ITER = "fit", "step_base", "steps", "train_iter"
# ... only inside an epoch: its training batches done, fastai's pct_train then
BATCHES, PCT_TRAIN = "batches", "pct_train"
# ... while GradientAccumulation holds gradients not yet stepped (its steps straddle an epoch's end)
ACCUMULATED = "accumulated"
# key of a rank's file, inside an epoch: its generators when that epoch's training started
EPOCH_START = "epoch_start"


def rng_file(rank: int) -> str:
    """The name of a rank's own file inside a step directory."""
    return f"rng-{rank:05d}.pt"


def _plain(x: Any) -> Any:
    """The optimizer's state with built-in containers and scalars only (tensors untouched): fastai's schedulers put
    NumPy floats in the hypers (``fit_one_cycle``), Lookahead (``ranger``) keeps fastcore ``L`` lists, and a
    weights-only load refuses both."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (L, list)):
        return [_plain(v) for v in x]
    return tuple(_plain(v) for v in x) if type(x) is tuple else x


def _number(x: Any) -> Any:
    """A recorded value as a built-in number (a NumPy or 0-d torch scalar would need a full unpickler)."""
    return x.item() if isinstance(x, (np.generic, torch.Tensor)) and x.ndim == 0 else x


def training_state(
    learn: Learner, fit: int = 0, step_base: int = 0, steps: int = 0, inside_epoch: bool = False
) -> dict[str, Any]:
    """The state written once per checkpoint; ``fit`` is the ordinal of the fit in the run, ``step_base`` the step
    of its epoch 0, ``steps`` the optimizer steps of the run. ``inside_epoch``: taken after the training batch
    ``learn.iter`` of epoch ``learn.epoch``, not at the epoch's end."""
    recorder = getattr(learn, "recorder", None)
    state = {
        "model": get_model(learn.model).state_dict(),
        "opt": _plain(learn.opt.state_dict()),
        "epoch": learn.epoch,
        "recorder": [] if recorder is None else [[_number(x) for x in v] for v in recorder.values],
        FIT: fit,
        STEP_BASE: step_base,
        STEPS: steps,
        TRAIN_ITER: int(getattr(learn, "train_iter", 0)),
    }
    if inside_epoch:
        state[BATCHES], state[PCT_TRAIN] = learn.iter + 1, float(learn.pct_train)
    scaler = getattr(learn, "scaler", None)  # MixedPrecision's GradScaler: the same on every rank
    if scaler is not None and scaler.is_enabled():
        state["scaler"] = scaler.state_dict()
    count = next((cb.count for cb in learn.cbs if isinstance(cb, GradientAccumulation)), 0)
    if count:  # DDP has averaged them: the same on every rank
        state[ACCUMULATED] = {"count": count, "grads": [p.grad for p in get_model(learn.model).parameters()]}
    return state


def restore(learn: Learner, state: dict[str, Any]) -> None:
    """Put a :func:`training_state` back into ``learn`` (model, optimizer, and MixedPrecision's loss scale: a resumed
    fp16 run that started again from the initial scale would overflow and skip steps to find it)."""
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
    accumulated = state.get(ACCUMULATED)
    if accumulated is not None:  # after GradientAccumulation's before_fit set its count to 0
        for cb in learn.cbs:
            if isinstance(cb, GradientAccumulation):
                cb.count = accumulated["count"]
        for p, grad in zip(get_model(learn.model).parameters(), accumulated["grads"], strict=True):
            p.grad = None if grad is None else grad.to(p.device)


def _loaders(learn: Learner) -> list[Any]:
    """The data loaders that shuffle with a generator of their own (fastai's ``DataLoader.rng``, reseeded from itself
    every epoch: a resume that restored only the global generators trained on other batches)."""
    found = [dl.dl if isinstance(dl, DistributedDL) else dl for dl in getattr(learn.dls, "loaders", ())]
    return [dl for dl in found if isinstance(getattr(dl, "rng", None), random.Random)]


def generators(learn: Learner) -> dict[str, Any]:
    """This rank's random generators (:func:`~ranksafe.rng.rng_state`) and its data loaders' own."""
    return {**rng_state(), "loaders": [dl.rng.getstate() for dl in _loaders(learn)]}


def set_generators(learn: Learner, state: dict[str, Any]) -> None:
    """Put back what :func:`generators` returned (loaders other than the saved ones keep their own generators)."""
    set_rng_state(state)
    loaders = _loaders(learn)
    if len(loaders) == len(state.get("loaders", ())):
        for dl, saved in zip(loaders, state["loaders"], strict=True):
            dl.rng.setstate(random_state(saved))


def rank_state(learn: Learner) -> dict[str, Any]:
    """This rank's own part of a checkpoint: its random :func:`generators` and its Recorder's smoothed loss (the loss
    of this rank's batches, averaged over every batch so far)."""
    state = generators(learn)
    smooth = getattr(getattr(learn, "recorder", None), "smooth_loss", None)
    if smooth is not None:
        val = torch.as_tensor(smooth.val).as_subclass(torch.Tensor)  # fastai's TensorBase needs a full unpickler
        state["smooth_loss"] = {"count": int(smooth.count), "val": val.detach().cpu()}
    return state


def set_rank_state(learn: Learner, state: dict[str, Any]) -> None:
    """Restore what :func:`rank_state` returned, after the Recorder's ``before_fit`` reset its smoothed loss (a file
    without loaders or smoothed loss restores the rest)."""
    set_generators(learn, state)
    smooth = getattr(getattr(learn, "recorder", None), "smooth_loss", None)
    if smooth is not None and "smooth_loss" in state:
        smooth.count, smooth.val = state["smooth_loss"]["count"], state["smooth_loss"]["val"]
        learn.smooth_loss = smooth.value
