"""fastai with ``learn.path`` on remote storage (an fsspec URL): models, exports, lr_find and checkpoints go
there, never to a local folder named after the URL; a bucket that cannot be written fails every rank at fit start."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastai")

import fsspec
from fastai.tabular.all import Callback, Learner, MSELossFlat
from fastai.torch_core import set_seed

import ranksafe
from ranksafe.fastai import RankSafe, load_learner
from tests.ranks import run_ranks
from tests.s3 import s3_server
from tests.test_fastai import Lin, params, tabular_dls


def _learner(path, cbs) -> Learner:
    set_seed(0, reproducible=True)
    return Learner(tabular_dls(Path(".")), Lin(), loss_func=MSELossFlat(), path=Path(path), cbs=cbs)


def test_learn_path_on_memory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    learn = _learner("memory://fastai", [RankSafe(checkpoint_dir="ckpt", keep=2)])
    with learn.no_bar(), learn.no_logging():
        learn.fit(2, 1e-2)
        learn.save("model")
        learn.export()
        learn.lr_find(num_it=5, show_plot=False)
    trained = params(learn)
    assert sorted(fs.ls("/fastai", detail=False)) == ["/fastai/ckpt", "/fastai/export.pkl", "/fastai/models"]
    assert fs.ls("/fastai/models", detail=False) == ["/fastai/models/model.pth"]  # lr_find's model is gone again
    assert [s.step for s in ranksafe.list_steps("memory://fastai/ckpt")] == [0, 1]
    fresh = _learner("memory://fastai", [RankSafe(checkpoint_dir="ckpt", keep=2)])
    fresh.load("model")
    assert params(fresh) == trained
    exported = load_learner("memory://fastai/export.pkl", trusted=True)
    assert params(exported) == trained
    assert os.listdir(tmp_path) == [], "nothing may land in a local folder named after the URL"


class Batches(Callback):
    def before_fit(self):
        self.batches = 0

    def after_batch(self):
        self.batches += 1 if self.training else 0


def _missing_bucket(rank, root):
    count = Batches()
    learn = _learner(root, [RankSafe(checkpoint_dir="ckpt"), count])
    try:
        with learn.no_bar(), learn.no_logging(), learn.distrib_ctx(sync_bn=False):
            learn.fit(1, 1e-2)
        return "trained"
    except OSError as e:
        return f"{type(e).__name__} after {count.batches} batches: {e}"


def test_a_missing_bucket_fails_every_rank_at_fit_start():
    with s3_server() as env:
        values = run_ranks(_missing_bucket, 2, args=("s3://no-such-bucket/run",), env=env, timeout=120).values
    for said in values:
        assert said.startswith("RankFailure[FileNotFoundError] after 0 batches"), said
        assert "cannot write checkpoints to s3://no-such-bucket/run/ckpt (rank 0)" in said


def test_a_resume_on_memory_restores_the_generators_and_ends_where_an_uninterrupted_run_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fsspec.filesystem("memory").store.clear()
    whole = _learner("memory://whole", [RankSafe(checkpoint_dir="ckpt")])
    with whole.no_bar(), whole.no_logging():
        whole.fit(3, 1e-2)
    first = _learner("memory://run", [RankSafe(checkpoint_dir="ckpt")])  # seeded as whole was
    with first.no_bar(), first.no_logging():
        first.fit(2, 1e-2)  # stopped after 2 of 3 epochs
    assert fsspec.filesystem("memory").exists("/run/ckpt/step_00000001/rng-00000.pt")
    again = _learner("memory://run", [RankSafe(checkpoint_dir="ckpt", resume=True)])
    torch.manual_seed(123)  # as a new process would: other generators until the resume restores them
    with warnings.catch_warnings(record=True) as seen, again.no_bar(), again.no_logging():
        warnings.simplefilter("always")
        again.fit(3, 1e-2)
    assert not [str(w.message) for w in seen if "random generators not restored" in str(w.message)]
    assert params(again) == params(whole)


def test_urls_given_to_a_learner_with_a_local_path_are_written_there(tmp_path, monkeypatch):
    """pathlib joins ``learn.path / "memory://bkt/x"`` into a local folder ``memory:``; each URL must stay one."""
    monkeypatch.chdir(tmp_path)
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    learn = _learner(tmp_path / "run", [RankSafe(checkpoint_dir="memory://bkt/ckpt")])
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-2)
        learn.save("memory://bkt/model")
        learn.export("memory://bkt/export.pkl")
    assert sorted(fs.ls("/bkt", detail=False)) == ["/bkt/ckpt", "/bkt/export.pkl", "/bkt/model.pth"]
    assert [s.step for s in ranksafe.list_steps("memory://bkt/ckpt")] == [0]
    assert not (tmp_path / "run").exists() and os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_a_manager_that_cannot_be_made_fails_the_fit_with_its_own_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fsspec.filesystem("memory").store.clear()
    with pytest.raises(ValueError, match="keep must be a positive int"):
        RankSafe(checkpoint_dir="ckpt", keep=0)  # refused when made, not at the first fit
    learn = _learner("memory://run", [RankSafe(checkpoint_dir="ckpt", storage="local")])
    with learn.no_bar(), learn.no_logging(), pytest.raises(ValueError, match="not storage='local'"):
        learn.fit(1, 1e-2)  # was an AttributeError from the fit's clean-up, hiding this one


def test_load_pretrained_reads_weights_and_vocabulary_from_remote_storage(tmp_path, monkeypatch):
    from tests.test_fastai import _text_learner

    monkeypatch.chdir(tmp_path)
    fsspec.filesystem("memory").store.clear()
    learn = _text_learner(str(tmp_path / "text"))
    learn.dls.vocab = [f"w{i}" for i in range(20)]
    pretrained = {k: v + 1 for k, v in learn.model.state_dict().items()}
    ranksafe.save(pretrained, "memory://lm/lm.pth")
    with fsspec.open("memory://lm/vocab.pkl", "wb") as f:
        pickle.dump(learn.dls.vocab, f)
    learn.load_pretrained("memory://lm/lm.pth", "memory://lm/vocab.pkl")  # the vocabulary was read as a local file
    assert all(torch.equal(v, pretrained[k]) for k, v in learn.model.state_dict().items())


def test_a_csv_logger_on_remote_storage_is_refused_before_it_makes_a_local_folder(tmp_path, monkeypatch):
    from fastai.callback.progress import CSVLogger

    monkeypatch.chdir(tmp_path)
    learn = _learner("memory://run", [RankSafe(), CSVLogger()])
    with learn.no_bar(), learn.no_logging(), pytest.raises(ValueError, match="CSVLogger writes local files only"):
        learn.fit(1, 1e-2)
    assert os.listdir(tmp_path) == [], "no local folder named after the URL"
    local = _learner("memory://run", [RankSafe(), CSVLogger(fname=str(tmp_path / "history.csv"))])
    with local.no_bar(), local.no_logging():
        local.fit(1, 1e-2)  # an absolute local file is fine
    assert (tmp_path / "history.csv").read_text().startswith("epoch,train_loss")
    assert os.listdir(tmp_path) == ["history.csv"], "fastai made learn.path's parent: a local folder 'memory:'"


def test_storage_options_reach_a_checkpoint_dir_on_s3_and_stay_out_of_an_export(tmp_path, monkeypatch):
    """``RankSafe(storage_options=...)``: the only way to the server here is the options (the environment names no
    endpoint); a resumed fit reads its step back through them; an export never holds them (credentials)."""
    monkeypatch.chdir(tmp_path)
    with s3_server() as env:
        options = {"endpoint_url": env["AWS_ENDPOINT_URL"], "key": "testing", "secret": "a-secret"}
        monkeypatch.delenv("AWS_ENDPOINT_URL")
        fsspec.filesystem("s3", **options).mkdir("fastai-opts")
        learn = _learner(tmp_path, [RankSafe(checkpoint_dir="s3://fastai-opts/run", storage_options=options)])
        with learn.no_bar(), learn.no_logging():
            learn.fit(2, 1e-2)
            learn.export()
        steps = ranksafe.list_steps("s3://fastai-opts/run", storage_options=options)
        assert [(s.step, s.status.value) for s in steps] == [(0, "committed"), (1, "committed")]
        assert b"a-secret" not in (tmp_path / "export.pkl").read_bytes()
        counted = Batches()
        again = RankSafe(checkpoint_dir="s3://fastai-opts/run", storage_options=options)
        resumed = _learner(tmp_path, [again, counted])
        resumed.resume()
        with resumed.no_bar(), resumed.no_logging():
            resumed.fit(3, 1e-2)
        assert counted.batches == len(resumed.dls.train)  # the third epoch only
