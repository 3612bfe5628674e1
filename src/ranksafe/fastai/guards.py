"""What RankSafe does to three of fastai's callbacks during a fit on several ranks, so that they act as one job.

* ``CSVLogger``: switched off (``run = False``, which fastai resets after each pass) on every rank but rank 0; where
  ``learn.path`` is a URL, it makes its own file's folder, not a local one named after the URL.
* ``LRFinder``: one temporary model, named by rank 0, written once, loaded by every rank, removed once (each rank
  made its own directory, and only rank 0 found a model in it).
* ``TerminateOnNaNCallback``: every rank stops after the same batch (each rank looking at its own loss stopped one
  rank while the others went on into the next gradient all-reduce).

LRFinder, TerminateOnNaNCallback and (for a URL) CSVLogger get events of their own on the instance (:func:`guard`),
``functools.partial`` objects that pickle; :func:`put_back` takes them off when the fit is over. The trackers
(``SaveModelCallback``, ``EarlyStoppingCallback``, ``ReduceLROnPlateau``...) are kept quiet where a resumed fit goes
over what the run that saved it did (:func:`quiet_trackers`).
"""

from __future__ import annotations

import contextlib
import secrets
import tempfile
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from fastai.callback.core import Callback
from fastai.callback.progress import CSVLogger
from fastai.callback.schedule import LRFinder, ParamScheduler
from fastai.callback.tracker import EarlyStoppingCallback, ReduceLROnPlateau, TerminateOnNaNCallback, TrackerCallback
from fastai.learner import CancelFitException, Learner

from .. import remote, topology
from ..collectives import together


def _nan_after_batch(cb: TerminateOnNaNCallback) -> None:
    """One all-reduce (MAX) of one flag per batch: the same answer on every rank."""
    if topology.world_size() < 2:  # a copy pickled during the fit, used in one process: fastai's own
        return TerminateOnNaNCallback.after_batch(cb)
    bad = (~torch.isfinite(cb.loss.detach())).any().float().reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        raise CancelFitException


def _lr_finder_before_fit(cb: LRFinder) -> None:
    ParamScheduler.before_fit(cb)
    models = remote.joinpath(cb.path, cb.model_dir)
    with together("lr_find: temporary directory", reduce=lambda names: names[0]) as made:  # rank 0's, everywhere
        if topology.is_main() and remote.is_url(models):  # no directory to make: a name nobody else uses
            made.value = f"_lr_find_{secrets.token_hex(4)}"
        elif topology.is_main():
            models.mkdir(parents=True, exist_ok=True)
            made.value = Path(tempfile.mkdtemp(dir=models)).name
    cb.tmp_p = made.result
    cb.learn.save(f"{cb.tmp_p}/_tmp")
    cb.best_loss = float("inf")


def _lr_finder_after_fit(cb: LRFinder) -> None:
    cb.learn.opt.zero_grad()  # fastai: needed before detaching the optimizer for future fits
    try:
        cb.learn.load(f"{cb.tmp_p}/_tmp", with_opt=True)  # returns on a rank once every rank has read it
    finally:
        with together("lr_find: remove temporary model"):
            _remove_temporary_model(cb.learn, cb.tmp_p)


def _remove_temporary_model(learn: Learner, name: str) -> None:
    """Rank 0 removes the directory of lr_find's temporary model, ``name`` under the Learner's models. Local."""
    if topology.is_main():
        remote.remove(remote.joinpath(learn.path, learn.model_dir, name))


def discard_temporaries(learn: Learner, guarded: list[tuple[Callback, str]]) -> None:
    """After a fit that raised (no ``after_fit`` ran, and fastai took the ``LRFinder`` off): rank 0 removes the
    temporary model of a guarded ``lr_find``, as fastai's own temporary directory goes once its ``LRFinder`` is
    collected. Local: after a failure the ranks do not meet."""
    for cb, name in guarded:
        if name == "before_fit" and isinstance(cb, LRFinder) and getattr(cb, "tmp_p", None):
            with contextlib.suppress(OSError):  # the fit's own error is the one to raise
                _remove_temporary_model(learn, cb.tmp_p)


def _csv_before_fit(cb: CSVLogger) -> None:
    """fastai's, with the logger's ``path`` its file's own folder: fastai makes ``learn.path``'s parent first, which for
    a URL is a local folder named after it (``./s3:/bucket``). The file is local (:func:`refuse_remote_csv`)."""
    vars(cb)["path"] = Path(remote.joinpath(cb.learn.path, cb.fname)).parent  # `path` is the Learner's otherwise
    try:
        CSVLogger.before_fit(cb)
    finally:
        del vars(cb)["path"]


_EVENTS: dict[type, dict[str, Callable[[Callback], None]]] = {
    TerminateOnNaNCallback: {"after_batch": _nan_after_batch},
    LRFinder: {"before_fit": _lr_finder_before_fit, "after_fit": _lr_finder_after_fit},
    CSVLogger: {"before_fit": _csv_before_fit},
}


def guard(cbs: Iterable[Callback], kinds: tuple[type, ...]) -> list[tuple[Callback, str]]:
    """Give the callbacks of ``kinds`` (``LRFinder``, ``TerminateOnNaNCallback``, ``CSVLogger``) among ``cbs`` their
    rank-safe events; returns the ``(callback, event)`` pairs set, for :func:`put_back`."""
    guarded = []
    for cb in cbs:
        for kind, events in _EVENTS.items():
            if kind in kinds and isinstance(cb, kind):
                for name, event in events.items():
                    vars(cb)[name] = partial(event, cb)  # looked up on the instance first
                    guarded.append((cb, name))
    return guarded


def put_back(pairs: list[tuple[Callback, str]], event: str | None = None) -> None:
    """Give the callbacks of the ``(callback, event)`` pairs (only those of ``event``, when given) back their own
    events, and drop those pairs from ``pairs``."""
    for cb, name in [pair for pair in pairs if event in (None, pair[1])]:
        vars(cb).pop(name, None)
        pairs.remove((cb, name))


def _skipped_event() -> None:
    """A tracker's event kept quiet (:func:`quiet_trackers`)."""


def quiet_trackers(learn: Learner, quiet: list[tuple[Callback, str]], event: str, bookkeeping: bool = False) -> None:
    """Keep the trackers' ``event`` quiet for this epoch or fit, added to ``quiet`` for :func:`put_back`.

    For ``after_epoch``, an epoch a resume skips: the trackers acted on it in the run that saved it, and what they
    did is in the restored state (the best model on disk, the reduced learning rate). With ``bookkeeping`` they
    update what they track (the best value, the epochs without improvement), and do nothing else. For
    ``after_fit``, a preempted fit, which is not the end of training: ``SaveModelCallback`` loading the best model
    waits for the fit that ends it."""
    for cb in learn.cbs:
        if not (isinstance(cb, TrackerCallback) and cb.run):
            continue
        if bookkeeping:
            TrackerCallback.after_epoch(cb)
            if isinstance(cb, (EarlyStoppingCallback, ReduceLROnPlateau)):
                cb.wait = 0 if cb.new_best else cb.wait + 1
                if isinstance(cb, ReduceLROnPlateau) and cb.wait >= cb.patience:
                    cb.wait = 0  # the reduction it made then is in the restored hypers
        vars(cb)[event] = _skipped_event
        quiet.append((cb, event))


def quiet_csv_loggers(learn: Learner, quiet: bool = True) -> None:
    """Switch the ``CSVLogger`` off (or back on) on every rank but rank 0; called before the logger's ``before_fit``
    and ``after_fit``, which then do not run."""
    if not topology.is_main():
        for cb in learn.cbs:
            if isinstance(cb, CSVLogger):
                cb.run = not quiet


def refuse_remote_csv(learn: Learner) -> None:
    """A ``CSVLogger`` whose file is on remote storage: fastai opens it with ``open``, which makes a local folder named
    after the URL before it fails. Refused before the logger runs, on every rank alike."""
    for cb in learn.cbs:
        if not isinstance(cb, CSVLogger):
            continue
        scheme, target = remote.split(remote.joinpath(learn.path, cb.fname))
        if scheme is not None:
            raise ValueError(
                f"{target} (rank {topology.rank()}): fastai's CSVLogger writes local files only; give it a local "
                "file (CSVLogger(fname='/abs/path/history.csv')) or keep learn.path local"
            )
