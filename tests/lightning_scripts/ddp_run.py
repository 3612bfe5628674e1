"""One real ``Trainer(strategy="ddp", devices=2)`` run on CPU, driven by tests/test_lightning.py.

Lightning's "ddp" launcher re-runs this file (same arguments) for rank 1, so everything here runs on both
ranks. Faults are injected on global rank 0's checkpoint writes only: ``--fail-save N`` makes the Nth write
raise OSError, ``--kill-save N`` SIGKILLs the writer once the Nth write is under way. Each rank reports what
it saw in ``OUT/rank<R>.json``; the test process reads those files.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import pickle
import signal
import time
from datetime import timedelta

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--stock", action="store_true", help="stock Lightning: no RankSafe callback, TorchCheckpointIO")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--fail-save", type=int, default=0)
parser.add_argument("--after-fail", choices=["exit", "stay"], default="exit")
parser.add_argument("--kill-save", type=int, default=0)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--fail-step", type=int, default=0, help="rank 1's training step of this global step raises")
parser.add_argument("--save-on-exception", action="store_true", help="ModelCheckpoint(save_on_exception=True)")
parser.add_argument("--pg-timeout", type=float, default=0, help="seconds; 0: strategy='ddp' with its defaults")
parser.add_argument("--exception-save-wait", type=float, default=0, help="seconds; 0: ranksafe's EXCEPTION_SAVE_WAIT")
args = parser.parse_args()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import ranksafe.files  # noqa: E402
from ranksafe.lightning import RankSafe, RankSafeCheckpointIO, compat, shared_io  # noqa: E402

CKPT_DIR = os.path.join(args.out, "ckpts")
if args.exception_save_wait:  # a test's shorter wait, so that the run need not outlast ranksafe's
    shared_io.EXCEPTION_SAVE_WAIT = args.exception_save_wait


def record(name: str, **values) -> None:
    """What this rank saw, for the test to read: whole or absent, never half-written."""
    with ranksafe.files.atomic_write(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(values, f)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.register_buffer("ballast", torch.zeros(1 << 20))  # 4 MiB: a write long enough to be killed halfway

    def training_step(self, batch, batch_idx):
        if self.global_step == args.fail_step > 0 and self.global_rank == 1:
            record("fault", t=time.time())
            raise RuntimeError("injected failure of rank 1's training step")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        # improves every epoch, differs across ranks, logged without sync_dist: what ranksafe must agree
        self.log("val_score", 10.0 - self.current_epoch + 0.5 * self.global_rank)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


BaseIO = TorchCheckpointIO if args.stock else RankSafeCheckpointIO


class FaultyIO(BaseIO):
    """Counts rank 0's checkpoint writes and injects the requested fault into one of them."""

    saves = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        FaultyIO.saves += 1
        if FaultyIO.saves == args.fail_save:
            record("fault", t=time.time(), path=str(path))
            raise OSError(errno.ENOSPC, f"No space left on device (injected) writing {path}")
        if FaultyIO.saves == args.kill_save:
            _arm_kill(str(path))
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


def _arm_kill(path: str) -> None:
    """SIGKILL this process from inside the checkpoint write, once 2 MiB of it went through the writer."""
    write = ranksafe.checkpoint_file.ChecksummingWriter.write

    def write_then_die(self, data):
        n = write(self, data)
        if self.length > 2 << 20:
            record("fault", t=time.time(), path=path)
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    ranksafe.checkpoint_file.ChecksummingWriter.write = write_then_die


def picklable(objects: dict) -> dict:
    """Whether each object pickles with pickle and with torch.save: "ok", or the error."""
    outcome = {}
    for name, obj in objects.items():
        try:
            pickle.dumps(obj)
            torch.save(obj, io.BytesIO())
            outcome[name] = "ok"
        except Exception as e:
            outcome[name] = repr(e)
    return outcome


def ranksafe_touches(trainer: pl.Trainer) -> dict:
    """The objects whose methods RankSafe wraps during a run."""
    return {
        "strategy": trainer.strategy,
        "connector": compat.checkpoint_connector(trainer),
        "ModelCheckpoint": trainer.checkpoint_callback,
        "EarlyStopping": trainer.early_stopping_callback,
    }


class Probe(pl.Callback):
    start_step = None
    pickled: dict = {}  # while training, RankSafe's wrappers installed

    def on_train_start(self, trainer, pl_module):
        Probe.start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == Probe.start_step + 1:
            rank_safe = [cb for cb in trainer.callbacks if isinstance(cb, RankSafe)]
            io_plugin = trainer.strategy.checkpoint_io
            Probe.pickled = picklable({**ranksafe_touches(trainer), "RankSafe": rank_safe, "checkpoint_io": io_plugin})


def loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def main() -> None:
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(
        dirpath=CKPT_DIR, filename="{epoch}-{val_score:.2f}", monitor="val_score", mode="min",
        save_top_k=2, save_last=True, every_n_epochs=1, save_on_exception=args.save_on_exception,
    )  # fmt: skip
    stopping = EarlyStopping(monitor="val_score", mode="min", patience=3)
    callbacks = [checkpoint, stopping, Probe()] + ([] if args.stock else [RankSafe()])
    strategy = (
        DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
        if args.pg_timeout
        else "ddp"
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs, callbacks=callbacks,
        plugins=[FaultyIO()], logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    result: dict = {"error_type": None, "error": None}
    try:
        trainer.fit(Model(), loader(), loader(), ckpt_path="last" if args.resume else None)
        trainer.save_checkpoint(os.path.join(args.out, "manual.ckpt"))  # from user code, on every rank
    except BaseException as e:
        result.update(error_type=[t.__name__ for t in type(e).__mro__], error=str(e))
        raise
    finally:
        rank = int(os.environ.get("LOCAL_RANK", 0))
        result.update(
            rank=rank, t_raised=time.time(), start_step=Probe.start_step, global_step=trainer.global_step,
            best_model_path=checkpoint.best_model_path, best_k=sorted(checkpoint.best_k_models),
            es_best=float(stopping.best_score), ckpt_path=str(trainer.ckpt_path), pickled=Probe.pickled,
            attributes={name: sorted(vars(obj)) for name, obj in ranksafe_touches(trainer).items()},
        )  # fmt: skip
        record(f"rank{rank}", **result)
        if rank == 0 and result["error"] and args.after_fail == "stay":  # keep rank 0's process alive
            deadline = time.time() + 40
            while not os.path.exists(os.path.join(args.out, "rank1.json")) and time.time() < deadline:
                time.sleep(0.1)


if __name__ == "__main__":
    main()
