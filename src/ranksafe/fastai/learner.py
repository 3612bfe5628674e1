"""Rank-safe versions of fastai's writers and readers, as functions and as Learner methods.

Every function here is a collective (all ranks call it, as they already do in a fastai DDP script): one
writer (global rank 0, from the process group, not from ``RANK``) writes atomically, a failed write or read
raises :class:`ranksafe.RankFailure` on every rank, and every load waits for the writer first. In a single
process they behave as fastai's own functions and write the same file names.

Loads are ``weights_only`` unless ``trusted=True``; the two readers of pickles (:func:`load_learner`,
:func:`load_data`) refuse to run without it.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import torch
import torch.nn as nn
from fastai.callback.core import Callback
from fastai.learner import Learner
from fastai.torch_core import get_model
from fastcore.foundation import L
from fastcore.xtras import load_pickle

from .. import saving, topology
from ..collectives import abort_on_error, barrier, together
from ..errors import UntrustedCheckpoint
from ..files import atomic_save

PathLike = str | os.PathLike


# ---------------------------------------------------------------------------------------------- functions


def _safe_globals():
    """The classes fastai allows in a weights-only load of its own model files (fastai's ``load_model``)."""
    np_core = getattr(np, "_core", None) or np.core
    allowed = [L, np_core.multiarray.scalar, np.dtype, *[getattr(np.dtypes, dt) for dt in np.dtypes.__all__]]
    return torch.serialization.safe_globals(allowed)


def _device(device: Any) -> Any:
    if isinstance(device, int):
        return torch.device("cuda", device)
    return "cpu" if device is None else device


def _is_text_learner(learn: Any) -> bool:
    text = sys.modules.get("fastai.text.learner")  # never import fastai.text just to ask
    return text is not None and isinstance(learn, text.TextLearner)


def save_model(
    file: PathLike, model: nn.Module, opt: Any, with_opt: bool = True, pickle_protocol: int = 2, **torch_save_kwargs
) -> Path:
    """fastai's ``save_model`` as a collective: rank 0 writes ``file`` atomically, failures raise everywhere."""
    if opt is None:
        with_opt = False
    state = get_model(model).state_dict()
    if with_opt:
        state = {"model": state, "opt": opt.state_dict()}
    saving.save(state, file, pickle_protocol=pickle_protocol, **torch_save_kwargs)
    return Path(file)


def _apply_state(model: nn.Module, opt: Any, state: dict, with_opt: bool | None, strict: bool, clean: bool) -> None:
    hasopt = set(state) == {"model", "opt"}
    model_state = state["model"] if hasopt else state
    if clean:
        from fastai.text.learner import clean_raw_keys

        model_state = clean_raw_keys(model_state)
    get_model(model).load_state_dict(model_state, strict=strict)
    if hasopt and with_opt is not False:
        try:
            opt.load_state_dict(state["opt"])
        except Exception:
            if with_opt:
                warnings.warn("Could not load the optimizer state.", stacklevel=3)
    elif with_opt:
        warnings.warn("Saved file doesn't contain an optimizer state.", stacklevel=3)


def load_model(
    file: PathLike,
    model: nn.Module,
    opt: Any,
    with_opt: bool | None = True,
    device: Any = None,
    strict: bool = True,
    trusted: bool = False,
    clean_keys: bool = False,
    **torch_load_kwargs: Any,
) -> None:
    """fastai's ``load_model`` as a collective: waits for the writer, raises the same error on every rank.

    Weights-only unless ``trusted``. A ``weights_only`` argument (fastai's ``SaveModelCallback`` passes
    ``weights_only=False`` for the file it wrote itself) is ignored: a model file never needs a full
    unpickler, and opting in is spelled ``trusted=True`` throughout ranksafe. ``clean_keys``: drop the
    legacy ``*_raw`` keys of old text models, as ``TextLearner.load`` does.
    """
    torch_load_kwargs.pop("weights_only", None)
    with _safe_globals():
        state = saving.load(file, map_location=_device(device), weights_only=not trusted, **torch_load_kwargs)
    with together("load_state_dict", what=f"load_state_dict {file}"):
        _apply_state(model, opt, state, with_opt, strict, clean_keys)


def _encoder(learn: Learner) -> nn.Module:
    encoder = get_model(learn.model)[0]
    return encoder.module if hasattr(encoder, "module") else encoder


def _model_file(learn: Learner, file: Any) -> Any:
    """``path/model_dir/file.pth`` like fastai's ``join_path_file``, minus its mkdir on every rank.

    The writer creates the directory inside the collective save, so a failure to create it is shared.
    """
    if not isinstance(file, str | Path):
        return file
    return Path(learn.path) / learn.model_dir / f"{file}.pth"


def save_encoder(learn: Learner, file: str) -> Path:
    """``TextLearner.save_encoder`` as a collective: rank 0 writes ``path/model_dir/file.pth`` atomically."""
    target = _model_file(learn, file)
    saving.save(_encoder(learn).state_dict(), target)
    return target


def load_encoder(learn: Learner, file: str, device: Any = None, trusted: bool = False) -> Learner:
    """``TextLearner.load_encoder`` as a collective (barrier inside, same error on every rank); freezes."""
    if device is None:
        device = learn.dls.device
    target = _model_file(learn, file)
    wgts = saving.load(target, map_location=device, weights_only=not trusted)
    from fastai.text.learner import clean_raw_keys

    with together("load_state_dict", what=f"load_state_dict {target}"):
        _encoder(learn).load_state_dict(clean_raw_keys(wgts))
    learn.freeze()
    return learn


class _PlainUnpickler(pickle.Unpickler):
    """Reads pickles of built-in containers and strings (a vocabulary) and refuses any class or function."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refusing to import {module}.{name} from an untrusted pickle")


def _read_pickle(fname: PathLike, trusted: bool) -> Any:
    if trusted:
        return load_pickle(fname)
    with open(fname, "rb") as f:
        try:
            return _PlainUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise UntrustedCheckpoint(fname, str(e)) from e


def load_pretrained(
    learn: Learner, wgts_fname: PathLike, vocab_fname: PathLike, model: nn.Module | None = None, trusted: bool = False
) -> Learner:
    """``TextLearner.load_pretrained`` as a collective: barrier first, the same error on every rank.

    The vocabulary pickle is read with an unpickler that accepts only built-in containers and strings
    unless ``trusted``.
    """
    from fastai.text.learner import _get_text_vocab, clean_raw_keys, load_ignore_keys, match_embeds

    wgts = saving.load(wgts_fname, map_location="cpu", weights_only=not trusted)
    old_vocab = None
    with together("load vocabulary", what=f"load vocabulary {vocab_fname}"):
        old_vocab = _read_pickle(vocab_fname, trusted)
    with together("load_state_dict", what=f"load_state_dict {wgts_fname}"):
        if "model" in wgts:
            wgts = wgts["model"]
        wgts = match_embeds(wgts, old_vocab, _get_text_vocab(learn.dls))
        load_ignore_keys(learn.model if model is None else model, clean_raw_keys(wgts))
    learn.freeze()
    return learn


def export_data(obj: Any, fname: PathLike, pickle_protocol: int = 2) -> Path:
    """Pickle a fastai object (``DataLoaders``, ``TabularPandas``, a vocabulary...) from rank 0, atomically.

    Collective. Read it back with :func:`load_data` (``trusted=True``: it is a pickle).
    """
    saving.save(obj, fname, pickle_protocol=pickle_protocol)
    return Path(fname)


def load_data(fname: PathLike, trusted: bool = False, map_location: Any = "cpu") -> Any:
    """Load an object written by :func:`export_data` on every rank; collective, needs ``trusted=True``."""
    if not trusted:
        raise UntrustedCheckpoint(fname, "exported data is a pickle; pass trusted=True if you trust the file")
    return saving.load(fname, map_location=map_location, weights_only=False)


def load_learner(fname: PathLike, cpu: bool = True, pickle_module: Any = pickle, trusted: bool = False) -> Learner:
    """fastai's ``load_learner`` as a collective (barrier first); it unpickles, so it needs ``trusted=True``.

    A loaded Learner that was exported with the :class:`RankSafe` callback gets its rank-safe methods back.
    """
    if not trusted:
        raise UntrustedCheckpoint(fname, "an exported Learner is a pickle; pass trusted=True if you trust the file")
    from fastai.torch_core import default_device

    map_loc = "cpu" if cpu else default_device()
    res = saving.load(fname, map_location=map_loc, weights_only=False, pickle_module=pickle_module)
    if cpu:
        res.dls.cpu()
        if hasattr(res, "channels_last"):
            res = res.to_contiguous(to_fp32=True)
        elif hasattr(res, "mixed_precision"):
            res = res.to_fp32()
        elif hasattr(res, "non_native_mixed_precision"):
            res = res.to_non_native_fp32()
    for cb in res.cbs:
        reattach = getattr(cb, "reattach", None)
        if callable(reattach):
            reattach()
    return res


# --------------------------------------------------------------------------- Learner method implementations


def learner_save(self: Learner, file: Any, **kwargs: Any) -> Any:
    """Save model and optimizer state (if ``with_opt``) to ``self.path/self.model_dir/file.pth``; collective."""
    target = _model_file(self, file)
    if not isinstance(target, Path):  # a file object belongs to this process alone
        state = get_model(self.model).state_dict()
        if kwargs.get("with_opt", True) and self.opt is not None:
            state = {"model": state, "opt": self.opt.state_dict()}
        torch.save(state, target, pickle_protocol=kwargs.get("pickle_protocol", 2))
        return target
    save_model(target, self.model, getattr(self, "opt", None), **kwargs)
    return target


def learner_load(self: Learner, file: Any, device: Any = None, **kwargs: Any) -> Learner:
    """Load model and optimizer state from ``self.path/self.model_dir/file.pth``; collective, barrier inside."""
    if device is None and hasattr(self.dls, "device"):
        device = self.dls.device
    if self.opt is None:
        self.create_opt()
    if _is_text_learner(self):  # TextLearner.load: legacy raw keys, optimizer loaded only when present
        kwargs.setdefault("with_opt", None)
        kwargs["clean_keys"] = True
    load_model(_model_file(self, file), self.model, self.opt, device=device, **kwargs)
    return self


def learner_export(
    self: Learner, fname: PathLike = "export.pkl", pickle_module: Any = cloudpickle, pickle_protocol: int = 2
) -> Path:
    """Export the Learner for inference (no data, no optimizer state), from rank 0, atomically; collective."""
    target = Path(self.path) / fname
    with together("export", what=f"export {target}"):
        if topology.is_main():
            self._end_cleanup()
            old_dls, state = self.dls, (self.opt.state_dict() if self.opt is not None else None)
            self.dls, self.opt = self.dls.new_empty(), None
            methods = {k: self.__dict__.pop(k) for k in list(self.__dict__) if k in LEARNER_METHODS}
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # PyTorch's warning about unchecked module sources
                    atomic_save(self, target, pickle_module=pickle_module, pickle_protocol=pickle_protocol)
            finally:
                self.__dict__.update(methods)
                self.create_opt()
                if state is not None:
                    self.opt.load_state_dict(state)
                self.dls = old_dls
    return target


class _SavePreds(Callback):
    """Writes ``get_preds``' per-batch predictions/targets once, from rank 0, atomically (after gathering)."""

    order = 1  # after GatherPredsCallback

    def __init__(self, save_preds: PathLike | None, save_targs: PathLike | None, pickle_protocol: int = 2):
        self.save_preds_to, self.save_targs_to, self.protocol = save_preds, save_targs, pickle_protocol

    def after_batch(self) -> None:
        if getattr(self.learn, "pred", None) is None:
            return
        preds, targs = self.learn.to_detach(self.learn.pred), self.learn.to_detach(self.learn.yb)
        if self.save_preds_to is not None:
            saving.save(preds, Path(self.save_preds_to) / str(self.learn.iter), pickle_protocol=self.protocol)
        if self.save_targs_to is not None:
            saving.save(targs[0], Path(self.save_targs_to) / str(self.learn.iter), pickle_protocol=self.protocol)


def _stock(self: Learner, name: str) -> Callable:
    """The method ``name`` that ranksafe's version replaces: the next class's in a mixin, else the class's."""
    if isinstance(self, RankSafeLearner):
        return getattr(super(RankSafeLearner, self), name)
    return types.MethodType(getattr(type(self), name), self)


def learner_get_preds(self: Learner, *args: Any, save_preds=None, save_targs=None, cbs=None, **kwargs: Any):
    """``get_preds``; with ``save_preds``/``save_targs`` each batch file is written once, atomically.

    Outside ``distrib_ctx`` every rank predicts on the whole loader, and fastai (which sees ``WORLD_SIZE``) would
    still gather every batch from every rank: each batch twice on 2 ranks, and after its reordering the first
    half of the doubled rows, wrong predictions and targets. Batches are gathered only from a sharded loader.
    """
    stock = _stock(self, "get_preds")
    if save_preds is not None or save_targs is not None:
        cbs = [*L(cbs), _SavePreds(save_preds, save_targs, kwargs.get("pickle_protocol", 2))]
    had = self.__dict__.get("to_detach")
    self.__dict__["to_detach"] = types.MethodType(_to_detach_sharded_only, self)
    try:
        return stock(*args, cbs=cbs, **kwargs)
    finally:
        if had is None:
            del self.__dict__["to_detach"]
        else:
            self.__dict__["to_detach"] = had


def _to_detach_sharded_only(self: Learner, b: Any, cpu: bool = True, gather: bool = True) -> Any:
    """``Learner.to_detach`` that gathers only from a sharded loader (one with its own ``to_detach``:
    fastai's ``DistributedDL``); an unsharded one holds the same batches on every rank."""
    dl = getattr(self, "dl", None)
    return type(self).to_detach(self, b, cpu, gather and hasattr(dl, "to_detach"))


def learner_save_encoder(self: Learner, file: str) -> Path:
    return save_encoder(self, file)


def learner_load_encoder(self: Learner, file: str, device: Any = None, trusted: bool = False) -> Learner:
    return load_encoder(self, file, device=device, trusted=trusted)


def learner_load_pretrained(
    self: Learner, wgts_fname: PathLike, vocab_fname: PathLike, model: nn.Module | None = None, trusted: bool = False
) -> Learner:
    return load_pretrained(self, wgts_fname, vocab_fname, model=model, trusted=trusted)


for _f, _doc in (
    (learner_save_encoder, save_encoder.__doc__),
    (learner_load_encoder, load_encoder.__doc__),
    (learner_load_pretrained, load_pretrained.__doc__),
):
    _f.__doc__ = _doc


def opens_fit(learn: Learner) -> bool:
    """Whether this ``before_fit`` opens a ``fit``.

    ``validate``, ``get_preds`` and ``tta`` fire ``before_fit`` too (also from inside a fit, when a callback
    calls them), always holding fastai's ``Learner.lock`` (``validation_context``); ``fit`` never holds it. So
    the answer holds however the fit started: RankSafe passed in ``fit(cbs=...)``, or a callback validating in
    its own ``before_fit`` before RankSafe's runs.
    """
    return not learn.lock.locked()


_wrapped = threading.local()  # how many _fit calls this thread is inside


def inside_wrapped_fit() -> bool:
    """Whether this thread runs a ``fit`` that :func:`_fit` wraps (the Learner has RankSafe attached)."""
    return getattr(_wrapped, "depth", 0) > 0


def _fit(learn: Learner, fit: Callable[[], None]) -> None:
    """Run ``fit`` under :func:`ranksafe.abort_on_error`, then meet the other ranks (one barrier).

    If it raises, the :class:`RankSafe` callbacks release what they hold (``fit_failed``): fastai calls
    no ``after_fit`` then. The barrier at the end is where the other ranks hear of a failure in a callback that
    runs after RankSafe's last collective (a later ``after_epoch`` of the last epoch, any ``after_fit``): without
    it, a rank failing there alone was never reported, and the others went on.
    """
    from .callback import RankSafe

    _wrapped.depth = getattr(_wrapped, "depth", 0) + 1
    try:
        with abort_on_error():
            fit()
    except BaseException:
        for cb in learn.cbs:
            if isinstance(cb, RankSafe):
                cb.fit_failed()
        raise
    finally:
        _wrapped.depth -= 1
    barrier("fastai: fit end")


def learner_fit(self: Learner, *args: Any, **kwargs: Any) -> None:
    """``Learner.fit`` whose exception on one rank reaches every rank within seconds (:func:`ranksafe.abort_on_error`).

    Without it, a rank that raises in a callback leaves the others waiting at their next collective until
    the timeout.
    """
    _fit(self, lambda: type(self).fit(self, *args, **kwargs))


def learner_resume(self: Learner, resume: bool = True) -> Learner:
    """Make the next ``fit`` continue from the newest checkpoint every rank has; returns the Learner.

    Needs ``RankSafe(checkpoint_dir=...)``. Local (every rank calls it, as every rank calls ``fit``); the
    checkpoint is read at the start of the ``fit``: ``learn.resume().fit_one_cycle(10)``. Without any
    checkpoint yet the fit starts from scratch. In a script with several fits (``fine_tune``) run again from
    its start, the fits the checkpoint shows finished are skipped and the one that wrote it continues.
    """
    from .callback import RankSafe

    cb = next((cb for cb in self.cbs if isinstance(cb, RankSafe)), None)
    if cb is None or cb.checkpoint_dir is None:
        raise ValueError("learn.resume() needs the RankSafe(checkpoint_dir=...) callback on the Learner")
    cb.resume_pending = resume
    return self


LEARNER_METHODS: dict[str, Callable] = {
    "fit": learner_fit,
    "save": learner_save,
    "load": learner_load,
    "export": learner_export,
    "get_preds": learner_get_preds,
    "save_encoder": learner_save_encoder,
    "load_encoder": learner_load_encoder,
    "load_pretrained": learner_load_pretrained,
    "resume": learner_resume,
}
"""Methods the :class:`RankSafe` callback installs on its Learner (those the Learner's class has, and NEW_METHODS)."""

NEW_METHODS = frozenset({"resume"})
"""Methods fastai's Learner does not have, installed on every Learner."""


class RankSafeLearner:
    """Mixin that makes a Learner class rank-safe: ``class MyLearner(RankSafeLearner, TextLearner)``.

    Its ``save``/``load``/``export``/``get_preds`` (and the text learners' encoder and pretrained loaders)
    are the collective versions above, and every instance gets the :class:`RankSafe` callback for the
    decisions taken during ``fit`` (trackers, CSV log, ``lr_find``).
    """

    def fit(self, *args: Any, **kwargs: Any) -> None:
        """``fit`` whose exception on one rank reaches every rank within seconds (:func:`ranksafe.abort_on_error`)."""
        _fit(self, lambda: super(RankSafeLearner, self).fit(*args, **kwargs))  # type: ignore[misc]

    save = learner_save
    load = learner_load
    export = learner_export
    get_preds = learner_get_preds
    save_encoder = learner_save_encoder
    load_encoder = learner_load_encoder
    load_pretrained = learner_load_pretrained
    resume = learner_resume

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from .callback import RankSafe
        from .cpu import prepare_distributed

        prepare_distributed()  # before any Accelerator exists: distrib_ctx must see the process group's ranks
        super().__init__(*args, **kwargs)
        if not any(isinstance(cb, RankSafe) for cb in self.cbs):
            self.add_cb(RankSafe())
