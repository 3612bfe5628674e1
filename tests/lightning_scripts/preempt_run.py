"""One Lightning fit on two CPU ranks that signals from outside may preempt, for tests/test_lightning_preemption.py.

Started two ways. Without launcher variables, ``Trainer(strategy="ddp", devices=2)`` re-runs this file for rank 1
(Lightning's own launcher). With SLURM's variables (the test starts one process per rank, as ``srun`` does),
Lightning reads them through ``SLURMEnvironment``, with ``auto_requeue=True``, its default.

Every rank writes ``OUT/pid-<rank>`` when training starts and ``OUT/step-<rank>`` (the global step) after every
optimizer step, for the test's signal sender, and ``OUT/<run>-rank<rank>.json`` when ``fit`` returned or raised.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import signal
import time
from datetime import timedelta

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--run", required=True, help="names this launch's reports")
parser.add_argument("--ranksafe", choices=["preemption", "without-preemption", "none"], default="preemption")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--every-n-train-steps", type=int, default=None)
parser.add_argument("--train-time-interval", type=float, default=None, help="seconds")
parser.add_argument("--skew", action="store_true", help="rank 1's clock runs three times as fast, 1,000 s ahead")
parser.add_argument("--step-time", type=float, default=0.05, help="seconds each training step takes at least")
parser.add_argument("--pg-timeout", type=float, default=0, help="seconds; 0: strategy='ddp' with its defaults")
args = parser.parse_args()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from resumable import ResumableLoader  # noqa: E402  (beside this file)

import ranksafe  # noqa: E402
from ranksafe.files import atomic_write  # noqa: E402
from ranksafe.lightning import RankSafe, compat  # noqa: E402

BATCH, STEPS_PER_EPOCH, VAL_STEPS, WORLD = 4, 8, 2, 2
CKPT_DIR = os.path.join(args.out, "ckpt")


def write(name: str, text: str) -> None:
    """Whole or absent, never half-written: the test reads these while the ranks run."""
    with atomic_write(os.path.join(args.out, name), "w") as f:
        f.write(text)


def decay(step: int) -> float:
    return 0.97**step


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.trained: list = []  # (epoch, batch index, global step before the step, the samples' ids)
        self.validated: list[int] = []  # the global step each validation batch runs at

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        self.trained.append((self.current_epoch, batch_idx, self.global_step, ids.tolist()))
        time.sleep(args.step_time)  # a step takes time: a signal from outside lands mid-run
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.validated.append(self.global_step)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        per_step = torch.optim.lr_scheduler.LambdaLR(opt, decay)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": per_step, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = BATCH * STEPS_PER_EPOCH * WORLD
        data = torch.utils.data.TensorDataset(
            torch.arange(n), torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
        )
        return ResumableLoader(data, batch_size=BATCH)  # Lightning adds a DistributedSampler: each rank its half

    def val_dataloader(self):
        n = BATCH * VAL_STEPS * WORLD
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(n, 4)), batch_size=BATCH)


def skewed_clock() -> float:
    return 3 * time.monotonic() + 1000.0


def picklable(objects: dict) -> dict:
    outcome = {}
    for name, obj in objects.items():
        try:
            pickle.dumps(obj)
            torch.save(obj, io.BytesIO())
            outcome[name] = "ok"
        except Exception as e:
            outcome[name] = repr(e)
    return outcome


def handler_names() -> dict:
    """Who handles SIGTERM and SIGUSR1 now: ranksafe's recorder, Lightning's, or the default action."""
    names = {}
    for s in (signal.SIGTERM, signal.SIGUSR1):
        handler = signal.getsignal(s)
        owner = getattr(handler, "__self__", handler)
        names[s.name] = f"{type(owner).__module__}.{type(owner).__qualname__}" if callable(handler) else handler.name
    return names


class Probe(pl.Callback):
    """What the test needs to see: this rank's steps as they end, its own clock's decisions, its state mid-fit."""

    def __init__(self, rank_safe: RankSafe | None) -> None:
        self.rank_safe = rank_safe
        self.clock, self.last, self.naive = time.monotonic, 0.0, []
        self.during: dict = {}

    def setup(self, trainer, pl_module, stage):
        if args.skew and trainer.global_rank == 1:
            self.clock = skewed_clock
            if self.rank_safe is not None:
                self.rank_safe.manager.schedule.clock = skewed_clock  # never read: rank 0's clock decides

    def on_train_start(self, trainer, pl_module):
        write(f"pid-{trainer.global_rank}", str(os.getpid()))
        self.last = self.clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        write(f"step-{trainer.global_rank}", str(trainer.global_step))
        if args.train_time_interval:  # what this rank would decide alone, by its own clock
            now = self.clock()
            self.naive.append(now - self.last >= args.train_time_interval)
            if self.naive[-1]:
                self.last = now
        if not self.during:
            touched = {"signal connector": compat.signal_connector(trainer), "RankSafe": self.rank_safe}
            self.during = {"handlers": handler_names(), "pickled": picklable(touched)}


def main() -> None:
    torch.manual_seed(0)
    rank_safe, saved = None, []
    if args.ranksafe != "none":
        interval = None if args.train_time_interval is None else timedelta(seconds=args.train_time_interval)
        rank_safe = RankSafe(
            checkpoint_dir=CKPT_DIR, keep=None, every_n_train_steps=args.every_n_train_steps,
            train_time_interval=interval, preemption=args.ranksafe == "preemption", resume=True,
        )  # fmt: skip
        save = rank_safe.manager.save

        def counted(step, *a, **kw):  # the steps this rank took part in saving
            saved.append(step)
            return save(step, *a, **kw)

        rank_safe.manager.save = counted
    probe = Probe(rank_safe)
    strategy = (
        DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
        if args.pg_timeout
        else "ddp"
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=args.epochs,
        callbacks=[probe] + ([rank_safe] if rank_safe else []), logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=args.out, num_sanity_val_steps=0,
    )  # fmt: skip
    model = Model()
    result: dict = {"error_type": None, "error": None}
    try:
        trainer.fit(model)
    except BaseException as e:
        result.update(error_type=[t.__name__ for t in type(e).__mro__], error=str(e))
        raise
    finally:
        rank = trainer.global_rank
        result.update(
            rank=rank, t_end=time.time(), global_step=trainer.global_step, trained=model.trained, saved=saved,
            validated=model.validated,
            lr=trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None,
            weights=torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
            preempted=bool(rank_safe and rank_safe.manager.preempted), naive=probe.naive, during=probe.during,
            after={
                "handlers": handler_names(), "signal connector": sorted(vars(compat.signal_connector(trainer))),
                "epoch loop": sorted(vars(trainer.fit_loop.epoch_loop)),
            },
            committed=[s.step for s in ranksafe.list_steps(CKPT_DIR) if s.status == "committed"]
            if os.path.isdir(CKPT_DIR)
            else [],
            hpc=sorted(n for n in os.listdir(args.out) if n.startswith("hpc_ckpt")),
        )  # fmt: skip
        write(f"{args.run}-rank{rank}.json", json.dumps(result))


if __name__ == "__main__":
    main()
