"""Resuming inside an epoch: the batches after the last one a checkpoint saw, drawn as the interrupted run drew them.

A checkpoint taken inside an epoch records how many of its training batches were done, fastai's schedule position
(``pct_train``, ``train_iter``), and each rank's generators at the epoch's start and at the checkpoint. In the
resumed run, that epoch's ``before_epoch`` gives the Learner a training pass of its own (:func:`skip_done_batches`;
fastai looks ``all_batches`` up before ``before_train``), and ``before_train`` puts back the epoch-start generators
and the schedule position (:func:`restore_epoch_start`). The pass lets the loader shuffle as the interrupted run did,
leaves out the batches already trained, and restores the checkpoint's generators before the next batch is made.

A fastai ``DataLoader`` makes its batches from consecutive runs of ``bs`` indices of ``get_idxs()``: the batches done
are left out of that list, so they are never loaded. Any other iterable (a torch ``DataLoader``) is iterated and the
batches done are dropped: the same batches, at the cost of loading them once more.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastai.data.load import DataLoader
from fastai.distributed import DistributedDL
from fastai.learner import Learner

from .training_state import set_generators


@dataclass(frozen=True)
class Resumption:
    """Where a checkpoint taken inside an epoch left it, for the resumed run's pass over that epoch."""

    epoch: int
    batches: int  # the epoch's training batches done
    pct_train: float
    train_iter: int
    epoch_start: dict[str, Any] | None  # this rank's generators when the epoch's training started (None: unknown)
    generators: dict[str, Any] | None  # ... and at the checkpoint


def skip_done_batches(learn: Learner, at: Resumption) -> None:
    """At the resumed epoch's ``before_epoch``: its training pass starts at the batch after the last one done (undone
    by that pass, or by :func:`end_resumed_epoch`)."""
    vars(learn)["all_batches"] = partial(_remaining_batches, learn, at.batches, at.generators)


def restore_epoch_start(learn: Learner, at: Resumption) -> None:
    """At the resumed epoch's ``before_train``, after fastai's ``TrainEvalCallback`` set ``pct_train`` to the epoch's
    start: the generators of the epoch's start (the shuffle) and the schedule's position at the checkpoint."""
    if at.epoch_start is not None:
        set_generators(learn, at.epoch_start)
    learn.pct_train, learn.train_iter = at.pct_train, at.train_iter


def end_resumed_epoch(learn: Learner) -> None:
    """Take off what :func:`skip_done_batches` set, if its pass has not (an epoch or pass cancelled before it)."""
    method = vars(learn).get("all_batches")
    if isinstance(method, partial) and method.func is _remaining_batches:
        del vars(learn)["all_batches"]


def _remaining_batches(learn: Learner, done: int, generators: dict[str, Any] | None) -> None:
    """``Learner.all_batches`` for the resumed epoch's training pass: the batches after the first ``done``, numbered
    as in the interrupted run (``learn.iter``), with ``n_iter`` the epoch's full length (fastai's schedule needs it)."""
    end_resumed_epoch(learn)  # this pass only: validation and the next epochs iterate whole
    dl = learn.dl
    learn.n_iter = len(dl)
    if isinstance(dl, DistributedDL) or (isinstance(dl, DataLoader) and dl.n is not None):
        # its next get_idxs (once per pass, after the loader reseeded itself) leaves out the batches done
        vars(dl)["get_idxs"] = partial(_remaining_idxs, dl, vars(dl).get("get_idxs"), done, learn, generators)
        batches: Iterable[Any] = dl
    else:
        batches = _dropped(dl, done, learn, generators)
    for i, b in enumerate(batches, start=done):
        learn.one_batch(i, b)


def _remaining_idxs(dl: DataLoader, own: Any, done: int, learn: Learner, generators: dict[str, Any] | None) -> list:
    """``get_idxs`` of the resumed pass, once: the indices after the first ``done`` batches, then ``generators``."""
    if own is None:
        del vars(dl)["get_idxs"]
    else:  # a get_idxs given to the loader itself (fastai's DataLoader takes one as an argument)
        vars(dl)["get_idxs"] = own
    idxs = list(dl.get_idxs())  # the shuffle: as in the interrupted run, from the generators of the epoch's start
    if generators is not None:
        set_generators(learn, generators)  # before the first remaining batch is made: its augmentations, dropout
    return idxs[done * (dl.bs or 1) :]


def _dropped(batches: Iterable[Any], done: int, learn: Learner, generators: dict[str, Any] | None) -> Iterator[Any]:
    """``batches`` without the first ``done``, the generators restored before the next one is made."""
    it = iter(batches)
    for _ in range(done):
        next(it, None)
    if generators is not None:
        set_generators(learn, generators)
    yield from it
