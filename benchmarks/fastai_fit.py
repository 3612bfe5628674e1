"""What does RankSafe add to a fastai DDP fit? Two ranks (gloo, CPU, one thread each), the same Learner, data
and callbacks, each epoch timed without and with ``RankSafe()``, in turns (each method first every other round).

RankSafe's cost in a fit without checkpoints: two small collectives per epoch (a barrier at the epoch start, rank
0's epoch record broadcast before the trackers read it) and, with ``TerminateOnNaNCallback`` on the Learner, the
every rank's loss flag combined after every batch (an all-reduce of one float), so that every rank stops after
the same batch. The baseline is the same DDP fit without RankSafe (each rank checks its own loss), with only the two
fixes that let fastai's DDP run on CPU at all (:func:`ranksafe.fastai.prepare_distributed` and
:class:`ranksafe.fastai.CPUDistributed`). The model is fixed (an MLP with 8 MiB of weights: DDP all-reduces its
gradients every batch), whatever ``--sizes-mib`` says.

    python benchmarks/fastai_fit.py --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WIDTH, BATCH, BATCHES = 1024, 32, 16  # 2 layers of 1024 x 1024 floats: 8 MiB of weights
MiB = 1 << 20


def _learner(rank: int, cbs: list) -> Any:
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.losses import MSELossFlat

    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * BATCHES * 2, WIDTH, generator=g)  # both ranks' shards of the training set
    y = x[:, :1] + 0.1 * torch.randn(len(x), 1, generator=g)
    data = list(zip(x, y, strict=True))
    dls = DataLoaders.from_dsets(data, data[: BATCH * 2], bs=BATCH, device="cpu", num_workers=0)
    torch.manual_seed(rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 1),
    )  # fmt: skip
    return Learner(dls, model, loss_func=MSELossFlat(), cbs=cbs)


def _rank(rank: int, world: int, rendezvous: str, reps: int, out: Any) -> None:
    from fastai.callback.tracker import TerminateOnNaNCallback

    from ranksafe.fastai import RankSafe

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    from ranksafe.fastai import CPUDistributed, prepare_distributed

    prepare_distributed()  # fastai's DDP on CPU (gloo), for both methods: the baseline is a real DDP fit
    learn = _learner(rank, [TerminateOnNaNCallback(), CPUDistributed()])
    times: dict[str, list[float]] = {"stock": [], "ranksafe": []}
    with learn.no_bar(), learn.no_logging(), learn.distrib_ctx(sync_bn=False):
        learn.fit(1, 1e-3)  # warm-up: DDP's buckets, the threads, the caches
        for rep in range(reps):
            for method in sorted(times, reverse=rep % 2 == 1):  # each goes first in every other round
                cbs = [RankSafe()] if method == "ranksafe" else []
                dist.barrier()
                start = time.perf_counter()
                learn.fit(1, 1e-3, cbs=cbs)
                times[method].append(time.perf_counter() - start)
    if rank == 0:
        out.put(times)
    dist.barrier()
    dist.destroy_process_group()


def measure(reps: int, world: int = 2) -> dict[str, list[float]]:
    """Seconds per epoch on rank 0, per method, ``reps`` epochs each, interleaved."""
    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as work:  # a file rendezvous: no port to collide with another run
        rendezvous = os.path.join(work, "rendezvous")
        mp.start_processes(_rank, args=(world, rendezvous, reps, out), nprocs=world, start_method="spawn")
    return out.get()


def collect(sizes_mib: list[int], reps: int, directory: str | None = None) -> list[dict]:
    """Rows for ``python -m benchmarks``: the fit's seconds per epoch, stock fastai (the baseline) and with
    RankSafe. The sizes do not apply (the model is fixed); nothing is written to ``directory``."""
    times = measure(reps)
    size = (2 * (WIDTH * WIDTH + WIDTH) + WIDTH + 1) * 4 / MiB
    return [
        {"benchmark": "fastai_fit", "size_mib": size, "method": method, "baseline": "stock", "times": t,
         "extra": None, "held": None}
        for method, t in times.items()
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5, help="epochs timed per method (>= 5)")
    args = p.parse_args()
    times = measure(args.reps)
    base = statistics.median(times["stock"])
    print(f"2 ranks, gloo; {args.reps} epochs of {BATCHES} batches per method; {os.cpu_count()} CPUs")
    print("ms per epoch:   min   median      max   median/stock max/stock")
    for method, t in times.items():
        ms = [v * 1e3 for v in t]
        print(
            f"{method:10s} {min(ms):8.1f} {statistics.median(ms):8.1f} {max(ms):8.1f}   "
            f"{statistics.median(t) / base:6.2f}x {max(t) / base:6.2f}x"
        )


if __name__ == "__main__":
    sys.exit(main())
