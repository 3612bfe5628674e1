"""One real ``Trainer(strategy=ModelParallelStrategy(), accelerator="cpu", devices=2)`` run (FSDP2, gloo) with
``RankSafe(checkpoint_dir=...)``: each epoch's step holds sharded weights and optimizer states.

Driven by tests/test_sharded_lightning.py; Lightning's launcher re-runs this file for rank 1. Rank 0 reports in
``OUT/rank0.json`` a digest of the full weights and optimizer state at every epoch's end and at the start of
training (after a resume), and the steps the manager holds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import warnings

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--async-save", action="store_true")
parser.add_argument("--full", action="store_true", help="save_distributed_checkpoint=False: one full checkpoint")
parser.add_argument("--stock-from", help="a step directory stock Lightning resumes from, without RankSafe")
args = parser.parse_args()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import ranksafe  # noqa: E402
from ranksafe.lightning import RankSafe  # noqa: E402

warnings.filterwarnings("ignore")
RANK = int(os.environ.get("LOCAL_RANK", 0))


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def digest(trainer: pl.Trainer) -> str:
    """Of every full tensor of the model and its optimizer, gathered (every rank takes part)."""
    model, opt = trainer.strategy.model, trainer.strategy.optimizers[0]
    h = hashlib.sha256()

    def walk(obj, key):
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k], f"{key}.{k}")
        elif isinstance(obj, torch.Tensor):
            full = obj.full_tensor() if isinstance(obj, DTensor) else obj
            h.update(key.encode() + full.detach().contiguous().numpy().tobytes())

    walk(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)), "")
    return h.hexdigest()


class Probe(pl.Callback):
    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def on_train_start(self, trainer, pl_module):
        self.seen[f"start {trainer.global_step}"] = digest(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self.seen[f"end {trainer.global_step}"] = digest(trainer)


def main() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    probe = Probe()
    managed = os.path.join(args.out, "managed")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=not args.full),
        max_epochs=args.epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[probe] + ([] if args.stock_from else [RankSafe(checkpoint_dir=managed,
        keep=2, resume=args.resume, async_save=args.async_save)]),
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(data, batch_size=8)  # 4 steps an epoch on each rank
    trainer.fit(Model(), loader, ckpt_path=args.stock_from)
    if RANK == 0:
        steps = [(s.step, s.status, sorted(os.listdir(s.path))) for s in ranksafe.list_steps(managed)]
        result = {"seen": probe.seen, "ckpt_path": trainer.ckpt_path and str(trainer.ckpt_path), "steps": steps}
        with open(os.path.join(args.out, "rank0.json"), "w") as f:
            json.dump(result, f)
    # a process group left to interpreter exit sometimes aborts in C++ ("terminate called without an active
    # exception"), with stock Lightning too: end it, as a training script should
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
