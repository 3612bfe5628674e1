"""One real ``Trainer(strategy="ddp", devices=2)`` run with background saves and/or a CheckpointManager.

Driven by tests/test_lightning_async.py; Lightning's "ddp" launcher re-runs this file for rank 1. Global rank
0's background writes are slowed by ``--slow-write`` seconds (so training runs ahead while a write is in
flight) and the ``--fail-write``-th one raises OSError. Each rank reports what it saw in ``OUT/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--async-save", action="store_true")
parser.add_argument("--slow-write", type=float, default=0.0)
parser.add_argument("--fail-write", type=int, default=0, help="this write and every later one fail (a full disk)")
parser.add_argument("--every-n-steps", type=int, default=0, help="ModelCheckpoint(save_top_k=1) every N steps")
parser.add_argument("--manager-keep", type=int, default=0, help="RankSafe(checkpoint_dir=OUT/managed, keep=K)")
parser.add_argument("--resume", action="store_true", help="RankSafe(resume=True)")
parser.add_argument("--manager-async", action="store_true", help="RankSafe(async_save=True): background commits")
args = parser.parse_args()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import ranksafe  # noqa: E402
import ranksafe.files  # noqa: E402
from ranksafe.lightning import RankSafe, RankSafeCheckpointIO  # noqa: E402

CKPT_DIR = os.path.join(args.out, "ckpts")
RANK = int(os.environ.get("LOCAL_RANK", 0))
TRAINER: pl.Trainer | None = None
events: list[dict] = []  # rank 0's plugin events, in order


def record(name: str, **values) -> None:
    """What this rank saw, for the test to read: whole or absent, never half-written."""
    with ranksafe.files.atomic_write(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(values, f)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.register_buffer("ballast", torch.zeros(1 << 18))  # 1 MiB: the write is not instantaneous

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class InstrumentedIO(RankSafeCheckpointIO):
    """Logs rank 0's writes and removals; slows the writes down and fails the requested one."""

    writes = 0

    def _write(self, checkpoint, path, **kw):
        InstrumentedIO.writes += 1
        if args.fail_write and InstrumentedIO.writes >= args.fail_write:
            events.append({"kind": "fault", "path": path})
            record("fault", t=time.time(), step=TRAINER.global_step, path=path)
            raise OSError(errno.ENOSPC, f"No space left on device (injected) writing {path}")
        time.sleep(args.slow_write)
        live_step = TRAINER.global_step  # where training is while this (older) snapshot is written
        super()._write(checkpoint, path, **kw)
        events.append({"kind": "commit", "path": path, "thread": threading.current_thread().name, "live": live_step})

    def remove_checkpoint(self, path):
        events.append({"kind": "remove requested", "path": str(path), "on_disk": sorted(os.listdir(CKPT_DIR))})
        super().remove_checkpoint(path)

    def _remove(self, path):
        events.append({"kind": "delete", "path": str(path), "on_disk": sorted(os.listdir(CKPT_DIR))})
        super()._remove(path)


class Probe(pl.Callback):
    """Weights after every step, the lock as another thread sees it, and where training stopped."""

    start_step = None
    raised_step = None

    def __init__(self) -> None:
        self.weights: dict[int, list[float]] = {}
        self.reader_blocked: list[bool] = []  # during the optimizer step
        self.reader_free: list[bool] = []  # between steps

    def _try_read(self, io) -> bool:
        """Whether a snapshot thread could take the read side of the plugin's lock now."""
        got = []

        def attempt() -> None:
            got.append(io.lock.acquire_read(timeout=0.05))
            if got[0]:
                io.lock.release_read()

        t = threading.Thread(target=attempt)
        t.start()
        t.join()
        return got[0]

    def on_train_start(self, trainer, pl_module):
        Probe.start_step = trainer.global_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if args.async_save and trainer.global_step < 2:
            self.reader_blocked.append(not self._try_read(trainer.strategy.checkpoint_io))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights[trainer.global_step] = pl_module.layer.weight.detach().flatten().tolist()
        if args.async_save and trainer.global_step < 3:
            self.reader_free.append(self._try_read(trainer.strategy.checkpoint_io))

    def on_exception(self, trainer, pl_module, exception):
        Probe.raised_step = trainer.global_step


def loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)  # 24 batches: 12 steps per rank and epoch


def main() -> None:
    global TRAINER
    torch.manual_seed(0)
    probe = Probe()
    callbacks: list[pl.Callback] = [probe]
    managed = os.path.join(args.out, "managed")
    callbacks.append(
        RankSafe(checkpoint_dir=managed, keep=args.manager_keep, resume=args.resume, async_save=args.manager_async)
        if args.manager_keep
        else RankSafe()
    )
    if args.every_n_steps:
        callbacks.append(
            ModelCheckpoint(dirpath=CKPT_DIR, filename="{step}", save_top_k=1, every_n_train_steps=args.every_n_steps)
        )
    TRAINER = trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs, callbacks=callbacks,
        plugins=[InstrumentedIO(async_save=args.async_save)], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(args.every_n_steps), num_sanity_val_steps=0,
    )  # fmt: skip
    result: dict = {"error_type": None, "error": None}
    try:
        trainer.fit(Model(), loader())
    except BaseException as e:
        result.update(error_type=[t.__name__ for t in type(e).__mro__], error=str(e))
        raise
    finally:
        files, names = {}, sorted(os.listdir(CKPT_DIR)) if RANK == 0 and os.path.isdir(CKPT_DIR) else []
        for name in (n for n in names if n.endswith(".ckpt") and not n.startswith(".")):
            path = os.path.join(CKPT_DIR, name)
            state = torch.load(path, weights_only=True)
            step = state["global_step"]
            files[name] = {
                "verified": ranksafe.verify_file(path),
                "global_step": step,
                "weights": state["state_dict"]["layer.weight"].flatten().tolist(),
                "weights_at_step": probe.weights.get(step),
                "weights_next_step": probe.weights.get(step + 1),
            }
        steps = ranksafe.list_steps(managed) if os.path.isdir(managed) else []
        result.update(
            rank=RANK, t_raised=time.time(), start_step=Probe.start_step, global_step=trainer.global_step,
            raised_step=Probe.raised_step, ckpt_path=None if trainer.ckpt_path is None else str(trainer.ckpt_path),
            names=names, files=files, events=events if RANK == 0 else [],
            reader_blocked=probe.reader_blocked, reader_free=probe.reader_free,
            writer_threads=[t.name for t in threading.enumerate() if t.name == "ranksafe-async-save"],
            managed=[(s.step, s.status) for s in steps],
        )  # fmt: skip
        record(f"rank{RANK}", **result)


if __name__ == "__main__":
    main()
