"""Lightning with checkpoints on remote storage: fsspec URLs where stock Lightning takes them, in one process
(``memory://``) and on two DDP ranks against a local S3 server (moto) the test starts."""

from __future__ import annotations

import fsspec
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import ranksafe
from ranksafe.lightning import RankSafe, RankSafeCheckpointIO
from tests.ranks import run_ranks
from tests.s3 import make_bucket, s3_server
from tests.test_lightning import _loader


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Steps(Callback):
    """Counts the training steps this rank ran."""

    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, *args) -> None:
        self.steps += 1


def _trainer(epochs: int, callbacks: list, plugins: list, **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=callbacks, plugins=plugins, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_default_root_dir_on_memory_saves_and_resumes_like_stock(async_save):
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    root = f"memory://lightning-{async_save}"
    trainer = _trainer(2, [RankSafe()], [RankSafeCheckpointIO(async_save=async_save)], default_root_dir=root)
    trainer.fit(Model(), _loader())
    saved = fs.ls(f"/lightning-{async_save}/checkpoints", detail=False)
    assert saved == [f"/lightning-{async_save}/checkpoints/epoch=1-step=8.ckpt"]
    path = f"{root}/checkpoints/epoch=1-step=8.ckpt"
    assert ranksafe.verify_file(path) is True
    resumed = _trainer(3, [RankSafe()], [RankSafeCheckpointIO(async_save=async_save)], default_root_dir=root)
    resumed.fit(Model(), _loader(), ckpt_path=path)
    assert resumed.global_step == 12
    assert fs.ls(f"/lightning-{async_save}/checkpoints", detail=False) == [
        f"/lightning-{async_save}/checkpoints/epoch=2-step=12.ckpt"
    ]


def _ddp_on_s3(rank, bad_root, root):
    steps = Steps()
    out = {}
    trainer = _trainer(
        2, [ModelCheckpoint(dirpath=bad_root), RankSafe(), steps], [RankSafeCheckpointIO()], strategy="ddp", devices=2
    )
    try:
        trainer.fit(Model(), _loader())
    except OSError as e:
        out["bad"] = f"{type(e).__name__}: {e}"
    out["steps before failing"] = steps.steps
    for epochs in (1, 2):  # the second fit resumes from the first one's step
        trainer = _trainer(
            epochs, [RankSafe(checkpoint_dir=root, resume=True, keep=2)], [RankSafeCheckpointIO()], strategy="ddp",
            devices=2, enable_checkpointing=False,
        )  # fmt: skip
        trainer.fit(Model(), _loader())
        out[f"global step after fit {epochs}"] = trainer.global_step
    return out


def test_ddp_on_s3_fails_at_fit_start_for_a_missing_bucket_and_resumes_from_the_bucket():
    with s3_server() as env:
        make_bucket("lightning")
        args = ("s3://no-such-bucket/ckpts", "s3://lightning/managed")
        values = run_ranks(_ddp_on_s3, 2, args=args, env=env, launch_env=True, timeout=240).values
        steps = ranksafe.list_steps("s3://lightning/managed")
    for out in values:
        assert out["bad"].startswith("RankFailure[FileNotFoundError]: checkpoint directories: warmup failed"), out
        assert "cannot write checkpoints to s3://no-such-bucket/ckpts (rank 0)" in out["bad"]
        assert out["steps before failing"] == 0, "the bucket must fail the run before it trains"
        assert out["global step after fit 1"] == 2 and out["global step after fit 2"] == 4
    assert [(s.step, s.status) for s in steps] == [(2, "committed"), (4, "committed")]


def test_storage_options_reach_a_checkpoint_dir_on_s3_and_its_resume(monkeypatch, tmp_path):
    """``RankSafe(storage_options=...)``: the only way to the server here is the options (the environment names no
    endpoint), and a resumed fit reads its step back through them."""
    with s3_server() as env:
        options = {"endpoint_url": env["AWS_ENDPOINT_URL"], "key": "testing", "secret": "testing"}
        monkeypatch.delenv("AWS_ENDPOINT_URL")
        fsspec.filesystem("s3", **options).mkdir("lightning-opts")
        monkeypatch.chdir(tmp_path)  # Lightning's own ModelCheckpoint writes under the working directory
        trainer = _trainer(2, [RankSafe(checkpoint_dir="s3://lightning-opts/run", storage_options=options)], [])
        trainer.fit(Model(), _loader())
        steps = ranksafe.list_steps("s3://lightning-opts/run", storage_options=options)
        assert [(s.step, s.status.value) for s in steps] == [(4, "committed"), (8, "committed")]
        counted = Steps()
        cb = RankSafe(checkpoint_dir="s3://lightning-opts/run", storage_options=options, resume=True)
        resumed = _trainer(3, [cb, counted], [])
        resumed.fit(Model(), _loader())
        assert (resumed.global_step, counted.steps) == (12, 4)  # from step 8: one epoch more
