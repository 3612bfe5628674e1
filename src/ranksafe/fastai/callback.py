"""The ``RankSafe`` callback: ``Learner(..., cbs=RankSafe())`` makes fastai's files and decisions rank-safe.

While attached to a Learner it gives that Learner (that instance only, never the class) the collective
``save``/``load``/``export``/``get_preds`` (and the text learners' encoder loaders) of
:mod:`ranksafe.fastai.learner`, and during ``fit``:

* **decisions**: after the ``Recorder`` has recorded an epoch (order 50) and before any
  ``TrackerCallback`` reads it (order 60+), every rank replaces its epoch record by rank 0's. So
  ``SaveModelCallback``, ``EarlyStoppingCallback``, ``ReduceLROnPlateau`` and any other tracker see the same
  value on every rank and decide the same way: save together, stop at the same epoch. Rank 0's record is
  the one the CSV log and the progress bar show, so what is logged is what was decided.
* **failures**: ``fit`` runs under :func:`ranksafe.abort_on_error`, and every epoch starts with a barrier:
  a rank that raises in a callback (a full disk under the log, a tracker) stops every rank at their next
  ranksafe collective, before they enter the next epoch's gradient all-reduce, where only the process
  group's own timeout would end the wait. Two small collectives per epoch in all when nothing is saved.
* **CSVLogger**: only rank 0 opens and writes the log; a failure to open it is raised on every rank.
* **lr_find**: one temporary model, named by rank 0, written once, loaded by every rank, and removed once
  after every rank has loaded it.

Attaching it also points fastai at the process group's ranks and makes ``distrib_ctx()`` work with gloo on
CPU (:mod:`ranksafe.fastai.cpu`). In a single process it changes nothing fastai writes or decides.
"""

from __future__ import annotations

import shutil
import tempfile
import types
from pathlib import Path
from typing import Any

from fastai.callback.core import Callback
from fastai.callback.progress import CSVLogger
from fastai.callback.schedule import LRFinder, ParamScheduler
from fastai.learner import Learner
from fastcore.foundation import L

from .. import topology
from ..collectives import barrier, broadcast, together
from .cpu import prepare_distributed
from .learner import LEARNER_METHODS, RankSafeLearner

_WRAPPED = "_ranksafe_wrapped"


def _wrap_events(cb: Callback, **events: Any) -> None:
    """Give one callback instance its own versions of some events (undone by :func:`_unwrap_events`)."""
    for name, fn in events.items():
        cb.__dict__[name] = types.MethodType(fn, cb)
    cb.__dict__[_WRAPPED] = tuple(events)


def _unwrap_events(cb: Callback) -> None:
    for name in cb.__dict__.pop(_WRAPPED, ()):
        cb.__dict__.pop(name, None)


def _csv_before_fit(self: CSVLogger) -> None:
    if hasattr(self, "gather_preds"):
        return
    with together("CSVLogger.before_fit"):
        if topology.is_main():
            Path(self.path).mkdir(parents=True, exist_ok=True)  # fastai makes only path.parent
            type(self).before_fit(self)


def _csv_after_fit(self: CSVLogger) -> None:
    try:
        if topology.is_main():
            type(self).after_fit(self)
    finally:
        _unwrap_events(self)


def _lr_finder_before_fit(self: LRFinder) -> None:
    ParamScheduler.before_fit(self)
    path = Path(self.path) / self.model_dir
    name = None
    with together("lr_find: temporary directory"):
        if topology.is_main():
            path.mkdir(parents=True, exist_ok=True)
            name = Path(tempfile.mkdtemp(dir=path)).name
    self.tmp_p = broadcast(name, name="lr_find: temporary directory")
    self.learn.save(f"{self.tmp_p}/_tmp")
    self.best_loss = float("inf")


def _lr_finder_after_fit(self: LRFinder) -> None:
    self.learn.opt.zero_grad()  # needed before detaching the optimizer for future fits
    try:
        self.learn.load(f"{self.tmp_p}/_tmp", with_opt=True)  # returns on a rank once every rank has read it
    finally:
        with together("lr_find: remove temporary model"):
            if topology.is_main():
                shutil.rmtree(Path(self.path) / self.model_dir / self.tmp_p, ignore_errors=True)
        _unwrap_events(self)


class RankSafe(Callback):
    """Make everything fastai writes or decides correct under distributed training.

    Add it to any Learner: ``Learner(dls, model, cbs=RankSafe())``, then train as usual, inside
    ``learn.distrib_ctx()`` or not, under ``torchrun`` or ``mp.spawn``. Initialise the process group before
    creating the Learner, so that ``distrib_ctx`` sees the right ranks. See the module docstring.
    """

    order = 55  # after Recorder (50) has recorded the epoch; before CSVLogger, LRFinder, trackers (60+)
    _learn: Learner | None = None
    _installed: tuple[str, ...] = ()

    def __init__(self) -> None:
        prepare_distributed()

    # Attaching: Learner.add_cb sets `cb.learn`, remove_cb sets it to None.
    @property
    def learn(self) -> Learner | None:
        return self._learn

    @learn.setter
    def learn(self, learn: Learner | None) -> None:
        if learn is self._learn:
            return
        self._uninstall()
        object.__setattr__(self, "_learn", learn)
        if learn is not None:
            prepare_distributed()
            self._install()

    def reattach(self) -> None:
        """Install the rank-safe methods again on a Learner restored from a pickle (``load_learner``)."""
        object.__setattr__(self, "_installed", ())
        self._install()

    def _install(self) -> None:
        learn = self._learn
        if learn is None or isinstance(learn, RankSafeLearner):
            return
        names = [n for n in LEARNER_METHODS if hasattr(type(learn), n) and n not in learn.__dict__]
        for name in names:
            learn.__dict__[name] = types.MethodType(LEARNER_METHODS[name], learn)
        object.__setattr__(self, "_installed", tuple(names))

    def _uninstall(self) -> None:
        learn = self._learn
        for name in self._installed:
            if learn is not None and getattr(learn.__dict__.get(name), "__func__", None) is LEARNER_METHODS[name]:
                del learn.__dict__[name]
        object.__setattr__(self, "_installed", ())

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_installed", None)
        return state

    # Events
    def before_epoch(self) -> None:
        """Every rank arrives here, or every rank learns which one failed (instead of hanging in DDP)."""
        if topology.world_size() >= 2 and not hasattr(self.learn, "gather_preds"):
            barrier("fastai: epoch start")

    def before_fit(self) -> None:
        if topology.world_size() < 2:
            return
        for cb in self.learn.cbs:
            if isinstance(cb, CSVLogger) and _WRAPPED not in cb.__dict__:
                _wrap_events(cb, before_fit=_csv_before_fit, after_fit=_csv_after_fit)
            elif isinstance(cb, LRFinder) and _WRAPPED not in cb.__dict__:
                _wrap_events(cb, before_fit=_lr_finder_before_fit, after_fit=_lr_finder_after_fit)

    def after_epoch(self) -> None:
        """Every rank takes rank 0's record of this epoch, before any tracker reads it."""
        recorder = getattr(self.learn, "recorder", None)
        if topology.world_size() < 2 or recorder is None or hasattr(self.learn, "gather_preds"):
            return
        if not recorder.values:
            return
        agreed = broadcast(list(recorder.values[-1]), name="fastai: epoch record")
        recorder.values[-1] = self.learn.final_record = L(agreed)
