"""Rank-safe versions of fastai's writers and readers, as functions and as Learner methods.

Every function here is a collective (all ranks call it, as in any fastai DDP script): global rank 0 writes atomically,
a failed write or read raises :class:`ranksafe.RankFailure` on every rank, and every load waits for the writer. In a
single process they write what fastai's own write. Loads are ``weights_only`` unless ``trusted=True``; the readers of
pickles (:func:`load_learner`, :func:`load_data`) refuse to run without it. The methods (:func:`save`, :func:`load`,
:func:`export`, :func:`get_preds`, :func:`validate`, :func:`tta`, :func:`summary`) take the Learner first: they are
``RankSafeLearner``'s, and RankSafe makes them one Learner instance's own.
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import cloudpickle
import fastai.callback.hook  # noqa: F401  # patches Learner.summary, which RankSafe installs its own of
import numpy as np
import torch
import torch.nn as nn
from fastai.callback.core import Callback
from fastai.learner import Learner
from fastai.torch_core import default_device, get_model
from fastcore.foundation import L
from fastcore.xtras import load_pickle

from .. import remote, saving, topology
from ..checkpoint_file import load_plain_pickle, save_file
from ..collectives import together
from ..errors import UntrustedCheckpoint
from . import compat
from .steps import fit_callbacks

PathLike = str | os.PathLike


def _safe_globals() -> Any:
    """The classes fastai allows in a weights-only load of its own model files (fastai's ``load_model``)."""
    allowed = [L, compat.numpy_scalar(), np.dtype, *[getattr(np.dtypes, dt) for dt in np.dtypes.__all__]]
    return torch.serialization.safe_globals(allowed)


def _text() -> Any:
    """fastai's text module, imported only when a text model is at hand."""
    import fastai.text.learner

    return fastai.text.learner


def _model_state(model: nn.Module, opt: Any, with_opt: bool) -> dict[str, Any]:
    """What fastai's ``save_model`` writes: the model's state, beside the optimizer's when ``with_opt``."""
    state = get_model(model).state_dict()
    return {"model": state, "opt": opt.state_dict()} if with_opt and opt is not None else state


def save_model(
    file: PathLike, model: nn.Module, opt: Any, with_opt: bool = True, pickle_protocol: int = 2, **torch_save_kwargs
) -> Path:
    """fastai's ``save_model`` as a collective: rank 0 writes ``file`` atomically, failures raise everywhere."""
    saving.save(_model_state(model, opt, with_opt), file, pickle_protocol=pickle_protocol, **torch_save_kwargs)
    return Path(file)


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

    Weights-only unless ``trusted`` (a ``weights_only`` argument, which ``SaveModelCallback`` passes, is ignored: a
    model file needs no full unpickler). ``clean_keys``: drop old text models' ``*_raw`` keys, and take
    ``with_opt=None`` for a yes, as ``TextLearner.load``. A file object is this process's own: read here alone.
    """
    torch_load_kwargs.pop("weights_only", None)
    device = torch.device("cuda", device) if isinstance(device, int) else device or "cpu"
    with _safe_globals():
        if isinstance(file, str | os.PathLike):
            state = saving.load(file, map_location=device, weights_only=not trusted, **torch_load_kwargs)
        else:
            state = torch.load(file, map_location=device, weights_only=not trusted, **torch_load_kwargs)
    with together("load_state_dict", what=f"load_state_dict {file}"):
        hasopt = set(state) == {"model", "opt"}
        model_state = state["model"] if hasopt else state
        get_model(model).load_state_dict(_text().clean_raw_keys(model_state) if clean_keys else model_state, strict)
        if hasopt and (with_opt or (with_opt is None and clean_keys)):
            try:
                opt.load_state_dict(state["opt"])
            except Exception:
                if with_opt:
                    warnings.warn("Could not load the optimizer state.", stacklevel=3)
        elif with_opt:
            warnings.warn("Saved file doesn't contain an optimizer state.", stacklevel=3)


def _encoder(learn: Learner) -> nn.Module:
    encoder = get_model(learn.model)[0]
    return encoder.module if hasattr(encoder, "module") else encoder


def _model_file(learn: Learner, file: Any) -> Any:
    """``path/model_dir/file.pth`` as fastai's ``join_path_file`` makes it, minus its mkdir on every rank (the
    writer creates the directory inside the collective save, so a failure to create it is shared)."""
    return remote.joinpath(learn.path, learn.model_dir, f"{file}.pth") if isinstance(file, str | Path) else file


def save_encoder(learn: Learner, file: str) -> Path:
    """``TextLearner.save_encoder`` as a collective: rank 0 writes ``path/model_dir/file.pth`` atomically."""
    target = _model_file(learn, file)
    saving.save(_encoder(learn).state_dict(), target)
    return target


def load_encoder(learn: Learner, file: str, device: Any = None, trusted: bool = False) -> Learner:
    """``TextLearner.load_encoder`` as a collective (barrier inside, same error on every rank); freezes."""
    target = _model_file(learn, file)
    wgts = saving.load(target, map_location=learn.dls.device if device is None else device, weights_only=not trusted)
    with together("load_state_dict", what=f"load_state_dict {target}"):
        _encoder(learn).load_state_dict(_text().clean_raw_keys(wgts))
    learn.freeze()
    return learn


def _read_vocab(fname: PathLike, trusted: bool) -> Any:
    """The vocabulary pickle at ``fname``: a local path, or a URL (as the weights beside it may be)."""
    if trusted and not remote.is_url(fname):
        return load_pickle(fname)  # fastai's own reader (it also opens .gz and .bz2)
    data = remote.Remote.of(fname).read() if remote.is_url(fname) else Path(fname).read_bytes()
    return pickle.loads(data) if trusted else load_plain_pickle(data, fname)


def load_pretrained(
    learn: Learner, wgts_fname: PathLike, vocab_fname: PathLike, model: nn.Module | None = None, trusted: bool = False
) -> Learner:
    """``TextLearner.load_pretrained`` as a collective; the vocabulary pickle is read with an unpickler that accepts
    only built-in containers and strings unless ``trusted``."""
    text = _text()
    wgts = saving.load(wgts_fname, map_location="cpu", weights_only=not trusted)
    with together("load vocabulary", what=f"load vocabulary {vocab_fname}"):
        old_vocab = _read_vocab(vocab_fname, trusted)
    with together("load_state_dict", what=f"load_state_dict {wgts_fname}"):
        wgts = wgts.get("model", wgts)  # saved with an optimizer, or not
        vocab = learn.dls.vocab
        wgts = text.match_embeds(wgts, old_vocab, vocab[0] if isinstance(vocab, L) else vocab)
        text.load_ignore_keys(learn.model if model is None else model, text.clean_raw_keys(wgts))
    learn.freeze()
    return learn


def export_data(obj: Any, fname: PathLike, pickle_protocol: int = 2) -> Path:
    """Pickle a fastai object (``DataLoaders``, ``TabularPandas``...) from rank 0, atomically; collective. Read it
    back with :func:`load_data` (``trusted=True``: it is a pickle)."""
    saving.save(obj, fname, pickle_protocol=pickle_protocol)
    return Path(fname)


def load_data(fname: PathLike, trusted: bool = False, map_location: Any = "cpu") -> Any:
    """Load an object written by :func:`export_data` on every rank; collective, needs ``trusted=True``."""
    if not trusted:
        raise UntrustedCheckpoint(fname, "exported data is a pickle; pass trusted=True if you trust the file")
    return saving.load(fname, map_location=map_location, weights_only=False)


def load_learner(fname: PathLike, cpu: bool = True, pickle_module: Any = pickle, trusted: bool = False) -> Learner:
    """fastai's ``load_learner`` as a collective (barrier first); it unpickles, so it needs ``trusted=True``. A
    Learner exported with :class:`~ranksafe.fastai.RankSafe` comes back with its rank-safe methods (from fastai's
    ``load_learner`` too)."""
    if not trusted:
        raise UntrustedCheckpoint(fname, "an exported Learner is a pickle; pass trusted=True if you trust the file")
    res = saving.load(
        fname, map_location="cpu" if cpu else default_device(), weights_only=False, pickle_module=pickle_module
    )
    if cpu:
        res.dls.cpu()
        if hasattr(res, "channels_last"):
            res = res.to_contiguous(to_fp32=True)
        elif hasattr(res, "mixed_precision"):
            res = res.to_fp32()
        elif hasattr(res, "non_native_mixed_precision"):
            res = res.to_non_native_fp32()
    return res


# ------------------------------------------------------------------------------------------- Learner methods


def save(learn: Learner, file: Any, **kwargs: Any) -> Any:
    """Save model and optimizer state (if ``with_opt``) to ``path/model_dir/file.pth``; collective."""
    target = _model_file(learn, file)
    if isinstance(target, str | Path):  # a path or a URL; else a file object
        return save_model(target, learn.model, getattr(learn, "opt", None), **kwargs)
    state = _model_state(learn.model, learn.opt, kwargs.get("with_opt", True))
    torch.save(state, target, pickle_protocol=kwargs.get("pickle_protocol", 2))  # a file object: this process's own
    return target


def load(learn: Learner, file: Any, device: Any = None, **kwargs: Any) -> Learner:
    """Load model and optimizer state from ``path/model_dir/file.pth``; collective, barrier inside."""
    if device is None and hasattr(learn.dls, "device"):
        device = learn.dls.device
    if learn.opt is None:
        learn.create_opt()
    text = sys.modules.get("fastai.text.learner")  # never imported just to ask
    if text is not None and isinstance(learn, text.TextLearner):  # as TextLearner.load: legacy keys, optional opt
        kwargs.setdefault("with_opt", None)
        kwargs["clean_keys"] = True
    load_model(_model_file(learn, file), learn.model, learn.opt, device=device, **kwargs)
    return learn


def export(
    learn: Learner, fname: PathLike = "export.pkl", pickle_module: Any = cloudpickle, pickle_protocol: int = 2
) -> Path:
    """Export the Learner for inference (no data, no optimizer state), from rank 0, atomically; collective. Called
    during a fit, the callbacks of that fit alone (a resume's epoch skipper) stay out: the exported Learner's next fit
    starts at epoch 0."""
    target = remote.joinpath(learn.path, fname)
    with together("export", what=f"export {target}"):
        if topology.is_main():
            compat.end_cleanup(learn)
            old_dls, state = learn.dls, (learn.opt.state_dict() if learn.opt is not None else None)
            learn.dls, learn.opt = learn.dls.new_empty(), None
            try:
                with warnings.catch_warnings(), learn.removed_cbs(fit_callbacks(learn)):
                    warnings.simplefilter("ignore")  # PyTorch's warning about unchecked module sources
                    pickling = {"pickle_module": pickle_module, "pickle_protocol": pickle_protocol}
                    save_file(learn, target, action="cannot export to", **pickling)
            finally:
                learn.create_opt()
                if state is not None:
                    learn.opt.load_state_dict(state)
                learn.dls = old_dls
    return target


class _SavePreds(Callback):
    """Writes ``get_preds``' per-batch predictions/targets once, from rank 0, atomically (after gathering)."""

    order = 1  # after GatherPredsCallback

    def __init__(self, save_preds: PathLike | None, save_targs: PathLike | None, pickle_protocol: int = 2):
        self.save_preds_to, self.save_targs_to, self.protocol = save_preds, save_targs, pickle_protocol

    def after_batch(self) -> None:
        if getattr(self.learn, "pred", None) is None:
            return
        for where, value in ((self.save_preds_to, self.learn.pred), (self.save_targs_to, self.learn.yb[0])):
            if where is not None:
                saving.save(
                    self.learn.to_detach(value), Path(where) / str(self.learn.iter), pickle_protocol=self.protocol
                )


def get_preds(learn: Learner, *args: Any, save_preds=None, save_targs=None, cbs=None, **kwargs: Any):
    """``get_preds``; with ``save_preds``/``save_targs`` each batch file is written once, atomically. Batches are
    gathered only from a sharded loader: outside ``distrib_ctx`` every rank predicts on the whole loader, and fastai
    (which sees ``WORLD_SIZE``) gathered every batch from every rank, returning the first half of the doubled rows."""
    if save_preds is not None or save_targs is not None:
        cbs = [*L(cbs), _SavePreds(save_preds, save_targs, kwargs.get("pickle_protocol", 2))]
    with _gathering_from_sharded_loaders_only(learn):
        return stock_method(learn, "get_preds", get_preds)(*args, cbs=cbs, **kwargs)


def tta(learn: Learner, *args: Any, **kwargs: Any) -> Any:
    """``tta``, which sends fit events of its own around its predictions: no fit to RankSafe (see :func:`no_fit`).
    One rank may run it alone, as :func:`get_preds`."""
    with no_fit(learn):
        return stock_method(learn, "tta", tta)(*args, **kwargs)


def summary(learn: Learner, *args: Any, **kwargs: Any) -> Any:
    """``summary``, which runs the model on one batch between fit events of its own: no fit to RankSafe (see
    :func:`no_fit`)."""
    with no_fit(learn):
        return stock_method(learn, "summary", summary)(*args, **kwargs)


_PASSES: dict[int, int] = {}
"""Learners inside a pass that is no fit (:func:`no_fit`), by id: how many such passes each is inside."""


@contextmanager
def no_fit(learn: Learner) -> Iterator[None]:
    """A pass that sends ``before_fit`` and ``after_fit`` of its own outside ``learn.lock`` (which marks validate and
    get_preds): RankSafe must not take it for a fit, which would open the checkpoints, use up a resume, save a step
    and meet the other ranks."""
    _PASSES[id(learn)] = _PASSES.get(id(learn), 0) + 1
    try:
        yield
    finally:
        if left := _PASSES.pop(id(learn)) - 1:
            _PASSES[id(learn)] = left


def in_a_pass(learn: Learner) -> bool:
    """Whether ``learn`` runs a pass that is no fit: validate or get_preds (they hold ``learn.lock``), or
    :func:`no_fit`'s (tta, summary)."""
    return learn.lock.locked() or id(learn) in _PASSES


def validate(learn: Learner, *args: Any, **kwargs: Any) -> Any:
    """``validate``, gathering batches only from a sharded loader, as :func:`get_preds`: outside ``distrib_ctx``
    one rank may validate alone (``if rank == 0: learn.validate()``), where fastai's loss and metrics waited for
    the other ranks in a gather they never joined."""
    with _gathering_from_sharded_loaders_only(learn):
        return stock_method(learn, "validate", validate)(*args, **kwargs)


@contextmanager
def _gathering_from_sharded_loaders_only(learn: Learner) -> Iterator[None]:
    """``learn.to_detach`` is :func:`_to_detach_sharded_only` meanwhile (fastai's loss, metrics and predictions all
    gather through it)."""
    had = vars(learn).get("to_detach")
    vars(learn)["to_detach"] = partial(_to_detach_sharded_only, learn)
    try:
        yield
    finally:
        if had is None:
            del vars(learn)["to_detach"]
        else:
            vars(learn)["to_detach"] = had


def _to_detach_sharded_only(learn: Learner, b: Any, cpu: bool = True, gather: bool = True) -> Any:
    """``Learner.to_detach`` that gathers only from a sharded loader (one with its own ``to_detach``: fastai's
    ``DistributedDL``); an unsharded one holds the same batches on every rank."""
    return type(learn).to_detach(learn, b, cpu, gather and hasattr(getattr(learn, "dl", None), "to_detach"))


def stock_method(learn: Learner, name: str, ours: Callable[..., Any]) -> Callable[..., Any]:
    """The method ``name`` that ``ours`` stands in for: the next class's after the mixin, else the class's own."""
    mro = type(learn).__mro__
    owner = next((k for k in mro if vars(k).get(name) is ours), None)
    return getattr(super(owner, learn), name) if owner is not None else partial(getattr(type(learn), name), learn)
