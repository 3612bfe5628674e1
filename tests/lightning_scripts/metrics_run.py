"""A ``Trainer(strategy="ddp", devices=2)`` fit on CPU whose metrics are not the same on every rank, driven by
tests/test_lightning_ddp.py. Lightning's "ddp" launcher re-runs this file for rank 1.

Each validation logs ``val_loss`` synchronised, ``acc`` per rank without ``sync_dist`` (it goes into the checkpoint's
file name only), and ``score`` on rank 0 alone (``rank_zero_only=True``, as a metric computed on rank 0 is): the
metric EarlyStopping watches, with ``strict=False``. ``score`` gets worse every epoch, so that EarlyStopping stops the
fit after its patience of one epoch. Each rank reports what it saw in ``OUT/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--stock", action="store_true", help="stock Lightning: no RankSafe callback")
args = parser.parse_args()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import ranksafe.files  # noqa: E402
from ranksafe.lightning import RankSafe  # noqa: E402


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", 1.0 / (1 + self.current_epoch), sync_dist=True)
        self.log("acc", 0.5 + 0.1 * self.global_rank)
        if self.global_rank == 0:
            self.log("score", 10.0 - self.current_epoch, rank_zero_only=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def main() -> None:
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(
        dirpath=os.path.join(args.out, "ckpts"), filename="{epoch}-{acc:.2f}", monitor="val_loss", save_top_k=2
    )
    stopping = EarlyStopping(monitor="score", mode="max", patience=1, strict=False)
    callbacks = [checkpoint, stopping] + ([] if args.stock else [RankSafe()])
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=5, callbacks=callbacks,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=20)), logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    result: dict = {"error": None}
    try:
        trainer.fit(Model(), loader(), loader())
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"[:600]
    finally:
        rank = trainer.global_rank
        result.update(
            t=time.time(), epoch=trainer.current_epoch, stopped_epoch=stopping.stopped_epoch,
            es_best=float(stopping.best_score), wait=stopping.wait_count,
            best_model_path=checkpoint.best_model_path, best_k=sorted(checkpoint.best_k_models),
            metrics=sorted(trainer.callback_metrics),
        )  # fmt: skip
        with ranksafe.files.atomic_write(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
