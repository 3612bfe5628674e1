"""A Learner with RankSafe attached pickles (pickle, cloudpickle, ``learn.export()``) during a fit and after it, and
the exported Learner loads with ranksafe's ``load_learner`` and with fastai's own, its rank-safe methods intact.

One process: the multi-rank run of tests/test_fastai.py checks the callbacks RankSafe guards during a DDP fit.
"""

from __future__ import annotations

import functools
import pickle
import types

import pytest

pytest.importorskip("fastai")

import cloudpickle
from fastai.callback.tracker import TerminateOnNaNCallback
from fastai.learner import Learner
from fastai.learner import load_learner as fastai_load_learner
from fastai.tabular.all import Callback, MSELossFlat

import ranksafe.fastai as rf
from ranksafe.fastai import RankSafe, callback, learner
from tests.test_fastai import LEARNER_METHODS, Lin, _learner, bound_to_itself, params, tabular_dls


class Snapshot(Callback):
    """At the end of epoch 0, inside the fit: the Learner through pickle and cloudpickle, and exported."""

    order = 90

    def after_epoch(self):
        if self.epoch == 0:
            copies = {f"during {m.__name__}": m.loads(m.dumps(self.learn)) for m in (pickle, cloudpickle)}
            vars(self).update(copies=copies, params=params(self.learn), exported=self.learn.export("during.pkl"))


def _ranksafe(learn: Learner) -> RankSafe:
    return next(cb for cb in learn.cbs if isinstance(cb, RankSafe))


def test_a_learner_with_ranksafe_pickles_and_exports_during_a_fit_and_after_it(tmp_path):
    cbs = [RankSafe(checkpoint_dir="ckpt", async_save=True), TerminateOnNaNCallback()]  # a writer thread, a lock
    learn = Learner(tabular_dls(tmp_path), Lin(), loss_func=MSELossFlat(), path=tmp_path, cbs=cbs)
    snapshot = Snapshot()
    with learn.no_bar(), learn.no_logging():
        learn.fit(2, 1e-2, cbs=snapshot)
    after = {f"after {m.__name__}": m.loads(m.dumps(learn)) for m in (pickle, cloudpickle)}
    learn.export("after.pkl")
    loaded = {
        f"{fname} {how}": load(tmp_path / fname)
        for fname in ("during.pkl", "after.pkl")
        for how, load in (
            ("ranksafe", functools.partial(rf.load_learner, trusted=True)),
            ("fastai", fastai_load_learner),
        )
    }
    for name, copy in {**snapshot.copies, **after, **loaded}.items():
        want = snapshot.params if name.startswith("during") else params(learn)
        assert params(copy) == want, name
        assert bound_to_itself(copy) == LEARNER_METHODS, name  # the rank-safe methods, on the copy
        cb = _ranksafe(copy)
        assert cb.learn is copy and vars(cb)["_fit"] is None and cb.manager is None, name  # no fit, no writer thread
        assert vars(copy)["fit"].func is callback.fit and vars(copy)["save"].func is learner.save, name
    # the copy is a Learner like the original: it trains, and its RankSafe checkpoints
    again = loaded["during.pkl fastai"]
    again.dls = tabular_dls(tmp_path)  # an exported Learner has empty loaders
    with again.no_bar(), again.no_logging():
        again.fit(1, 1e-2)
    assert _ranksafe(again).manager.latest() == 2  # after the original fit's steps 0 and 1


def test_taken_off_the_learner_ranksafe_leaves_fastais_own_methods(tmp_path):
    learn = _learner(tmp_path, True)
    learn.remove_cb(RankSafe)
    assert bound_to_itself(learn) == [] and learn.save.__func__ is Learner.save
    assert bound_to_itself(pickle.loads(pickle.dumps(learn))) == []


def test_the_control_a_bound_method_comes_back_from_pickle_as_fastais_own(tmp_path):
    """Why the methods are partials: pickle stores a bound method as "look this name up on the object", so the copy
    of a Learner given ranksafe's ``save`` as a bound method gets fastai's ``save`` back, silently (cloudpickle keeps
    it)."""
    learn = _learner(tmp_path, False)
    vars(learn)["save"] = types.MethodType(learner.save, learn)
    assert pickle.loads(pickle.dumps(learn)).save.__func__ is Learner.save
    assert cloudpickle.loads(cloudpickle.dumps(learn)).save.__func__ is learner.save
