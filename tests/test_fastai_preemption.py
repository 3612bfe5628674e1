"""fastai preemption: ``RankSafe(checkpoint_dir=..., preemption=True)`` turns a stop signal, sent to one rank or to
several at different moments, into one checkpoint of the same batch on every rank and a ``fit`` that returns normally;
the next run goes on from the batch after it, and the two runs together end where the uninterrupted one does.

Real signals, real processes: 2 gloo ranks with DDP (``distrib_ctx``) on the tabular Learner of tests/test_fastai.py,
4 rows a batch, so that an epoch is 6 batches on each rank. Each launch runs several fits one after the other
(fastai's import costs seconds per process). In one process: saves every N steps, killed and resumed, on a fastai
loader and on a torch one; a signal, the mixin, pickling and taking RankSafe off.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastai")

import torch
from fastai.callback.tracker import SaveModelCallback
from fastai.data.core import DataLoaders
from fastai.tabular.all import Callback, Learner, MSELossFlat
from fastai.torch_core import set_seed

import ranksafe
from ranksafe.fastai import RankSafe, RankSafeLearner, load_learner
from ranksafe.steps import list_steps
from tests.ranks import run_ranks, signal_when_at_step
from tests.test_fastai import Lin, params, tabular_dls

EPOCHS = 4
BATCHES = 6  # per epoch, on each of the two ranks (48 training rows, 4 a batch), and in one process at 8 a batch
EVERY_BATCH = [(epoch, i) for epoch in range(EPOCHS) for i in range(BATCHES)]


class Trained(Callback):
    """The training batches this run trained, by (epoch, batch); each one reported in ``step-<rank>`` (fastai's
    ``train_iter``), for a signal sent from outside, or a signal to this process at ``signal_at`` (train_iter,
    signal). The weights at each epoch end (before ``SaveModelCallback`` loads the best ones at the fit's end)."""

    order = 90  # after the trackers, before RankSafe's step boundary

    def __init__(self, root: Path, rank: int, signal_at: tuple[int, int] | None = None, pause: float = 0.0):
        self.root, self.rank, self.signal_at, self.pause = root, rank, signal_at, pause
        self.batches, self.weights = [], None

    def after_batch(self):
        if not self.training:
            return
        self.batches.append((self.epoch, self.iter))
        (self.root / f"step-{self.rank}").write_text(str(self.learn.train_iter))
        if self.signal_at is not None and self.learn.train_iter == self.signal_at[0]:
            os.kill(os.getpid(), self.signal_at[1])
        time.sleep(self.pause)  # a batch takes time: a signal from outside lands between two boundaries

    def after_epoch(self):
        self.weights = params(self.learn)


def _committed(root) -> list[int]:
    return [s.step for s in list_steps(root) if s.status == "committed"]


def _position(root) -> tuple[int, int | None]:
    """The newest committed checkpoint's epoch and batches done (None: taken at the epoch's end)."""
    state = ranksafe.CheckpointManager(root).load()
    return state["epoch"], state.get("batches")


def _fit_one_cycle(rank, root: Path, name: str, seed: int = 0, **kw) -> None:
    """``fit_one_cycle(EPOCHS)`` on every rank under ``root/name``, with RankSafe(checkpoint_dir="ckpt", **kw) and
    ``SaveModelCallback``; what it trained and where it ended goes to ``result-<rank>.pkl`` there (a launch may end
    with a rank killed)."""
    where = root / name
    where.mkdir(exist_ok=True)
    (where / f"pid-{rank}").write_text(str(os.getpid()))
    signal_at, pause = kw.pop("signal_at", {}).get(rank), kw.pop("pause", 0.0)
    set_seed(seed, reproducible=True)  # python, numpy, torch: the data order and the initial weights
    learn = Learner(
        tabular_dls(where, bs=4), Lin(), loss_func=MSELossFlat(), path=where,
        cbs=[RankSafe(checkpoint_dir="ckpt", keep=2, **kw), SaveModelCallback(fname="best")],
    )  # fmt: skip
    trained = Trained(where, rank, signal_at, pause)
    with learn.no_bar(), learn.no_logging(), learn.distrib_ctx(sync_bn=False):
        learn.fit_one_cycle(EPOCHS, 1e-2, cbs=trained)
    ranksafe.barrier("checkpoints written")
    result = {
        "trained": trained.batches, "train_iter": learn.train_iter, "lr": learn.opt.hypers[-1]["lr"],
        "weights": trained.weights, "recorder": [list(v) for v in learn.recorder.values],
        "preempted": learn.preempted, "committed": _committed(where / "ckpt"), "at": _position(where / "ckpt"),
        "handler": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    }  # fmt: skip
    (where / f"result-{rank}.pkl").write_bytes(pickle.dumps(result))


def _first_launch(rank, root):
    """One rank signalled from outside; both ranks, each at its own moment, with async saves; then the control,
    saving every epoch without preemption=True, one rank signalled from outside (it is killed: last)."""
    _fit_one_cycle(rank, Path(root), "one", preemption=True, pause=0.05)
    _fit_one_cycle(rank, Path(root), "both", preemption=True, async_save=True, signal_at={1: (3, 10), 0: (4, 15)})
    _fit_one_cycle(rank, Path(root), "stock", pause=0.05)


def _second_launch(rank, root):
    """The uninterrupted reference, and the two preempted runs resumed (from other initial weights)."""
    _fit_one_cycle(rank, Path(root), "reference")
    for name in ("one", "both"):
        _fit_one_cycle(rank, Path(root), name, seed=10 + rank, preemption=True, resume=True)


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> tuple[Path, dict, dict, object]:
    """Two launches of 2 ranks: the first (preempted runs, then the control), the second (reference, resumed runs).
    The results of each, by run and rank; and the first launch's ranks (the control ends it)."""
    root = tmp_path_factory.mktemp("preemption")
    senders = []
    for name in ("one", "stock"):  # rank 1, in epoch 1 (after its batch 2)
        (root / name).mkdir()
        senders.append(signal_when_at_step(root / name, 1, 8, signal.SIGTERM))

    def results(names) -> dict:
        return {n: [pickle.loads((root / n / f"result-{r}.pkl").read_bytes()) for r in range(2)] for n in names}

    first = run_ranks(_first_launch, 2, args=(str(root),), timeout=240)
    for sender in senders:
        sender.join(1)
    preempted = results(("one", "both"))  # before the resumed runs write theirs there
    run_ranks(_second_launch, 2, args=(str(root),), timeout=240).check()
    return root, preempted, results(("reference", "one", "both")), first


def test_a_signal_to_one_rank_or_to_both_stops_every_rank_after_one_saved_batch_and_the_next_run_finishes(launches):
    root, first, second, _ = launches
    for name in ("one", "both"):
        stops = {r["train_iter"] for r in first[name]}
        assert len(stops) == 1, f"{name}: every rank must stop after the same batch: {stops}"
        stop = stops.pop()
        epoch, done = divmod(stop, BATCHES)
        print(f"{name}: both ranks stopped after {done} batches of epoch {epoch} (train_iter {stop}), saved")
        for before, after, reference in zip(first[name], second[name], second["reference"], strict=True):
            assert before["preempted"] and before["handler"] and not after["preempted"], name
            # the batch every rank stopped after is the newest committed checkpoint; no step number is reused
            assert before["at"] == ((epoch, done) if done else (epoch - 1, BATCHES)), (name, before)  # inside it
            assert before["trained"][-1] == EVERY_BATCH[stop - 1]
            assert after["committed"][-1] > before["committed"][-1]
            # the two runs together train every batch of the schedule once, in order
            assert before["trained"] + after["trained"] == EVERY_BATCH, name
            # and end where the uninterrupted run does: fastai's step count, the one-cycle rate, weights, records
            assert (after["train_iter"], after["lr"]) == (reference["train_iter"], reference["lr"]), name
            assert after["weights"] == reference["weights"], name
            assert after["recorder"] == reference["recorder"], name
        best = [torch.load(root / d / "models" / "best.pth", weights_only=True) for d in (name, "reference")]
        assert all(torch.equal(best[0][k], best[1][k]) for k in best[1]), f"{name}: another best model"
    assert 8 < first["one"][0]["train_iter"] < BATCHES * EPOCHS
    assert first["both"][0]["train_iter"] == 4  # rank 1's signal, after its batch 3: every rank acts after batch 4


def test_control_without_preemption_the_signal_kills_the_rank_and_the_batches_since_the_epoch_end_are_lost(launches):
    root, _, _, ranks = launches
    assert ranks[1].exitcode == -signal.SIGTERM and not ranks[0].ok  # killed; the other fails with it
    assert not (root / "stock" / "result-0.pkl").exists()
    reached = int((root / "stock" / "step-1").read_text())
    saved = (max(_committed(root / "stock" / "ckpt")) + 1) * BATCHES  # epoch-end checkpoints
    print(f"stock: rank 1 killed after batch {reached}, the last checkpoint holds {saved}: {reached - saved} lost")
    assert reached - saved >= 2


# ------------------------------------------------------------------------------------------------ one process


class Interrupted(Exception):
    """The job was killed."""


class Crash(Callback):
    """Interrupts the run before the training batch with fastai's ``train_iter`` ``at``."""

    order = 0

    def __init__(self, at: int):
        self.at = at

    def before_batch(self):
        if self.training and self.learn.train_iter == self.at:
            raise Interrupted(f"killed before batch {self.at}")


def _torch_dls() -> DataLoaders:
    """The same rows through torch's own DataLoader (shuffled by torch's global generator)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=g)
    rows = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    train, valid = torch.utils.data.Subset(rows, range(48)), torch.utils.data.Subset(rows, range(48, 64))
    loader = torch.utils.data.DataLoader
    return DataLoaders(loader(train, batch_size=8, shuffle=True), loader(valid, batch_size=8), device="cpu")


@pytest.mark.parametrize("loaders", ["fastai", "torch"])
def test_saves_every_n_steps_inside_epochs_resume_at_the_next_batch(tmp_path, loaders):
    """Every 5 optimizer steps (6 a epoch) a checkpoint inside the epoch, numbered between the epochs' ones; killed
    after step 16 and resumed from step 15's: the batches after it, on a fastai loader (the batches done are never
    loaded) and on a torch one (loaded and dropped); the end is the uninterrupted run's."""

    def run(directory, seed, *cbs, **kw):
        set_seed(seed, reproducible=True)
        dls, model = (tabular_dls(tmp_path), Lin()) if loaders == "fastai" else (_torch_dls(), torch.nn.Linear(3, 1))
        learn = Learner(dls, model, loss_func=MSELossFlat(), path=tmp_path, cbs=RankSafe(directory, keep=None, **kw))
        trained = Trained(tmp_path, 0)
        with learn.no_bar(), learn.no_logging():
            learn.fit_one_cycle(EPOCHS, 1e-2, cbs=[trained, *cbs])
        return learn, trained

    reference, _ = run("reference", 0, save_interval_steps=5)
    # 8 steps: each save inside an epoch takes the number the epoch's end had, which moves one further
    saved = [_saved(tmp_path / "reference", s) for s in range(8)]
    assert _committed(tmp_path / "reference") == list(range(8))
    assert [(s["epoch"], s.get("batches"), s["steps"]) for s in saved] == [
        (0, 5, 5), (0, None, 6), (1, 4, 10), (1, None, 12), (2, 3, 15), (2, None, 18), (3, 2, 20), (3, None, 24)
    ]  # fmt: skip
    with pytest.raises(Interrupted):
        run("ckpt", 0, Crash(at=16), save_interval_steps=5)
    assert _committed(tmp_path / "ckpt") == [0, 1, 2, 3, 4]
    again, resumed = run("ckpt", 1, save_interval_steps=5, resume=True)
    assert resumed.batches == EVERY_BATCH[15:]
    assert _committed(tmp_path / "ckpt") == list(range(8))  # the same numbers as the uninterrupted run
    assert (again.train_iter, again.opt.hypers[-1]["lr"]) == (reference.train_iter, reference.opt.hypers[-1]["lr"])
    assert params(again) == params(reference)
    assert [list(v) for v in again.recorder.values] == [list(v) for v in reference.recorder.values]
    assert again.smooth_loss == reference.smooth_loss


def test_with_gradient_accumulation_a_step_boundary_is_an_optimizer_step(tmp_path):
    """GradientAccumulation steps the optimizer after every second batch (16 rows, 8 a batch): the saves every 2
    steps come after those batches only (between two of them the accumulated gradients would be lost), and a run
    killed and resumed from one ends as the uninterrupted one."""
    from fastai.callback.training import GradientAccumulation

    def run(directory, seed, *cbs, **kw):
        set_seed(seed, reproducible=True)
        cb = RankSafe(directory, keep=None, save_interval_steps=2, **kw)
        learn = Learner(tabular_dls(tmp_path), Lin(), loss_func=MSELossFlat(), path=tmp_path, cbs=cb)
        trained = Trained(tmp_path, 0)
        with learn.no_bar(), learn.no_logging():
            learn.fit_one_cycle(EPOCHS, 1e-2, cbs=[GradientAccumulation(16), trained, *cbs])
        return learn, trained

    reference, _ = run("reference", 0)
    saved = [_saved(tmp_path / "reference", s) for s in _committed(tmp_path / "reference")]
    inside = [(s["epoch"], s["batches"]) for s in saved if "batches" in s]
    assert inside == [(0, 4), (1, 2), (1, 6), (2, 4), (3, 2), (3, 6)]
    assert all(s["train_iter"] == 2 * s["steps"] for s in saved)  # 12 optimizer steps for 24 batches
    with pytest.raises(Interrupted):
        run("ckpt", 0, Crash(at=17))
    again, resumed = run("ckpt", 1, resume=True)
    assert resumed.batches == EVERY_BATCH[16:]
    assert params(again) == params(reference) and again.train_iter == reference.train_iter == 24


def test_gradients_accumulated_across_an_epoch_end_are_in_its_checkpoint(tmp_path):
    """GradientAccumulation(32) steps after every fourth batch (8 rows each), so the end of epoch 0 (6 batches) holds
    two batches of gradients not yet stepped, and fastai carries them into epoch 1. A run resumed from that epoch's
    checkpoint must carry them too (before: they were lost, and the resumed weights differed)."""
    from fastai.callback.training import GradientAccumulation

    def run(directory, *cbs, **kw):
        set_seed(0, reproducible=True)
        cb = RankSafe(directory, keep=None, **kw)
        learn = Learner(tabular_dls(tmp_path), Lin(), loss_func=MSELossFlat(), path=tmp_path, cbs=cb)
        with learn.no_bar(), learn.no_logging():
            learn.fit(EPOCHS, 1e-2, cbs=[GradientAccumulation(32), *cbs])
        return learn

    reference = run("reference")
    assert _saved(tmp_path / "reference", 0)["accumulated"]["count"] == 16  # two batches pending at epoch 0's end
    with pytest.raises(Interrupted):
        run("ckpt", Crash(at=8))  # inside epoch 1, before its first optimizer step
    again = run("ckpt", resume=True)
    assert params(again) == params(reference)


def _saved(root, step: int) -> dict:
    return ranksafe.load_file(os.path.join(root, f"step_{step:08d}", "state.pt"))


class MyLearner(RankSafeLearner, Learner):
    pass


def test_one_process_a_signal_stops_the_fit_chains_the_handler_and_the_flag_goes_with_ranksafe(tmp_path):
    """The mixin path, in this very process: SIGUSR1 after batch 9 (a handler installed before is still called);
    ``fit`` returns after batch 10 (the signal is acted on at the next boundary, as on several ranks), saved; the
    handler is put back; a later fit trains nothing; ``learn.preempted`` is exported with the Learner and goes when
    RankSafe is taken off. A new Learner resumes and ends as the uninterrupted run."""

    def learner(directory, seed, **kw):
        set_seed(seed, reproducible=True)
        cb = RankSafe(checkpoint_dir=directory, **kw)
        return MyLearner(tabular_dls(tmp_path), Lin(), loss_func=MSELossFlat(), path=tmp_path, cbs=cb)

    def fit(learn, signal_at=None):
        trained = Trained(tmp_path, 0, signal_at)
        with learn.no_bar(), learn.no_logging():
            learn.fit_one_cycle(EPOCHS, 1e-2, cbs=trained)
        return trained.batches

    reference = learner("reference", 0)
    fit(reference)
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        learn = learner("ckpt", 0, preemption=True)
        assert learn.preempted is False
        trained = fit(learn, (9, signal.SIGUSR1))
        assert seen == [signal.SIGUSR1] and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        handler = signal.signal(signal.SIGUSR1, previous)
    assert callable(handler) and handler.__name__ == "<lambda>"  # the test's own, put back after the fit
    assert learn.preempted and trained == EVERY_BATCH[:10] and _position(tmp_path / "ckpt") == (1, 4)
    assert fit(learn) == []  # the process is to end: another fit trains nothing
    exported = load_learner(learn.export("preempted.pkl"), trusted=True)
    assert exported.preempted  # the Learner without its data
    exported.dls = learn.dls
    assert fit(exported) == []  # unpickled, with no manager yet: it trains nothing either
    learn.remove_cb(RankSafe)
    assert "preempted" not in vars(learn)

    again = learner("ckpt", 1, preemption=True, resume=True)
    assert trained + fit(again) == EVERY_BATCH
    assert (again.train_iter, again.opt.hypers[-1]["lr"]) == (reference.train_iter, reference.opt.hypers[-1]["lr"])
    assert params(again) == params(reference) and not again.preempted


_SIGNAL_IN_THE_LAST_VALIDATION = """
import os, signal, sys
from fastai.tabular.all import Callback, Learner, MSELossFlat
from ranksafe.fastai import RankSafe
from tests.test_fastai import Lin, tabular_dls

class SignalInTheLastValidation(Callback):
    def __init__(self, signum):
        self.signum = signum
    def after_batch(self):
        if not self.training and self.epoch == self.n_epoch - 1 and self.iter == 0:
            os.kill(os.getpid(), self.signum)

class SignalThenFail(Callback):
    def after_batch(self):
        if self.training and self.iter == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            raise RuntimeError("a bug, right after the signal")

seen = []
signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))  # SIGTERM keeps its default action: the process ends
def learner(directory):
    return Learner(tabular_dls(sys.argv[1]), Lin(), loss_func=MSELossFlat(), path=sys.argv[1],
                   cbs=RankSafe(checkpoint_dir=directory, preemption=True))

learn, other = learner("ckpt"), learner("other")
with learn.no_bar(), learn.no_logging(), other.no_bar(), other.no_logging():
    learn.fit(2, cbs=SignalInTheLastValidation(signal.SIGTERM))
    print("first fit", learn.preempted, learn.train_iter, flush=True)
    other.fit(2)  # a process that trains a new model next (a sweep, a second stage) stops it
    print("another learner", other.preempted, other.train_iter, flush=True)
    learn.fit(2, cbs=SignalInTheLastValidation(signal.SIGUSR1))  # the same RankSafe's next fit, a handled signal
    learn.fit(2)
    print("same learner", learn.preempted, learn.train_iter, "handler calls", len(seen), flush=True)
failing, last = learner("failing"), learner("last")
with failing.no_bar(), failing.no_logging(), last.no_bar(), last.no_logging():
    try:
        failing.fit(2, cbs=SignalThenFail())
    except RuntimeError:
        pass
    last.fit(2)
print("after a failed fit", last.preempted, last.train_iter, flush=True)
"""


def test_a_signal_in_the_last_validation_ends_the_fit_as_usual_and_the_next_fit_stops(tmp_path):
    """Before: the fit's end raised the signal again. With the default action (SIGTERM) the process ended inside the
    fit (no later after_fit, nothing after fit ran: SIGTERM as exit code); a handler installed before (SIGUSR1's)
    was called twice, and the next fit trained every batch, the signal forgotten. A signal kept by one RankSafe for
    its next fit was lost to a new Learner's, and so was the signal of a fit that failed."""
    command = [sys.executable, "-c", _SIGNAL_IN_THE_LAST_VALIDATION, str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "first fit False 12", done.stdout  # 2 epochs of 6 batches, the last checkpoint committed
    assert lines[1] == "another learner True 2", done.stdout  # its fit stops after its second batch
    assert lines[2] == "same learner True 2 handler calls 1", done.stdout
    assert lines[3] == "after a failed fit True 2", done.stdout  # a signal of a fit that failed stops the next one
    assert _committed(tmp_path / "ckpt") == [2, 3, 4], done.stdout  # keep=3: the second fit's epochs, the stop


def test_preemption_and_intervals_need_a_checkpoint_dir():
    with pytest.raises(ValueError, match=r"RankSafe\(preemption=...\) needs a checkpoint_dir"):
        RankSafe(preemption=True)
    with pytest.raises(ValueError, match=r"RankSafe\(async_save=...\) needs a checkpoint_dir"):
        RankSafe(async_save=True)  # would write nothing in the background, silently
    with pytest.raises(ValueError, match=r"RankSafe\(every=...\) needs a checkpoint_dir"):
        RankSafe(every=2)
    with pytest.raises(ValueError, match=r"RankSafe\(storage=...\) needs a checkpoint_dir"):
        RankSafe(storage="shared")
    with pytest.raises(ValueError, match=r"RankSafe\(storage_options=...\) needs a checkpoint_dir"):
        RankSafe(storage_options={"anon": True})
    with pytest.raises(ValueError, match="checkpoint_dir must name a directory, not ''"):
        RankSafe(checkpoint_dir="")
    with pytest.raises(ValueError, match="save_interval_steps must be a positive"):
        RankSafe("ckpt", save_interval_steps=0)
    with pytest.raises(ValueError, match="save_interval_seconds must be a positive number or None, not nan"):
        RankSafe("ckpt", save_interval_seconds=math.nan)  # passed, and no interval save ever came
    with pytest.raises(ValueError, match="SIGKILL cannot be handled"):  # passed, and every fit raised OSError EINVAL
        RankSafe("ckpt", preemption=[signal.SIGKILL])
