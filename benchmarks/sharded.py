"""What ranksafe's commit costs a sharded save, next to bare torch.distributed.checkpoint in the same run.

The state is what FSDP2 keeps: a model's weights as DTensors sharded over every rank (dim 0), a few small ones,
and a step count; ``--sizes-mib`` is the whole state, so each rank writes its share. For each world size (2 and 4
processes, one gloo process group each) and size, four methods, each repetition of each in turn:

  dcp             torch.distributed.checkpoint.save into a new directory (the sync baseline)
  ranksafe        CheckpointManager.save(step, state): DCP's writer inside the step's commit (files counted and
                  CRC'd on the way, the manifest, the rename), three exchanges
  dcp async       torch.distributed.checkpoint.async_save on a gloo group of its own (the async baseline)
  ranksafe async  CheckpointManager(async_save=True).save(step, state)

A gloo barrier lines the ranks up before each timed call; the time is the slowest rank's: the wall time of a
durable save (sync), or how long the call blocks the caller (async; the background write is waited for after
it, untimed). Each method saves once untimed first. Old checkpoints are removed between calls, untimed, for
both (the manager keeps every step: retention is not timed).

    python benchmarks/sharded.py
    python benchmarks/sharded.py --sizes-mib 100 1024 --reps 9
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ranksafe  # imported before the processes fork: they start with it

MiB = 1 << 20
WORLDS = (2, 4)
METHODS = ("dcp", "ranksafe", "dcp async", "ranksafe async")
BASELINES = {"dcp": "dcp", "ranksafe": "dcp", "dcp async": "dcp async", "ranksafe async": "dcp async"}


def make_state(size_mib: int, mesh) -> dict:
    """``size_mib`` of float32 weights in 1..4 MiB tensors plus 100 small ones (norms, biases), all sharded over
    ``mesh`` along dim 0, and a step count."""
    rows = mesh.size() * 64  # every tensor splits evenly
    model: dict[str, torch.Tensor] = {}
    for i in range(100):
        model[f"small{i}"] = torch.randn(rows, 4)
    left, i = size_mib * MiB - 100 * rows * 16, 0
    while left > 0:
        cols = max(1, min(left, (1 + i % 4) * MiB) // (4 * rows))
        model[f"w{i}"] = torch.randn(rows, cols)
        left -= rows * cols * 4
        i += 1
    sharded = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in model.items()}
    return {"model": sharded, "step": 1000}


def nbytes(state: dict) -> int:
    """The bytes of the whole state (a DTensor counts its global shape)."""
    return sum(t.numel() * t.element_size() for t in state["model"].values())


class Method:
    """One way to save: ``save(rep)`` is timed, ``finish()`` (the background write, if any) is not."""

    def __init__(self, save: Callable[[int], object], finish: Callable[[], object] = lambda: None):
        self.save, self.finish = save, finish


def _methods(state: dict, work: str, group: dist.ProcessGroup) -> dict[str, Method]:
    sync = ranksafe.CheckpointManager(os.path.join(work, "ranksafe"), keep=None)
    background = ranksafe.CheckpointManager(os.path.join(work, "ranksafe-async"), keep=None, async_save=True)
    pending = []
    return {
        "dcp": Method(lambda rep: dcp.save(state, checkpoint_id=os.path.join(work, "dcp", str(rep)))),
        "ranksafe": Method(lambda rep: sync.save(rep + 1, state)),
        "dcp async": Method(
            lambda rep: pending.append(
                dcp.async_save(state, checkpoint_id=os.path.join(work, "dcp-async", str(rep)), process_group=group)
            ),
            lambda: pending.pop().result(),
        ),
        "ranksafe async": Method(lambda rep: background.save(rep + 1, state), background.wait),
    }


def _clear(work: str) -> None:
    """Rank 0 removes the checkpoints written so far (untimed), with every rank past its own write."""
    dist.barrier()
    if dist.get_rank() == 0:
        for name in os.listdir(work):
            for entry in os.listdir(os.path.join(work, name)):
                shutil.rmtree(os.path.join(work, name, entry), ignore_errors=True)
    dist.barrier()


def _rank(rank: int, world: int, port: int, sizes: list[int], reps: int, work: str, results: mp.Queue) -> None:
    """One process: every method, ``reps`` times per size; rank 0 puts the slowest rank's times on ``results``."""
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    mesh = init_device_mesh("cpu", (world,))
    group = dist.new_group(backend="gloo")  # async_save's collectives run on a thread: off the default group
    out = []
    for size in sizes:
        state = make_state(size, mesh)
        here = os.path.join(work, f"{world}-{size}")
        methods = _methods(state, here, group)
        times: dict[str, list[float]] = {name: [] for name in methods}
        for rep in range(-1, reps):  # rep -1: untimed (the storage probe, the staging buffers, the threads)
            for name in sorted(methods, reverse=rep % 2 == 1):  # each goes first in every other round
                method = methods[name]
                dist.barrier()
                start = time.perf_counter()
                method.save(rep + 1)
                elapsed = time.perf_counter() - start
                method.finish()
                if rep >= 0:
                    times[name].append(elapsed)
                _clear(here)
        slowest = torch.tensor([times[name] for name in methods], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out.append((nbytes(state), dict(zip(methods, slowest.tolist(), strict=True))))
    if rank == 0:
        results.put(out)
    dist.barrier()  # rank 0 hosts the store: nobody leaves while it may still be needed
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, sizes: list[int], reps: int, directory: str, timeout: float = 900) -> list:
    """``(state bytes, {method: seconds per rep})`` for each size, with ``world`` processes."""
    # fork: the processes start with torch, DCP and ranksafe imported
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    results = ctx.Queue()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="ranksafe-sharded-", dir=directory) as work:
        for size in sizes:
            for name in ("dcp", "dcp-async", "ranksafe", "ranksafe-async"):
                os.makedirs(os.path.join(work, f"{world}-{size}", name))
        procs = [ctx.Process(target=_rank, args=(r, world, port, sizes, reps, work, results)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            measured = results.get(timeout=timeout)
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
                    p.join()
    return measured


def collect(sizes_mib: list[int], reps: int, directory: str | None = None) -> list[dict]:
    """Rows for ``python -m benchmarks``: benchmark ``sharded_sync_<world>`` (wall time) and ``sharded_async_<world>``
    (time blocked), each method with its baseline's times from the same processes (``baseline_times``)."""
    os.environ.setdefault("RANKSAFE_TIMEOUT", "600")
    rows = []
    for world in WORLDS:
        for state_bytes, times in measure(world, sizes_mib, reps, directory or tempfile.gettempdir()):
            for method in METHODS:
                kind = "async" if method.endswith("async") else "sync"
                baseline = BASELINES[method]
                rows.append(
                    {
                        "benchmark": f"sharded_{kind}_{world}",
                        "size_mib": state_bytes / MiB,
                        "method": method.split()[0],
                        "baseline": baseline.split()[0],
                        "times": times[method],
                        "baseline_times": times[baseline],
                        "extra": None,
                        "held": None,
                    }
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS), help="process counts")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[100], help="the whole state's size")
    parser.add_argument("--reps", type=int, default=7, help="timed saves per method, size and world size")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (a temporary directory)")
    args = parser.parse_args()
    os.environ.setdefault("RANKSAFE_TIMEOUT", "600")
    before = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.reps} reps; writing in {args.dir}")
    print("world  MiB  method            min ms  median ms   max ms   median / baseline")
    for world in args.worlds:
        for state_bytes, times in measure(world, args.sizes_mib, args.reps, args.dir):
            for method in METHODS:
                ms = [t * 1e3 for t in times[method]]
                ratio = statistics.median(times[method]) / statistics.median(times[BASELINES[method]])
                print(
                    f"{world:5d} {state_bytes / MiB:4.0f}  {method:15s} {min(ms):8.1f} {statistics.median(ms):9.1f} "
                    f"{max(ms):8.1f}   {ratio:6.2f}"
                )
    print(f"load average {before:.2f} before, {os.getloadavg()[0]:.2f} after (1 min)")
    print("targets for ranksafe: median <= 1.05x bare DCP's time (sync) and blocked time (async)")


if __name__ == "__main__":
    main()
