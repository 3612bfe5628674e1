"""fastai checkpoints on real ranks: RankSafe(checkpoint_dir=...) saves resumable state, resume continues it,
async_save writes the same files in the background, and a failed background write stops every rank.

One 2-rank run does it all (fastai's import costs seconds per process); the tiny tabular Learner of
tests/test_fastai.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

import pytest

pytest.importorskip("fastai")

import torch
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.tracker import EarlyStoppingCallback, SaveModelCallback, TrackerCallback
from fastai.data.core import Datasets
from fastai.tabular.all import Callback, CancelBatchException, CancelTrainException, Learner, MSELossFlat
from fastai.torch_core import set_seed
from torch.amp import GradScaler, autocast

import ranksafe
from ranksafe import exchange as protocol
from ranksafe.commit import read_manifest
from ranksafe.fastai import RankSafe
from ranksafe.fastai import steps as fastai_steps
from ranksafe.steps import list_steps
from tests.ranks import run_ranks
from tests.test_fastai import Lin, params, tabular_dls


class Watch(Callback):
    """The epochs that trained, the weights and optimizer state they started from, the collectives per epoch."""

    order = 56

    def before_fit(self):
        self.trained, self.start, self.opt_start, self.seqs = [], None, None, []

    def before_train(self):
        if self.start is None:
            self.start = params(self.learn)
            self.opt_start = _opt_sum(self.learn.opt.state_dict())
        self.trained.append(self.epoch)

    def after_epoch(self):
        s = protocol._session
        self.seqs.append(s.seq if s is not None else None)


def _opt_sum(opt_state) -> float:
    states = opt_state["state"]  # a list (fastai's Optimizer) or a dict by parameter index (torch's, OptimWrapper)
    states = states.values() if isinstance(states, dict) else states
    return sum(float(t.double().sum()) for s in states for t in s.values() if torch.is_tensor(t))


def _learner(root, seed, cb) -> Learner:
    set_seed(seed, reproducible=True)  # python, numpy, torch: the data order and the initial weights
    return Learner(tabular_dls(root), Lin(), loss_func=MSELossFlat(), path=root, cbs=cb)


def _fit(learn, n, *cbs: Callback) -> Watch:
    watch = Watch()
    with learn.no_bar(), learn.no_logging(), learn.distrib_ctx(sync_bn=False):
        learn.fit(n, 1e-2, cbs=[watch, *cbs])
    return watch


def _committed(root) -> list[int]:
    return [s.step for s in list_steps(root) if s.status == "committed"]


def _saver_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ranksafe")]


def _contents(step_dir) -> dict:
    """Every file of a committed step, loaded (tensors and plain values)."""
    return {name: ranksafe.load_file(os.path.join(step_dir, name)) for name in read_manifest(step_dir)["files"]}


def _checkpoints(rank, root):
    out = {}
    # 1. synchronous checkpoints, keep=2, 3 epochs; RankSafe(resume=True) with nothing saved yet starts fresh
    sync = RankSafe(checkpoint_dir="sync", keep=2, resume=True)
    a = _learner(root, 0, sync)
    watch = _fit(a, 3)
    out["a"] = {"final": params(a), "opt": _opt_sum(a.opt.state_dict()), "trained": watch.trained}
    out["a"]["recorder"] = [list(v) for v in a.recorder.values]
    out["a"]["steps"] = _committed(os.path.join(root, "sync"))

    # 2. the same training as 1 with async_save: the same files, written in the background
    cb = RankSafe(checkpoint_dir="async", keep=2, async_save=True)
    c = _learner(root, 0, cb)
    watch = _fit(c, 3)
    out["c"] = {"final": params(c), "steps": _committed(os.path.join(root, "async")), "threads": _saver_threads()}
    out["c"]["lock_free"] = cb.state_lock.acquire_write(timeout=0)
    cb.state_lock.release_write()
    if rank == 0:
        a_dir, c_dir = os.path.join(root, "sync"), os.path.join(root, "async")
        same = {}
        for step in (1, 2):
            sa = _contents(os.path.join(a_dir, f"step_{step:08d}"))
            sc = _contents(os.path.join(c_dir, f"step_{step:08d}"))
            same[step] = (sorted(sa), _equal(sa, sc))
        out["same_files"] = same

    # 3. a new Learner (other initial weights per rank) resumes from the last step; every=2 from now on
    b = _learner(root, 10 + rank, RankSafe(checkpoint_dir="sync", keep=2, every=2))
    out["b_init"] = params(b)
    watch = _fit(b.resume(), 5)
    out["b"] = {"start": watch.start, "opt_start": watch.opt_start, "trained": watch.trained, "final": params(b)}
    out["b"]["recorder"] = [list(v) for v in b.recorder.values]
    out["b"]["seq_deltas"] = [y - x for x, y in zip(watch.seqs, watch.seqs[1:], strict=False)]
    out["b"]["steps"] = _committed(os.path.join(root, "sync"))

    # 4. rank 0's background write fails (a file stands where step 0's directory must go)
    if rank == 0:
        os.makedirs(os.path.join(root, "fail"))
        open(os.path.join(root, "fail", "step_00000000"), "w").close()
    ranksafe.barrier("file in the way")
    cb = RankSafe(checkpoint_dir="fail", async_save=True)
    d = _learner(root, 0, cb)
    try:
        _fit(d, 4)
        out["d"] = {"error": None}
    except Exception as e:
        out["d"] = {"types": [t.__name__ for t in type(e).__mro__], "ranks": getattr(e, "ranks", None)}
        out["d"]["epoch"], out["d"]["msg"] = d.epoch, str(e)
    out["d"]["threads"] = _saver_threads()
    out["d"]["lock_free"] = cb.state_lock.acquire_write(timeout=0)
    return out


def _equal(x, y) -> bool:
    if torch.is_tensor(x):
        return torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y, strict=True))
    return type(x) is type(y) and x == y


def test_checkpoints_resume_async_and_background_failure_on_two_ranks(tmp_path):
    r0, r1 = run_ranks(_checkpoints, 2, args=(str(tmp_path),), timeout=300).values
    for v in (r0, r1):
        a, b, c = v["a"], v["b"], v["c"]
        # 1. three epochs, keep=2: exactly steps 1 and 2 committed (numbered by epoch)
        assert a["trained"] == [0, 1, 2] and a["steps"] == [1, 2]
        # 3. the resumed fit trains epochs 3 and 4 only, from the weights and optimizer state of step 2
        assert b["trained"] == [3, 4]
        assert b["start"] == a["final"] != v["b_init"]
        assert b["opt_start"] == a["opt"] and a["opt"] != 0
        assert b["recorder"][:3] == a["recorder"]  # the recorded history of the epochs it skipped
        assert len(b["recorder"]) == 5 and b["final"] != a["final"]
        assert b["steps"] == [2, 3]  # every=2: epoch 3 saved, epoch 4 not; keep=2
        # 2 collectives per epoch when nothing is saved (the epoch-start check, the record), 3 more per save
        assert b["seq_deltas"] == [2, 2, 5, 2], b["seq_deltas"]
        # 2. async: same training, same steps, no saver thread left, the optimizer step released the lock
        assert c["final"] == a["final"] and c["steps"] == [1, 2]
        assert c["threads"] == [] and c["lock_free"]
        # 4. the failure is raised on both ranks, naming rank 0, by the epoch after the failed save
        d = v["d"]
        assert d.get("types") and "RankFailure" in d["types"] and "OSError" in d["types"], d
        assert d["ranks"] == [0] and d["epoch"] == 1, d
        assert d["threads"] == [] and d["lock_free"]
    assert r0["a"]["final"] == r1["a"]["final"] and r0["b"]["start"] == r1["b"]["start"]
    assert r0["b_init"] != r1["b_init"]  # the ranks started from different weights before the resume
    for step, (names, same) in r0["same_files"].items():
        assert names == ["rng-00000.pt", "rng-00001.pt", "state.pt"], names
        assert same, f"step {step}: the async files differ from the sync ones"


# ------------------------------------------------------------------------------------------------ one process


class ValidateInside(Callback):
    """Calls learn.validate() at every epoch end, as some metric callbacks do: it fires before_fit/after_fit."""

    order, inside = 60, False

    def after_epoch(self):
        if not self.inside:  # validate() fires after_epoch too
            self.inside = True
            self.learn.validate()
            self.inside = False


def test_one_process_mixin_async_resume_export_and_validate_inside_fit(tmp_path):
    import ranksafe.fastai as rf

    class MyLearner(rf.RankSafeLearner, Learner):
        pass

    def make(seed):
        set_seed(seed, reproducible=True)
        cb = RankSafe(checkpoint_dir="ckpt", keep=None, async_save=True)
        return MyLearner(tabular_dls(tmp_path), Lin(), loss_func=MSELossFlat(), path=tmp_path, cbs=cb)

    learn = make(0)
    with learn.no_bar(), learn.no_logging():
        learn.fit(3, 1e-2, cbs=ValidateInside())
    # the nested validate passes neither stopped nor duplicated the checkpoints; the last one is committed
    assert _committed(tmp_path / "ckpt") == [0, 1, 2] and _saver_threads() == []
    saved = ranksafe.load_file(tmp_path / "ckpt" / "step_00000002" / "state.pt")  # weights_only: plain types
    assert saved["epoch"] == 2 and torch.equal(saved["model"]["l.weight"].flatten(), torch.tensor(params(learn)[:3]))
    learn.export("export.pkl")  # the manager, its thread and lock stay out of the pickle
    loaded = rf.load_learner(tmp_path / "export.pkl", trusted=True)
    assert params(loaded) == params(learn)

    again = make(1)
    with again.no_bar(), again.no_logging():
        watch = _fit(again.resume(), 4)
    assert watch.trained == [3] and watch.start == params(learn)
    assert _committed(tmp_path / "ckpt") == [0, 1, 2, 3]
    with again.no_bar(), again.no_logging():
        watch = _fit(again, 1)  # resume is one-shot: the next fit starts at epoch 0
    assert watch.trained == [0]


class CancelBatchAfterStep(Callback):
    """Cancels one batch per epoch in after_step, before RankSafe's after_step (order 55) could run."""

    order, cancelled = 10, 0

    def after_step(self):
        if self.iter == 2:
            self.cancelled += 1
            raise CancelBatchException()


def _read_elsewhere(lock, timeout: float) -> bool:
    """Whether another thread (where a background snapshot runs) can take the read side within ``timeout``."""
    got = []

    def read():
        if lock.acquire_read(timeout=timeout):
            got.append(True)
            lock.release_read()

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout + 5)
    return got == [True]


def test_cancelled_batch_after_the_step_leaves_the_state_lock_free(tmp_path):
    """fastai skips RankSafe's after_step for a batch cancelled there: the write side must not stay held."""
    cb = RankSafe(checkpoint_dir="ckpt", keep=None, async_save=True)
    learn, cancel = _learner(tmp_path, 0, cb), CancelBatchAfterStep()
    with learn.no_bar(), learn.no_logging():
        learn.fit(2, 1e-2, cbs=cancel)
    assert cancel.cancelled == 2 and _read_elsewhere(cb.state_lock, 2)
    assert _committed(tmp_path / "ckpt") == [0, 1] and _saver_threads() == []
    assert torch.equal(cb.manager.load()["model"]["l.weight"].flatten(), torch.tensor(params(learn)[:3]))
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-2, cbs=cancel)  # the next fit's steps take and give back the lock as before
    assert cancel.cancelled == 3 and _read_elsewhere(cb.state_lock, 2)


def _saved(root, step: int) -> dict:
    return ranksafe.load_file(os.path.join(root, f"step_{step:08d}", "state.pt"))


def _weights(state: dict) -> list[float]:
    return torch.cat([state["model"]["l.weight"].flatten(), state["model"]["l.bias"].flatten()]).tolist()


@pytest.mark.parametrize(("async_save", "keep", "steps"), [(False, None, [0, 1, 2, 3, 4]), (True, 2, [3, 4])])
def test_two_fits_number_their_checkpoints_one_after_the_other(tmp_path, async_save, keep, steps):
    """The fine_tune pattern (a frozen fit, then an unfrozen one) with one RankSafe: no step number is reused."""
    cb = RankSafe(checkpoint_dir="ckpt", keep=keep, async_save=async_save)
    learn = _learner(tmp_path, 0, cb)
    _fit(learn, 3)
    _fit(learn, 2)
    assert _committed(tmp_path / "ckpt") == steps and cb.manager.latest() == 4
    saved = [_saved(tmp_path / "ckpt", step) for step in steps]
    expected = [(0, 0, 0), (0, 1, 0), (0, 2, 0), (1, 0, 3), (1, 1, 3)][-len(steps) :]  # fit, epoch, first step
    assert [(s["fit"], s["epoch"], s["step_base"]) for s in saved] == expected
    assert _weights(saved[-1]) == params(learn)  # latest() is the end of training


class Interrupted(Exception):
    """The job was killed."""


class Crash(Callback):
    """Interrupts the run at the start of epoch ``at``, after the previous epoch's checkpoint."""

    order = 90

    def __init__(self, at: int):
        self.at = at

    def before_epoch(self):
        if self.epoch == self.at:
            raise Interrupted(f"killed at epoch {self.epoch}")


def test_rerun_of_two_fits_skips_the_finished_fit_and_resumes_the_second(tmp_path):
    """A killed two-fit script run again with resume=True ends where the uninterrupted run does.

    The tabular loader shuffles with NumPy's global generator, which the checkpoint restores: the resumed
    epoch sees the same batches, so the final weights are equal, not just close.
    """
    reference = _learner(tmp_path, 0, RankSafe(checkpoint_dir="reference"))
    _fit(reference, 3)
    _fit(reference, 2)

    # the first run: fit(3) completes, fit(2) is killed after its epoch 0 was saved (step 3)
    run = _learner(tmp_path, 0, RankSafe(checkpoint_dir="ckpt", keep=2))
    _fit(run, 3)
    with pytest.raises(Interrupted):
        _fit(run, 2, Crash(at=1))
    assert _committed(tmp_path / "ckpt") == [2, 3]
    killed_at = _weights(_saved(tmp_path / "ckpt", 3))

    # the same script again, resuming (other initial weights: what it ends with comes from the checkpoint)
    cb = RankSafe(checkpoint_dir="ckpt", keep=2, resume=True)
    again = _learner(tmp_path, 1, cb)
    start = params(again)
    with pytest.warns(RuntimeWarning, match="written by fit #1 of the run and this is fit #0: skipping"):
        first = _fit(again, 3, EarlyStoppingCallback(patience=9))  # a tracker sees no record of skipped epochs
    assert first.trained == [] and params(again) == start and cb.resume_pending  # done before: skipped whole
    second = _fit(again, 2)
    assert second.trained == [1] and second.start == killed_at and not cb.resume_pending
    assert params(again) == params(reference) != start
    assert _committed(tmp_path / "ckpt") == [3, 4]
    last = _saved(tmp_path / "ckpt", 4)
    assert (last["fit"], last["epoch"], last["step_base"]) == (1, 1, 3)


def test_resume_in_the_process_whose_fit_failed_continues_that_fit(tmp_path):
    """``learn.resume()`` and ``fit`` again after a crash, without restarting: the fit continues, it does not
    count as a later fit of the run (which would find its checkpoint "older" and start afresh)."""
    reference = _learner(tmp_path, 0, RankSafe(checkpoint_dir="reference"))
    _fit(reference, 3)

    cb = RankSafe(checkpoint_dir="ckpt", keep=2)
    run = _learner(tmp_path, 0, cb)
    with pytest.raises(Interrupted):
        _fit(run, 3, Crash(at=2))
    again = _fit(run.resume(), 3)
    assert again.trained == [2] and not cb.resume_pending
    assert params(run) == params(reference)
    assert _committed(tmp_path / "ckpt") == [1, 2]
    last = _saved(tmp_path / "ckpt", 2)
    assert (last["fit"], last["epoch"], last["step_base"]) == (0, 2, 0)


def test_a_resume_whose_restore_failed_is_tried_again_by_the_next_fit(tmp_path, monkeypatch):
    """A resume that raised while it restored the state leaves it pending: the next fit resumes, it does not start
    afresh over a checkpoint it never applied."""
    reference = _learner(tmp_path, 0, RankSafe(checkpoint_dir="reference"))
    _fit(reference, 3)

    cb = RankSafe(checkpoint_dir="ckpt")
    run = _learner(tmp_path, 0, cb)
    with pytest.raises(Interrupted):
        _fit(run, 3, Crash(at=2))

    def unreadable(learn, state):
        raise OSError("the restore failed")

    monkeypatch.setattr(fastai_steps, "restore", unreadable)
    with pytest.raises(OSError, match="the restore failed"):
        _fit(run.resume(), 3)
    monkeypatch.undo()
    assert cb.resume_pending
    again = _fit(run, 3)
    assert again.trained == [2] and not cb.resume_pending
    assert params(run) == params(reference)


def _one_cycle(learn, n, *cbs: Callback) -> Watch:
    watch = Watch()
    with learn.no_bar(), learn.no_logging():
        learn.fit_one_cycle(n, 1e-2, cbs=[watch, *cbs])
    return watch


@pytest.mark.parametrize("opt", ["adam", "ranger", "OptimWrapper(AdamW)"])
def test_fit_one_cycle_killed_and_resumed_ends_where_the_uninterrupted_run_does(tmp_path, opt):
    """fastai's schedulers put NumPy floats in the optimizer's hypers, ranger's Lookahead keeps fastcore lists,
    OptimWrapper's state is torch's (no hypers): the checkpoint must still load with weights_only and resume."""
    from functools import partial

    from fastai.optimizer import Adam, OptimWrapper, ranger

    opt_func = {"adam": Adam, "ranger": ranger, "OptimWrapper(AdamW)": partial(OptimWrapper, opt=torch.optim.AdamW)}

    def learner(seed, directory, **kw) -> Learner:
        set_seed(seed, reproducible=True)
        cb = RankSafe(checkpoint_dir=directory, **kw)
        return Learner(
            tabular_dls(tmp_path), Lin(), loss_func=MSELossFlat(), path=tmp_path, cbs=cb, opt_func=opt_func[opt]
        )

    reference = learner(0, "reference")
    _one_cycle(reference, 4)
    run = learner(0, "ckpt")
    with pytest.raises(Interrupted):
        _one_cycle(run, 4, Crash(at=2))
    again = learner(1, "ckpt", resume=True)
    resumed = _one_cycle(again, 4)
    assert resumed.trained == [2, 3]
    assert params(again) == params(reference)


def test_a_resumed_run_records_and_logs_what_the_uninterrupted_run_does(tmp_path):
    """The recorder's values and fastai's history.csv, train_loss (a smoothed loss carried across epochs)
    included, are the uninterrupted run's; only the time column differs."""
    from fastai.callback.progress import CSVLogger

    def run(seed, directory, *cbs, **kw) -> Learner:
        set_seed(seed, reproducible=True)
        learn = Learner(
            tabular_dls(tmp_path), Lin(), loss_func=MSELossFlat(), path=tmp_path,
            cbs=RankSafe(checkpoint_dir=directory, **kw),
        )  # fmt: skip
        with learn.no_bar(), learn.no_logging():
            learn.fit(4, 1e-2, cbs=[CSVLogger(f"{directory}.csv"), *cbs])
        return learn

    def history(name) -> list[list[str]]:
        lines = (tmp_path / name).read_text().splitlines()
        return [line.split(",")[:-1] for line in lines]  # without the time column

    reference = run(0, "reference")
    with pytest.raises(Interrupted):
        run(0, "ckpt", Crash(at=2))
    again = run(1, "ckpt", resume=True)
    assert [list(v) for v in again.recorder.values] == [list(v) for v in reference.recorder.values]
    assert again.smooth_loss == reference.smooth_loss
    assert history("ckpt.csv") == history("reference.csv")
    assert len(history("ckpt.csv")) == 5 and all(len(row) == 3 for row in history("ckpt.csv"))  # header, 4 epochs


class CPUMixedPrecision(MixedPrecision):
    """fastai's MixedPrecision with its GradScaler and autocast on the CPU (fastai hard-codes CUDA, where a
    GradScaler disables itself): the same callback and the same ``learn.scaler`` as on a GPU."""

    def before_fit(self):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA is not available")
            super().before_fit()
        self.autocast, self.learn.scaler = autocast("cpu", dtype=torch.float16), GradScaler("cpu", **self.kwargs)


class ScalerStates(Callback):
    """The GradScaler's state after every epoch (MixedPrecision drops the scaler at the end of the fit)."""

    order = 11

    def __init__(self):
        self.saved = []

    def after_epoch(self):
        self.saved.append(self.learn.scaler.state_dict())


def test_a_resumed_mixed_precision_run_keeps_the_grad_scaler_state(tmp_path):
    """The loss scale grows every 2 steps (6 per epoch): a resumed run must go on from the saved scale, not
    start again from ``init_scale`` (and skip steps to find its way back, when it overflows)."""

    def run(directory, *cbs, **kw) -> list[dict]:
        set_seed(0, reproducible=True)
        states = ScalerStates()
        learn = Learner(
            tabular_dls(tmp_path), Lin(), loss_func=MSELossFlat(), path=tmp_path,
            cbs=[RankSafe(checkpoint_dir=directory, **kw), CPUMixedPrecision(init_scale=2.0**4, growth_interval=2)],
        )  # fmt: skip
        with learn.no_bar(), learn.no_logging():
            learn.fit(4, 1e-2, cbs=[states, *cbs])
        return states.saved

    reference = run("reference")
    assert reference[0]["scale"] == 2.0**7 and reference[3]["scale"] == 2.0**16  # the scale does move
    with pytest.raises(Interrupted):
        run("ckpt", Crash(at=2))
    again = run("ckpt", resume=True)
    assert again[2:] == reference[2:]  # the epochs it ran (the skipped ones record the fresh scaler)


def test_a_learner_exported_with_ranksafe_and_loaded_by_fastai_keeps_checkpointing(tmp_path):
    """fastai's own ``load_learner`` (the usual call) unpickles RankSafe: its methods are installed again."""
    from fastai.learner import load_learner

    learn = _learner(tmp_path, 0, RankSafe(checkpoint_dir="ckpt"))
    learn.export("export.pkl")
    loaded = load_learner(tmp_path / "export.pkl")
    loaded.dls = tabular_dls(tmp_path)  # an exported Learner has empty loaders
    assert "fit" in loaded.__dict__  # RankSafe's fit, not fastai's
    _fit(loaded, 2)
    assert _committed(tmp_path / "ckpt") == [0, 1]


class SkipsTrainingInEpoch1(Callback):
    order = 52  # after the Recorder, before RankSafe

    def before_train(self):
        if self.epoch == 1:
            raise CancelTrainException()


class Tracker(TrackerCallback):
    """Records the epochs it is called for (fastai's own trackers fail in an epoch that did not train: its record
    has no training loss)."""

    def before_fit(self):
        super().before_fit()
        self.seen = []

    def after_epoch(self):
        self.seen.append(self.epoch)


def test_an_epoch_another_callback_kept_from_training_is_tracked_and_saved(tmp_path):
    """Before: RankSafe took an epoch whose training an earlier callback cancelled for one a resume skips: the
    trackers were kept quiet for it (fastai calls them) and no checkpoint was saved at its end."""
    tracker = Tracker()
    _fit(_learner(tmp_path, 0, RankSafe(checkpoint_dir="ckpt", keep=None)), 3, SkipsTrainingInEpoch1(), tracker)
    assert tracker.seen == [0, 1, 2]
    assert _committed(tmp_path / "ckpt") == [0, 1, 2]


class ExportAtLastEpoch(Callback):
    order = 60

    def after_epoch(self):
        if self.epoch == self.n_epoch - 1:
            self.learn.export("during_fit.pkl")


def test_a_learner_exported_during_a_resumed_fit_trains_every_epoch_of_its_next_fit(tmp_path):
    """Before: the export pickled the epoch skipper of the resumed fit, and its step boundary: the loaded Learner's
    next fit skipped the epochs the resume had skipped (here every one), and counted each optimizer step twice."""
    from fastai.learner import load_learner

    _fit(_learner(tmp_path, 0, RankSafe(checkpoint_dir="ckpt", save_interval_steps=1000)), 2)
    again = _learner(tmp_path, 1, RankSafe(checkpoint_dir="ckpt", save_interval_steps=1000))
    assert _fit(again.resume(), 3, ExportAtLastEpoch()).trained == [2]
    loaded = load_learner(tmp_path / "during_fit.pkl")
    loaded.dls = tabular_dls(tmp_path)
    watch = _fit(loaded, 2)
    assert watch.trained == [0, 1]
    (cb,) = [cb for cb in loaded.cbs if isinstance(cb, RankSafe)]
    assert cb._steps.optimizer_steps == 2 * len(loaded.dls.train)  # one per step, counted once
    assert _committed(tmp_path / "ckpt") == [2, 3, 4]  # numbered after the resumed fit's
    assert [type(cb).__name__ for cb in again.cbs if type(cb).__name__ in ("SkipToEpoch", "StepBoundary")] == []


class ScriptedLoss(Callback):
    """valid_loss replaced by scripted values (after the Recorder, before RankSafe and the trackers)."""

    order = 52

    def __init__(self, values):
        self.values = values

    def after_epoch(self):
        record = self.learn.recorder.values[-1]
        if len(record):  # an epoch of a fit a resume skips whole records nothing
            record[list(self.learn.recorder.metric_names[1:]).index("valid_loss")] = self.values[self.epoch]


def test_resume_does_not_replay_what_trackers_did_before_the_saved_epoch(tmp_path):
    """The best model is saved at epoch 1, the learning rate halved from epoch 2 on; killed at epoch 4 (epoch 3
    saved), then resumed: best.pth must stay epoch 1's (not the restored weights), and the rate must not be
    halved again for epoch 2 (the restored optimizer has that halving already)."""
    from fastai.callback.tracker import ReduceLROnPlateau

    def run(root, seed, resume, *cbs):
        set_seed(seed, reproducible=True)
        learn = Learner(
            tabular_dls(tmp_path), Lin(), loss_func=MSELossFlat(), path=root, cbs=RankSafe(checkpoint_dir="ckpt")
        )
        trackers = [
            ScriptedLoss([0.5, 0.4, 0.6, 0.7, 0.8, 0.9]),
            SaveModelCallback(fname="best"),
            ReduceLROnPlateau(patience=1, factor=2.0),
        ]
        with learn.no_bar(), learn.no_logging():
            (learn.resume() if resume else learn).fit(6, 1e-2, cbs=[*trackers, *cbs])
        return learn

    reference = run(tmp_path / "reference", 0, False)
    with pytest.raises(Interrupted):
        run(tmp_path / "run", 0, False, Crash(at=4))
    again = run(tmp_path / "run", 1, True)
    assert again.opt.hypers[-1]["lr"] == reference.opt.hypers[-1]["lr"] == 1e-2 / 16
    best = [
        torch.load(root / "models/best.pth", weights_only=True) for root in (tmp_path / "reference", tmp_path / "run")
    ]
    assert all(torch.equal(best[0][k], best[1][k]) for k in best[0])
    assert params(again) == params(reference)


class Validates(Callback):
    """Calls ``learn.validate()`` in its own before_fit and after_epoch, before RankSafe's run (order 0 < 55)."""

    def before_fit(self):
        if not hasattr(self.learn, "gather_preds") and not self.learn.lock.locked():
            self.learn.validate()

    def after_epoch(self):
        if not self.learn.lock.locked():
            self.learn.validate()


def test_checkpoints_however_the_fit_starts_and_whatever_its_callbacks_validate(tmp_path):
    """RankSafe passed to ``fit(cbs=...)`` (its fit wrapper is not installed then), and a callback that validates
    before RankSafe sees the fit start and before its epoch end (fastai's validate sets learn.epoch to 0)."""
    learn = Learner(tabular_dls(tmp_path), Lin(), loss_func=MSELossFlat(), path=tmp_path, cbs=Validates())
    _fit(learn, 3, RankSafe(checkpoint_dir="ckpt"))
    assert _committed(tmp_path / "ckpt") == [0, 1, 2]
    assert [_saved(tmp_path / "ckpt", s)["epoch"] for s in (0, 1, 2)] == [0, 1, 2]


def test_a_resumed_run_shuffles_a_plain_fastai_loader_as_the_uninterrupted_run_does(tmp_path):
    """fastai's DataLoader shuffles with a generator of its own, reseeded from itself at every epoch; only the
    global generators were saved, so a resumed run trained its epochs on other batches (the tabular loader of the
    other tests shuffles with NumPy's global generator, which hid it)."""
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader

    def run(seed, directory, *cbs, **kw) -> Learner:
        set_seed(seed, reproducible=True)  # the loaders' own generators are drawn from the global one
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 3, generator=g)
        rows = list(zip(x, x.sum(1, keepdim=True), strict=True))
        dls = DataLoaders(DataLoader(rows[:48], bs=8, shuffle=True), DataLoader(rows[48:], bs=8), device="cpu")
        torch.manual_seed(0)
        learn = Learner(
            dls, torch.nn.Linear(3, 1), loss_func=MSELossFlat(), path=tmp_path, cbs=RankSafe(directory, **kw)
        )
        with learn.no_bar(), learn.no_logging():
            learn.fit(4, 1e-2, cbs=list(cbs))
        return learn

    reference = run(0, "reference")
    with pytest.raises(Interrupted):
        run(0, "ckpt", Crash(at=2))
    again = run(1, "ckpt", resume=True)
    assert [list(v) for v in again.recorder.values] == [list(v) for v in reference.recorder.values]
    assert params(again) == params(reference)


_ROWS = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))


def _row(i: int) -> torch.Tensor:
    return _ROWS[i]


def _target(i: int) -> torch.Tensor:
    return _ROWS[i].sum(0, keepdim=True)


def _split_learner(root, seed, cb) -> Learner:
    """A Learner whose data are fastai ``Datasets`` with a train and a valid split: ``tta`` needs them."""
    set_seed(seed, reproducible=True)
    ds = Datasets(list(range(64)), tfms=[[_row], [_target]], splits=[list(range(48)), list(range(48, 64))])
    dls = ds.dataloaders(bs=8, path=root, device="cpu", num_workers=0)
    return Learner(dls, torch.nn.Linear(3, 1), loss_func=MSELossFlat(), path=root, cbs=cb)


def _passes(learn: Learner) -> None:
    """fastai's model summary and test-time augmentation, which send fit events of their own."""
    with learn.no_bar(), learn.no_logging():
        learn.summary()
        learn.tta()


def test_a_model_summary_or_tta_is_no_fit_it_saves_nothing_and_leaves_the_resume_to_the_next_fit(tmp_path):
    """fastai's ``learn.summary()`` and ``learn.tta()`` send ``before_fit`` and ``after_fit`` events of their own
    around their predictions. Before: RankSafe took them for fits. On a new Learner with a checkpoint_dir the summary
    raised (there was no optimizer to save) and left the fit's preemption handlers installed; between fits they saved
    steps of their own; with ``resume=True`` the first of them used up the resume (tta raised), and fastai's
    SkipToEpoch stayed on the Learner for every later fit."""
    handler = signal.getsignal(signal.SIGTERM)
    learn = _split_learner(tmp_path, 0, RankSafe(checkpoint_dir="ckpt", preemption=True))
    _passes(learn)  # before any fit
    assert signal.getsignal(signal.SIGTERM) == handler and not (tmp_path / "ckpt").exists()
    _fit(learn, 3)
    _passes(learn)  # between fits
    assert _committed(tmp_path / "ckpt") == [0, 1, 2]

    resumed = _split_learner(tmp_path, 1, RankSafe(checkpoint_dir="ckpt", resume=True))  # the next launch
    _passes(resumed)
    assert _committed(tmp_path / "ckpt") == [0, 1, 2]
    watch = _fit(resumed, 5)
    assert watch.trained == [3, 4] and watch.start == params(learn)
    assert _committed(tmp_path / "ckpt") == [2, 3, 4]
    assert [type(cb).__name__ for cb in resumed.cbs if "Skip" in type(cb).__name__] == []
    assert _fit(resumed, 2).trained == [0, 1]  # a later fit of the same Learner trains from its first epoch


def _alone_on_rank_0(rank, root):
    learn = _split_learner(root, 0, RankSafe(checkpoint_dir="ckpt"))
    _fit(learn, 1)
    done, took, error = os.path.join(root, "rank 0 done"), None, None
    if rank == 0:  # rank 1 meanwhile runs nothing of ranksafe's
        start = time.monotonic()
        try:
            _passes(learn)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        took = time.monotonic() - start
        open(done, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)
    return took, error, _fit(learn, 1).trained


def test_one_rank_may_run_a_summary_or_tta_alone(tmp_path):
    """``if rank == 0: learn.tta()`` after training, as ``validate`` may run alone. Before: rank 0's tta met RankSafe's
    epoch barrier alone and waited there for rank 1 until the timeout."""
    ranks = run_ranks(_alone_on_rank_0, 2, args=(str(tmp_path),), timeout=150)
    (took, error, trained), (_, _, trained_1) = ranks.values
    assert error is None and took < 10, (took, error)
    assert trained == trained_1 == [0]
    assert _committed(tmp_path / "ckpt") == [0, 1]


class SignalAt(Callback):
    """Sends this process SIGTERM after training batch ``at`` (of the fit, counted from 0)."""

    def __init__(self, at: int) -> None:
        self.at, self.n = at, 0

    def after_batch(self):
        if self.training:
            self.n += 1
            if self.n == self.at + 1:
                signal.raise_signal(signal.SIGTERM)


def test_a_ranksafe_given_to_one_fit_leaves_the_attached_one_working_and_its_preemption_seen(tmp_path):
    """Two RankSafe on one Learner: one attached, one given to a fit. Before: the one given to the fit, taken off at
    its end, took ``learn.preempted`` with it (``if learn.preempted: sys.exit(0)`` raised AttributeError); and the
    attached one, taken off first, took the methods it had installed, which the other one still needed."""
    learn = _learner(tmp_path, 0, RankSafe())
    _fit(learn, 1, RankSafe(checkpoint_dir="ckpt", preemption=True))
    assert learn.preempted is False and _committed(tmp_path / "ckpt") == [0]
    _fit(learn, 2, RankSafe(checkpoint_dir="ckpt", preemption=True), SignalAt(2))  # a preemption in this fit
    assert learn.preempted is True  # seen after the fit, though the RankSafe that stopped it is gone

    learn = _learner(tmp_path / "two", 0, [RankSafe(), RankSafe(checkpoint_dir="ckpt")])
    learn.remove_cb(learn.cbs[[type(cb) for cb in learn.cbs].index(RankSafe)])  # the first one attached
    assert {"fit", "summary", "tta", "validate"} <= set(vars(learn)) and learn.preempted is False
    learn.remove_cb(next(cb for cb in learn.cbs if isinstance(cb, RankSafe)))
    assert not {"fit", "summary", "tta", "validate", "preempted"} & set(vars(learn))  # the last one takes them


def test_a_resume_falls_back_over_a_damaged_newest_step_and_saves_over_it(tmp_path):
    """Before: ``resume=True`` loaded the newest step without a fallback: a damaged one (a truncated file) failed the
    resume, and a requeued job failed the same way at every start. Now it resumes from the newest step that verifies,
    with a warning, and training saves the damaged step again."""
    learn = _learner(tmp_path, 0, RankSafe(checkpoint_dir="ckpt", keep=None))
    _fit(learn, 3)
    state = tmp_path / "ckpt" / "step_00000002" / "state.pt"
    with open(state, "r+b") as f:
        f.truncate(state.stat().st_size - 100)
    resumed = _learner(tmp_path, 1, RankSafe(checkpoint_dir="ckpt", keep=None, resume=True))
    with pytest.warns(RuntimeWarning, match="falling back to step 1"):
        watch = _fit(resumed, 4)
    assert watch.trained == [2, 3]
    assert _committed(tmp_path / "ckpt") == [0, 1, 2, 3]
    assert ranksafe.verify_step(tmp_path / "ckpt" / "step_00000002")["step"] == 2  # saved again, whole
