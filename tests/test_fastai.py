"""fastai integration on real ranks: 2 gloo processes on CPU, a Linear on 64 tabular rows.

Each multi-process run combines several checks (fastai's import costs seconds per process).
"""

from __future__ import annotations

import functools
import io
import math
import os
import pickle
import time
import warnings

import pytest

pytest.importorskip("fastai")

import cloudpickle
import torch
from fastai.callback.schedule import LRFinder
from fastai.callback.tracker import TerminateOnNaNCallback
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.tabular.all import (
    Callback,
    CSVLogger,
    EarlyStoppingCallback,
    Learner,
    MSELossFlat,
    Normalize,
    ReduceLROnPlateau,
    SaveModelCallback,
    TabularDataLoaders,
    get_model,
    nn,
    pd,
)

import ranksafe
import ranksafe.fastai as rf
from ranksafe import exchange as protocol
from ranksafe.fastai import RankSafe
from tests.ranks import free_port, run_ranks

# rank 0 sees NaN first and its best at epoch 2; rank 1 would pick epoch 3
SAVE_VALUES = {0: [math.nan, 0.5, 0.4, 0.6], 1: [0.9, 0.8, 0.1, 0.05]}
# rank 0 stops improving at epoch 1 (patience 1); rank 1 keeps improving
STOP_VALUES = {0: [0.5, 0.6, 0.7, 0.8], 1: [0.9, 0.8, 0.7, 0.6]}


class Lin(nn.Module):
    """A tabular model: a Linear on the continuous columns."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(3, 1)

    def forward(self, x_cat, x_cont):
        return self.l(x_cont)


def tabular_dls(path, bs: int = 8) -> TabularDataLoaders:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=g)
    df = pd.DataFrame(x.numpy(), columns=list("abc"))
    df["y"] = (x.sum(1) + 0.1 * torch.randn(64, generator=g)).numpy()
    return TabularDataLoaders.from_df(
        df, path, y_names="y", cont_names=list("abc"), procs=[Normalize], bs=bs, valid_idx=list(range(48, 64)),
        device="cpu",
    )  # fmt: skip


class Inject(Callback):
    """Overwrite this rank's valid_loss after the Recorder (50), before RankSafe (55) and the trackers."""

    order = 52

    def __init__(self, values):
        self.values = values

    def after_epoch(self):
        rec = self.learn.recorder
        rec.values[-1][list(rec.metric_names[1:]).index("valid_loss")] = self.values[self.learn.epoch]


class Watch(Callback):
    """Per epoch: the weights, the ranksafe collective count, which shard of the data this rank trained on."""

    order = 56

    def before_fit(self):
        self.weights, self.seqs, self.shards, self.epochs = [], [], [], 0

    def before_train(self):
        dl = self.learn.dl
        self.shards.append(
            (type(self.learn.model).__name__, getattr(dl, "rank", None), getattr(dl, "world_size", None))
        )

    def after_epoch(self):
        self.epochs += 1
        self.weights.append(params(self.learn))
        s = protocol._session
        self.seqs.append(s.seq if s is not None else None)


def params(learn) -> list[float]:
    return torch.cat([p.detach().flatten() for p in get_model(learn.model).parameters()]).tolist()


class CountSaves:
    """Count torch.save calls in this process (fastai's and ranksafe's writers all end there)."""

    def __init__(self):
        self.n, self._orig = 0, torch.save
        torch.save = self

    def __call__(self, *a, **k):
        self.n += 1
        return self._orig(*a, **k)


def roundtrip(obj, module=pickle):
    """``obj`` through ``module`` (pickle, or cloudpickle as fastai's ``export`` uses) and back, leaving out what fastai
    itself cannot pickle in the middle of a fit on several ranks: its loaders (they hold iterators) and open files
    (CSVLogger's log)."""

    class Pickler(module.Pickler):
        def persistent_id(self, o):
            return "left out" if isinstance(o, (DataLoader, DataLoaders, io.IOBase)) else None

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            return None

    buffer, counting = io.BytesIO(), torch.save
    torch.save = getattr(counting, "_orig", counting)  # a tensor pickles through torch.save: not a file written
    try:
        Pickler(buffer).dump(obj)
    finally:
        torch.save = counting
    buffer.seek(0)
    return Unpickler(buffer).load()


def bound_to_itself(copy) -> list[str]:
    """The ranksafe methods or events a copy came back with, bound to the copy itself (a RankSafe: its Learner's)."""
    copy = copy.learn if isinstance(copy, RankSafe) else copy
    return sorted(k for k, v in vars(copy).items() if isinstance(v, functools.partial) and v.args[:1] == (copy,))


LEARNER_METHODS = ["export", "fit", "get_preds", "load", "resume", "save", "summary", "tta", "validate"]  # tabular


class Pickles(Callback):
    """At the first epoch end of a fit, each object ranksafe sets something on goes through pickle and cloudpickle."""

    order = 90

    def before_fit(self):
        self.copies, self.finder = {}, next((cb for cb in self.learn.cbs if isinstance(cb, LRFinder)), None)

    def after_epoch(self):
        if self.copies:
            return
        for obj in (self.learn, *self.learn.cbs):
            if isinstance(obj, (Learner, RankSafe, CSVLogger, TerminateOnNaNCallback, LRFinder)):
                for module in (pickle, cloudpickle):
                    self.copies[f"{type(obj).__name__} {module.__name__}"] = bound_to_itself(roundtrip(obj, module))


def _learner(path, safe: bool, *cbs) -> Learner:
    extra = [RankSafe()] if safe else []
    return Learner(tabular_dls(path), Lin(), loss_func=MSELossFlat(), path=path, cbs=[*extra, *cbs])


def _fit_watch(learn, n, *cbs) -> Watch:
    watch = Watch()
    with learn.no_bar(), learn.no_logging(), learn.distrib_ctx(sync_bn=False):
        learn.fit(n, 1e-2, cbs=[watch, *cbs])
    return watch


# ------------------------------------------------------------------ run 1: mp.spawn-like, RankSafe + DDP


def _ddp_with_ranksafe(rank, root):
    torch.manual_seed(rank)  # different initial weights per rank: DDP must broadcast rank 0's
    saves = CountSaves()
    out = {"env_rank": None}
    learn = _learner(root, True, CSVLogger())
    out["env_rank"] = os.environ.get("RANK")

    # SaveModelCallback, disagreeing values, NaN on rank 0 at epoch 0; what ranksafe sets pickles meanwhile
    nan, pickles = TerminateOnNaNCallback(), Pickles()
    watch = _fit_watch(learn, 4, Inject(SAVE_VALUES[rank]), SaveModelCallback(fname="best"), nan, pickles)
    out["save"] = {
        "final": params(learn), "per_epoch": watch.weights, "shards": watch.shards, "saves": saves.n,
        "best": learn.recorder.values[-1],
    }  # fmt: skip
    out["pickled"] = {"during": pickles.copies, "after": sorted(k for k in vars(nan) if k.endswith("batch"))}
    with open(os.path.join(root, "history.csv")) as f:
        out["csv"] = f.read()

    # EarlyStoppingCallback, disagreeing values
    plateau = ReduceLROnPlateau(patience=1, factor=2.0)
    watch = _fit_watch(learn, 4, Inject(STOP_VALUES[rank]), plateau, EarlyStoppingCallback(patience=1))
    out["stop_epochs"], out["lr"] = watch.epochs, learn.opt.hypers[-1]["lr"]

    # cost per epoch when nothing is saved
    watch = _fit_watch(learn, 3)
    out["seq_deltas"] = [b - a for a, b in zip(watch.seqs, watch.seqs[1:], strict=False)]

    # lr_find: one temporary model, loaded by every rank, removed once
    before = params(learn)
    learn.add_cb(pickles)
    with learn.no_bar(), learn.no_logging(), learn.distrib_ctx(sync_bn=False):
        learn.lr_find(num_it=12, stop_div=False, show_plot=False)  # fastai's valley needs >5 points
    learn.remove_cb(pickles)
    out["lr_find"] = {"restored": params(learn) == before, "models": sorted(os.listdir(os.path.join(root, "models")))}
    out["pickled"]["lr_find"] = pickles.copies
    out["pickled"]["lr_find after"] = sorted(k for k in vars(pickles.finder) if k.endswith("fit"))

    # export + load_learner, one writer
    n = saves.n
    learn.remove_cb(CSVLogger)  # fastai cannot pickle the logger's closed file handle
    learn.export("export.pkl")
    loaded = rf.load_learner(os.path.join(root, "export.pkl"), trusted=True)
    out["export"] = {"saves": saves.n - n, "same": params(loaded) == params(learn)}
    return out


def test_ranksafe_ddp_decisions_writers_and_lr_find(tmp_path):
    # WORLD_SIZE exported without RANK: stock accelerate would give every process RANK=0 and data shard 0
    ranks = run_ranks(_ddp_with_ranksafe, 2, args=(str(tmp_path),), env={"WORLD_SIZE": "2"}, timeout=240)
    r0, r1 = ranks.values
    assert (r0["env_rank"], r1["env_rank"]) == ("0", "1")
    for r, v in enumerate((r0, r1)):
        # data sharding and the DDP wrapper follow the process group
        assert all(s == ("DistributedDataParallel", r, 2) for s in v["save"]["shards"]), v["save"]["shards"]
    # SaveModelCallback: rank 0's values decide (best at epoch 2); both ranks end with the epoch-2 weights
    assert r0["save"]["final"] == r1["save"]["final"] == r0["save"]["per_epoch"][2]
    assert r0["save"]["per_epoch"][2] != r0["save"]["per_epoch"][3]
    assert (r0["save"]["saves"], r1["save"]["saves"]) == (2, 0)  # epochs 1 and 2, rank 0 only
    # CSVLogger: one writer, header + one line per epoch, epochs in order
    lines = r0["csv"].splitlines()
    assert lines[0] == "epoch,train_loss,valid_loss,time" and [ln.split(",")[0] for ln in lines[1:]] == list("0123")
    assert os.listdir(tmp_path).count("history.csv") == 1
    # EarlyStopping: both ranks stop after the same epoch, no hang
    assert r0["stop_epochs"] == r1["stop_epochs"] == 2
    assert r0["lr"] == r1["lr"] == 1e-2 / 2  # ReduceLROnPlateau: the same single reduction on both ranks
    # one small collective per epoch when nothing is saved
    assert len(r0["seq_deltas"]) == 2 and r0["seq_deltas"] == r1["seq_deltas"], r0["seq_deltas"]
    assert all(d <= 2 for d in r0["seq_deltas"]), r0["seq_deltas"]
    # lr_find restored the weights on every rank and left only the saved best model
    assert r0["lr_find"] == r1["lr_find"] == {"restored": True, "models": ["best.pth"]}
    assert (r0["export"]["saves"], r1["export"]["saves"]) == (1, 0) and r0["export"]["same"] and r1["export"]["same"]
    # during the fit, what ranksafe sets pickles, with pickle and with cloudpickle, and comes back bound to the copy
    both = lambda kinds: {f"{k} {m}": v for k, v in kinds.items() for m in ("pickle", "cloudpickle")}  # noqa: E731
    common = {"Learner": LEARNER_METHODS, "RankSafe": LEARNER_METHODS, "CSVLogger": []}
    for v in (r0, r1):
        assert v["pickled"]["during"] == both({**common, "TerminateOnNaNCallback": ["after_batch"]}), v["pickled"]
        assert v["pickled"]["lr_find"] == both({**common, "LRFinder": ["after_fit", "before_fit"]}), v["pickled"]
        assert v["pickled"]["after"] == [] and v["pickled"]["lr_find after"] == []  # taken off when the fit is over


# ------------------------------------------------- run 2: the stock control (fastai's callbacks, CPU fix only)


def _ddp_stock(rank, root):
    from ranksafe.fastai import CPUDistributed, prepare_distributed

    prepare_distributed()  # torchrun-like env: fastai knows its rank
    torch.manual_seed(rank)
    learn = _learner(root, False, CPUDistributed())  # this only lets DDP run on CPU
    save = SaveModelCallback(fname="best")
    _fit_watch(learn, 4, Inject(SAVE_VALUES[rank]), save)
    out = {"best": save.best, "final": params(learn)}
    start = time.monotonic()
    try:
        watch = _fit_watch(learn, 4, Inject(STOP_VALUES[rank]), EarlyStoppingCallback(patience=1))
        out["stop_epochs"] = watch.epochs
        if rank == 0:
            time.sleep(12)  # stay alive: rank 1 must wait for its peer, not see it exit
    except Exception as e:
        out["stop_error"] = (type(e).__name__, time.monotonic() - start)
    return out


def test_stock_fastai_control_disagrees_and_blocks_until_pg_timeout(tmp_path):
    ranks = run_ranks(_ddp_stock, 2, args=(str(tmp_path),), env={"TEST_PG_TIMEOUT": "6"}, timeout=240, launch_env=True)
    r0, r1 = ranks.values
    # rank 1 believes its epoch 3 (0.05) was best, rank 0 its epoch 2 (0.4): they load one file regardless
    assert (r0["best"], r1["best"]) == (0.4, 0.05)
    # rank 0 stops after epoch 1; rank 1 goes on into the next epoch and is stuck until the PG timeout
    assert r0["stop_epochs"] == 2
    assert "stop_error" in r1, r1
    assert 5 <= r1["stop_error"][1] < 12, r1["stop_error"]  # bounded only by the process-group timeout (6 s)


# ----------------------------------------- run 3: mp.spawn without any launcher variable: writers and readers


def _text_learner(root):
    from fastai.text.all import AWD_LSTM, DataLoaders, TextLearner, awd_lstm_lm_config, get_language_model
    from torch.utils.data import TensorDataset

    class MyLearner(rf.RankSafeLearner, TextLearner):
        pass

    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 20, (16, 6), generator=g), torch.randint(0, 20, (16, 6), generator=g)
    dls = DataLoaders.from_dsets(TensorDataset(x, y), TensorDataset(x, y), bs=8, device="cpu")
    model = get_language_model(AWD_LSTM, 20, config=dict(awd_lstm_lm_config, emb_sz=8, n_hid=8, n_layers=1))
    from fastai.text.all import CrossEntropyLossFlat

    return MyLearner(dls, model, loss_func=CrossEntropyLossFlat(), path=root)


def _outcome(fn):
    start = time.monotonic()
    try:
        fn()
        return {"error": None}
    except Exception as e:
        names = [t.__name__ for t in type(e).__mro__]
        return {"error": names, "seconds": time.monotonic() - start, "ranks": getattr(e, "ranks", None)}


def _spawned_writers_and_readers(rank, root):
    saves = CountSaves()
    out = {"env_rank": os.environ.get("RANK")}
    torch.manual_seed(rank)
    learn = _text_learner(os.path.join(root, "text"))
    out["has_callback"] = any(isinstance(cb, RankSafe) for cb in learn.cbs)
    encoder = lambda: torch.cat([p.detach().flatten() for p in get_model(learn.model)[0].parameters()]).tolist()  # noqa: E731
    out["differ_before"] = ranksafe.all_gather(encoder())
    learn.save_encoder("enc")
    out["encoder_saves"] = saves.n
    learn.load_encoder("enc")
    out["encoder"] = encoder()

    # load_pretrained: rank 0's language-model weights and vocabulary, read by every rank behind a barrier
    learn.dls.vocab = [f"w{i}" for i in range(20)]
    wgts, vocab = os.path.join(root, "lm.pth"), os.path.join(root, "lm_vocab.pkl")
    whole = lambda: torch.cat([p.detach().flatten() for p in learn.model.parameters()]).tolist()  # noqa: E731
    out["before_pretrained"] = whole()
    ranksafe.save({k: v + 1 for k, v in learn.model.state_dict().items()}, wgts)  # rank 0 writes its own + 1
    if rank == 0:
        with ranksafe.atomic_write(vocab) as f:
            pickle.dump(learn.dls.vocab, f)
    learn.load_pretrained(wgts, vocab)
    out["pretrained"] = whole()
    out["pretrained_missing"] = _outcome(lambda: learn.load_pretrained(wgts, vocab + ".missing"))

    tab = _learner(os.path.join(root, "tab"), True)
    n = saves.n
    preds = os.path.join(root, "preds")
    if rank == 0:
        os.makedirs(preds)
    ranksafe.barrier("preds dir")
    got, targs = tab.get_preds(save_preds=preds)  # outside distrib_ctx: every rank predicts on the whole loader
    out["preds"] = {"saves": saves.n - n, "files": sorted(os.listdir(preds))}
    with torch.no_grad():
        batches = list(tab.dls.valid)
        want, true = torch.cat([tab.model(*b[:-1]) for b in batches]), torch.cat([b[-1] for b in batches])
    out["preds"]["right"] = torch.allclose(got, want) and torch.equal(targs, true)
    out["preds"]["rows"] = [len(ranksafe.load(os.path.join(preds, f))) for f in out["preds"]["files"]]

    # a write that fails on rank 0 only: a file stands where the models directory must go
    bad = os.path.join(root, "bad")
    if rank == 0:
        os.makedirs(bad)
        open(os.path.join(bad, "models"), "w").close()
    ranksafe.barrier("bad dir")
    out["failed_save"] = _outcome(lambda: _learner(bad, True).save("x"))
    out["missing_load"] = _outcome(lambda: tab.load("missing"))
    out["untrusted"] = _outcome(lambda: rf.load_learner(os.path.join(root, "any.pkl")))
    # last, since it ends the job: rank 1 fails alone in a late after_epoch callback during DDP training
    out["fails_alone"] = _outcome(lambda: _fit_watch(tab, 3, FailAlone(rank=1, epoch=1)))
    return out


class FailAlone(Callback):
    """Raise on one rank only, after the trackers (as a full disk under a logger would)."""

    order = 70

    def __init__(self, rank, epoch):
        self.fail_rank, self.fail_epoch = rank, epoch

    def after_epoch(self):
        if ranksafe.rank() == self.fail_rank and self.epoch == self.fail_epoch:
            raise OSError(28, "No space left on device (injected on one rank)")


def test_spawned_without_rank_one_writer_shared_failures(tmp_path):
    r0, r1 = run_ranks(_spawned_writers_and_readers, 2, args=(str(tmp_path),), timeout=180).values
    assert r0["env_rank"] is None and r1["env_rank"] is None  # nothing told fastai the rank
    assert r0["has_callback"] and r1["has_callback"]  # the mixin adds RankSafe for the decisions
    # save_encoder: one writer; load_encoder: every rank ends with rank 0's encoder
    assert r0["differ_before"][0] != r0["differ_before"][1]
    assert (r0["encoder_saves"], r1["encoder_saves"]) == (1, 0)
    assert r0["encoder"] == r1["encoder"] == r0["differ_before"][0]
    assert os.listdir(tmp_path / "text" / "models") == ["enc.pth"]
    # load_pretrained: both ranks hold rank 0's pretrained weights; a missing vocabulary fails both ranks
    expected = [x + 1 for x in r0["before_pretrained"]]
    assert r0["pretrained"] == pytest.approx(expected) and r1["pretrained"] == pytest.approx(expected)
    for v in (r0, r1):
        m = v["pretrained_missing"]
        assert "RankFailure" in m["error"] and "FileNotFoundError" in m["error"] and m["ranks"] == [0, 1], m
    # get_preds(save_preds=...): 2 validation batches written once each
    assert (r0["preds"]["saves"], r1["preds"]["saves"]) == (2, 0) and r0["preds"]["files"] == ["0", "1"]
    # the predictions and targets of the loader, each batch once (before: every batch gathered from both ranks)
    assert r0["preds"]["right"] and r1["preds"]["right"] and r0["preds"]["rows"] == [8, 8]
    # failures are raised on both ranks, fast, naming rank 0, as the built-in type too
    for v in (r0, r1):
        f = v["failed_save"]
        assert f["error"] and "RankFailure" in f["error"] and "NotADirectoryError" in f["error"], f
        assert f["ranks"] == [0] and f["seconds"] < 5
        m = v["missing_load"]
        assert "RankFailure" in m["error"] and "FileNotFoundError" in m["error"] and m["seconds"] < 5, m
        assert "UntrustedCheckpoint" in v["untrusted"]["error"]
    # one rank failing alone mid-fit: the other raises at once (RANKSAFE_TIMEOUT is 30 s, PG timeout 60 s)
    assert r1["fails_alone"]["error"][0] == "OSError"
    f = r0["fails_alone"]
    assert "RankFailure" in f["error"] and "OSError" in f["error"] and f["ranks"] == [1], f
    assert f["seconds"] < 15, f  # the whole fit up to the failure, then the abort; not a 30-60 s wait


# ------------------------------------------------------------------------------ one process: stock behaviour


def _train_single(path, safe: bool):
    from fastai.torch_core import set_seed

    set_seed(0, reproducible=True)  # python, numpy and torch: the shuffles and the initial weights
    path.mkdir()  # stock CSVLogger creates only the parent of learn.path
    learn = _learner(path, safe, CSVLogger())
    with learn.no_bar(), learn.no_logging():
        learn.fit(3, 1e-2, cbs=SaveModelCallback(fname="best", with_opt=True))
    learn.remove_cb(CSVLogger)
    learn.export()
    return learn


def test_single_process_files_and_results_match_stock_fastai(tmp_path):
    from fastai.learner import load_model

    stock, safe = _train_single(tmp_path / "stock", False), _train_single(tmp_path / "safe", True)
    listing = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*"))  # noqa: E731
    assert listing(tmp_path / "stock") == listing(tmp_path / "safe") == [
        "export.pkl", "history.csv", "models", "models/best.pth"
    ]  # fmt: skip
    assert stock.recorder.values == safe.recorder.values and params(stock) == params(safe)
    assert (tmp_path / "stock/history.csv").read_text().splitlines()[1:] != []
    # stock fastai reads what ranksafe wrote, and the other way round
    fresh = _learner(tmp_path / "x", False)
    fresh.create_opt()
    load_model(tmp_path / "safe/models/best.pth", fresh.model, fresh.opt)
    assert params(fresh) == params(safe)
    again = _learner(tmp_path / "stock", True)
    again.load("best")
    assert params(again) == params(stock)
    loaded = rf.load_learner(tmp_path / "safe/export.pkl", trusted=True)
    assert params(loaded) == params(safe)
    # data export: a pickle, so reading it back needs trusted=True
    rf.export_data(tabular_dls(tmp_path), tmp_path / "data/dls.pkl")
    with pytest.raises(ranksafe.UntrustedCheckpoint):
        rf.load_data(tmp_path / "data/dls.pkl")
    dls = rf.load_data(tmp_path / "data/dls.pkl", trusted=True)
    assert len(dls.train_ds) == 48 and len(dls.valid_ds) == 16


class NanOnRank0(Callback):
    """Rank 0's second batch of epoch 1 has a NaN feature: bad data in its shard only."""

    order = 1

    def before_batch(self):
        if ranksafe.rank() == 0 and self.training and self.epoch == 1 and self.iter == 1:
            xb = list(self.learn.xb)
            xb[1] = xb[1].clone()
            xb[1][0, 0] = float("nan")
            self.learn.xb = tuple(xb)


def _nan_on_one_rank(rank, root, safe):
    from fastai.callback.tracker import TerminateOnNaNCallback

    nan = TerminateOnNaNCallback()
    learn = _learner(root, safe, nan)  # the Learner's own callback: an export after the fit pickles it
    start = time.monotonic()
    try:
        watch = _fit_watch(learn, 4, NanOnRank0())
        ranksafe.barrier("after fit", timeout=8)  # the script goes on with a collective
    except Exception as e:
        return {"error": type(e).__name__, "seconds": time.monotonic() - start}
    left = sorted(vars(nan))
    nan.learn = None
    pickle.loads(pickle.dumps(nan))  # as an export and load_learner would
    return {"epochs": watch.epochs, "seconds": time.monotonic() - start, "left": left}


def test_terminate_on_nan_stops_every_rank_at_the_same_batch(tmp_path):
    """Stock TerminateOnNaNCallback looks at each rank's own loss: rank 0 stops, rank 1 trains on (into the
    gradient all-reduce, or further: here it trained every epoch). With RankSafe every rank stops after the
    same batch."""
    env = {"TEST_PG_TIMEOUT": "8"}
    stock = run_ranks(_nan_on_one_rank, 2, args=(str(tmp_path / "stock"), False), env=env, timeout=120)
    safe = run_ranks(_nan_on_one_rank, 2, args=(str(tmp_path / "safe"), True), env=env, timeout=120).values
    print("stock:", [r.value or r.error_type for r in stock.results], "\nranksafe:", safe)
    outcomes = [r.value.get("epochs", r.value.get("error")) if r.value else r.error_type for r in stock.results]
    assert outcomes[0] != outcomes[1]  # the control: the ranks went different ways
    assert safe[0] == {**safe[1], "seconds": safe[0]["seconds"]} and "error" not in safe[0]
    assert safe[0]["epochs"] == 1  # stopped in epoch 1 (no epoch end), on both ranks
    for rank in safe:  # RankSafe's wrapper is gone after the fit (and the callback pickles, as an export needs)
        assert "after_batch" not in rank["left"] and "_ranksafe_wrapped" not in rank["left"]


def _fit_scoped_fails_alone(rank, root):
    """RankSafe passed to this fit only (``fit(cbs=[RankSafe()])``), not attached to the Learner: its ``fit`` is
    fastai's own, with no ranksafe wrapper around it. Rank 1 fails alone at the end of epoch 1."""
    from ranksafe.fastai import prepare_distributed

    prepare_distributed()  # what torchrun's variables would do: distrib_ctx below trains with DDP
    learn = _learner(root, False)
    start = time.monotonic()
    try:
        _fit_watch(learn, 3, RankSafe(), FailAlone(rank=1, epoch=1))
    except Exception as e:
        return {"error": type(e).__name__, "msg": str(e)[:400], "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def test_a_failure_on_one_rank_reaches_the_others_with_ranksafe_passed_to_fit_only(tmp_path):
    r0, r1 = run_ranks(_fit_scoped_fails_alone, 2, args=(str(tmp_path),), timeout=120).values
    print(r0, r1, sep="\n")
    assert r1["error"] == "OSError"
    # before: rank 0 waited in the next epoch's barrier for RANKSAFE_TIMEOUT (30 s), then named rank 1 missing
    assert r0["error"].startswith("RankFailure") and "rank 1" in r0["msg"] and "No space left" in r0["msg"], r0
    assert r0["seconds"] < 15, r0


def _fit_only_in_an_except_block(rank, root):
    """RankSafe passed to this fit only, and the fit called on rank 0 while it handles an earlier error (a retry)."""
    from ranksafe.fastai import prepare_distributed

    prepare_distributed()
    learn = _learner(root, False)
    try:
        if rank == 0:
            try:
                raise ValueError("handled before the fit")
            except ValueError:
                _fit_watch(learn, 1, RankSafe())
        else:
            _fit_watch(learn, 1, RankSafe())
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:300]
    return None


def test_a_fit_called_while_the_caller_handles_an_error_ends_well_on_every_rank(tmp_path):
    """Before: at the fit's end RankSafe took the error the caller was handling for the fit's own, and posted it:
    rank 1's fit raised a RankFailure naming rank 0's ValueError, from a fit that went well everywhere."""
    assert run_ranks(_fit_only_in_an_except_block, 2, args=(str(tmp_path),), timeout=120).values == [None, None]


def _validates_alone(rank, root):
    learn = _learner(root, True)
    _fit_watch(learn, 1)
    start = time.monotonic()
    alone = [float(v) for v in learn.validate()] if rank == 0 else None  # common after training: rank 0 evaluates
    seconds = time.monotonic() - start
    ranksafe.barrier("rank 0 validated")
    return {"alone": alone, "seconds": seconds, "every rank": [float(v) for v in learn.validate()]}


def test_one_rank_validates_alone_after_the_fit_as_every_rank_would(tmp_path):
    """Before: fastai's loss gathered each batch from every rank (RankSafe exports WORLD_SIZE under mp.spawn, as
    torchrun does), and RankSafe broadcast the record: rank 0 waited for a rank that never came."""
    env = {"TEST_PG_TIMEOUT": "20"}
    r0, r1 = run_ranks(_validates_alone, 2, args=(str(tmp_path),), env=env, launch_env=True, timeout=90).values
    assert r0["alone"] == r0["every rank"] == r1["every rank"] and r0["seconds"] < 5, (r0, r1)


class FailAtEnd(Callback):
    """Raise on one rank only in ``after_fit``, after RankSafe's last collective (a logger closing its file)."""

    order = 70

    def __init__(self, rank):
        self.fail_rank = rank

    def after_fit(self):
        if ranksafe.rank() == self.fail_rank:
            raise OSError(28, "No space left on device (closing the log, injected on one rank)")


def _fails_at_the_end(rank, root, how, port=None):
    """Spawned, no RANK, nothing prepared by hand: the Learner has RankSafe, or only this fit does."""
    torch.manual_seed(rank)  # different initial weights: DDP must make them equal
    learn = _learner(root, how in ("attached", "attached before the process group"))
    if port is not None:  # the process group comes after the Learner
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    early = [RankSafe()] if how == "fit only, made before distrib_ctx" else []
    watch = Watch()
    start = time.monotonic()
    try:
        with learn.no_bar(), learn.no_logging(), learn.distrib_ctx(sync_bn=False):
            late = [RankSafe()] if how == "fit only, made inside distrib_ctx" else []
            learn.fit(2, 1e-2, cbs=[watch, FailAtEnd(rank=1), *early, *late])
        error = None
    except Exception as e:
        error = {"type": type(e).__name__, "msg": str(e)[:600]}
    seen = vars(watch)  # empty when no before_fit reached it
    weights = seen["weights"][-1] if seen.get("weights") else None
    left = [type(cb).__name__ for cb in learn.cbs if isinstance(cb, RankSafe)] + [hasattr(learn, "rank_safe")]
    return {
        "error": error, "seconds": time.monotonic() - start, "shards": seen.get("shards", []), "weights": weights,
        "left": left,
    }  # fmt: skip


@pytest.mark.parametrize("how", ["attached", "fit only, made before distrib_ctx"])
def test_a_failure_after_the_last_collective_of_a_fit_reaches_every_rank(tmp_path, how):
    """Before: rank 1 failing in ``after_fit`` alone left rank 0's fit returning as if all went well."""
    r0, r1 = run_ranks(_fails_at_the_end, 2, args=(str(tmp_path), how), timeout=180).values
    print(r0, r1, sep="\n")
    assert r1["error"]["type"] == "OSError"
    assert r0["error"] is not None and r0["error"]["type"] == "RankFailure[OSError]", r0
    assert "rank 1" in r0["error"]["msg"] and "closing the log" in r0["error"]["msg"] and r0["seconds"] < 20
    for v, rank in ((r0, 0), (r1, 1)):  # DDP on two data shards, whichever way RankSafe came
        assert v["shards"][0] == ("DistributedDataParallel", rank, 2), v["shards"]
    assert r0["weights"] == r1["weights"]
    # a fit-only RankSafe is gone from the Learner, also on rank 0, where the barrier in fastai's remove_cb raised
    # (before: it stayed in learn.cbs, with learn None)
    assert r0["left"] == r1["left"] == (["RankSafe", True] if how == "attached" else [False]), (r0["left"], r1["left"])


@pytest.mark.parametrize("how", ["fit only, made inside distrib_ctx", "attached before the process group"])
def test_a_ranksafe_made_inside_distrib_ctx_under_mp_spawn_refuses_to_train_each_rank_alone(tmp_path, how):
    """Under mp.spawn (no RANK), ``distrib_ctx`` entered before RankSafe exported the ranks saw no job: it added no
    DistributedTrainer, and each rank would train its own model while RankSafe treated them as one job. Every rank
    raises instead, before the first epoch, saying what to write."""
    late = how == "attached before the process group"
    args = (str(tmp_path), how, free_port() if late else None)
    r0, r1 = run_ranks(_fails_at_the_end, 2, args=args, init=not late, timeout=180).values
    print(r0, r1, sep="\n")
    for v, rank in ((r0, 0), (r1, 1)):
        assert v["error"]["type"] == "RuntimeError", v
        assert f"rank {rank}: fastai sees no distributed job" in v["error"]["msg"], v
        assert "then make RankSafe (or its Learner) before entering distrib_ctx" in v["error"]["msg"], v
        assert v["shards"] == [] and v["weights"] is None  # no epoch trained


def _torchrun_fit(rank, root, inside_distrib_ctx):
    """Launched as torchrun would (RANK in the environment): fastai needs no help to see the job."""
    learn = _learner(root, True)
    watch = Watch()
    with warnings.catch_warnings(record=True) as caught, learn.no_bar(), learn.no_logging():
        warnings.simplefilter("always")
        if inside_distrib_ctx:
            with learn.distrib_ctx(sync_bn=False):
                learn.fit(1, 1e-2, cbs=[watch])
        else:
            learn.fit(1, 1e-2, cbs=[watch])
    alone = [str(w.message) for w in caught if "each rank trains alone" in str(w.message)]
    return {"alone": alone, "shards": watch.shards}


@pytest.mark.parametrize("inside", [False, True])
def test_under_torchrun_a_fit_outside_distrib_ctx_warns_on_every_rank_that_each_trains_alone(tmp_path, inside):
    """Before: stock fastai's behaviour, silently: no DDP, every rank trained its own model on all the data, while
    RankSafe treated the ranks as one job (rank 0's weights saved, rank 0's record taken by every tracker)."""
    values = run_ranks(_torchrun_fit, 2, args=(str(tmp_path), inside), launch_env=True, timeout=120).values
    for rank, v in enumerate(values):
        if inside:
            assert v["alone"] == [] and v["shards"] == [("DistributedDataParallel", rank, 2)], v
        else:
            assert v["shards"] == [("Lin", None, None)], v  # what the warning says happened
            (message,) = v["alone"]
            assert message.startswith(f"rank {rank}: 2 ranks, but the model is not wrapped"), message


class FailsInBatch3(Callback):
    order = 70

    def after_batch(self):
        if self.training and self.iter == 2:
            raise RuntimeError("failed in batch 3")


def _failed_lr_find(rank, root):
    learn = _learner(root, True, FailsInBatch3())
    try:
        with learn.no_bar(), learn.no_logging(), learn.distrib_ctx(sync_bn=False):
            learn.lr_find(num_it=12, show_plot=False)
        error = None
    except RuntimeError as e:
        error = str(e)
    return error


def test_an_lr_find_that_fails_leaves_no_temporary_model_behind(tmp_path):
    """Before: RankSafe's lr_find made its temporary directory with mkdtemp and removed it in after_fit, which a fit
    that raises never runs: models/tmp.../_tmp.pth stayed. fastai's own (a TemporaryDirectory) goes with LRFinder."""
    values = run_ranks(_failed_lr_find, 2, args=(str(tmp_path),), launch_env=True, timeout=120).values
    assert all("failed in batch 3" in error for error in values), values
    # once every rank has ended: rank 0 removes it on its way out, which another rank's listing could come before
    assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("safe", [False, True], ids=["stock", "ranksafe"])
def test_load_takes_a_file_object_and_leaves_the_optimizer_alone_with_with_opt_none(tmp_path, safe):
    """Before, with RankSafe: a file object raised TypeError (its save took one), and with_opt=None loaded the
    optimizer's state, where fastai's Learner.load leaves it (TextLearner.load takes None for a yes)."""
    learn = _learner(tmp_path, safe)
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-2)
    learn.save("m")
    learn.opt.set_hyper("lr", 0.5)
    learn.load("m", with_opt=None)
    assert learn.opt.hypers[0]["lr"] == 0.5
    buffer = io.BytesIO()
    learn.save(buffer)
    saved = params(learn)
    with torch.no_grad():
        for p in learn.model.parameters():
            p.zero_()
    buffer.seek(0)
    learn.load(buffer)
    assert params(learn) == saved
