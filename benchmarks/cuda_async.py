"""How long does an asynchronous checkpoint of GPU state keep training from going on? Runs where CUDA is.

The floor: one device-to-host copy of the same bytes, non-blocking into pinned memory allocated beforehand, and
its synchronisation (no snapshot of the state to the host can be faster). Side by side, in one process:
  ranksafe     AsyncSaver.save (pinned staging buffers reused while the state's layout stays; allocated by warmup)
  dcp          torch.distributed.checkpoint.async_save with DefaultStager(pinned memory, non-blocking copies)
  lightning    AsyncCheckpointIO(TorchCheckpointIO()) (clones every tensor on the GPU, then torch.save)
  cpu          a .cpu() copy of every tensor, then torch.save on another thread

Timed: from the call until the state may change and the GPU is free for the next step: save() returning, plus
DCP's staging future (its copies run after it returns, and the optimizer must not run before they end) and a
CUDA synchronisation (Lightning's clones are queued, not done, when it returns). The background write is waited
for after each save and not counted. The state: bf16 tensors on the GPU, about 1,000 of them.

    python -m benchmarks.cuda_async --sizes-gib 1 4 --reps 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable

import torch
from torch.torch_version import TorchVersion

from ranksafe.async_save import AsyncSaver

MiB = 1 << 20
TENSORS = 1000


def make_state(size_mib: int) -> dict:
    """``TENSORS`` bf16 tensors on the GPU, of equal size, ``size_mib`` MiB in all, and a step counter."""
    n = size_mib * MiB // 2 // TENSORS
    return {"model": {f"w{i}": torch.randn(n, device="cuda").bfloat16() for i in range(TENSORS)}, "step": 1000}


class Method:
    """``save(rep)`` is timed, ``finish()`` (the background write) is not, ``close()`` releases what it holds."""

    def __init__(self, save: Callable[[int], None], finish: Callable[[], None], close: Callable[[], None]) -> None:
        self.save, self.finish, self.close = save, finish, close


def floor_copy(state: dict, directory: str) -> Method:
    src = torch.cat([t.flatten() for t in state["model"].values()])
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)

    def save(_: int) -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return Method(save, lambda: None, lambda: None)


def ranksafe_saver(state: dict, directory: str) -> Method:
    saver = AsyncSaver()
    saver.warmup(state, directory)
    path = os.path.join(directory, "ranksafe.pt")
    return Method(lambda _: saver.save(state, path), saver.wait, saver.close)


def dcp_async(state: dict, directory: str) -> Method:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")

    def new_stager() -> DefaultStager:
        return DefaultStager(StagingOptions(use_pinned_memory=True, use_non_blocking_copy=True))

    # before torch 2.13, async_save closes the stager it is given once the upload ends: one per save there
    reused = TorchVersion(torch.__version__) >= "2.13"
    stager = new_stager()
    pending: list = []

    def save(rep: int) -> None:
        nonlocal stager
        stager = stager if reused else new_stager()
        response = dcp.async_save(state, checkpoint_id=os.path.join(directory, f"dcp{rep % 2}"), async_stager=stager)
        staged = getattr(response, "staging_completion", None)
        if staged is not None:
            staged.result()
        pending.append(getattr(response, "upload_completion", response))

    return Method(save, lambda: pending.pop().result(), lambda: stager.close())


def lightning_io(state: dict, directory: str) -> Method:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    io = AsyncCheckpointIO(TorchCheckpointIO())
    path = os.path.join(directory, "lightning.ckpt")

    def save(_: int) -> None:
        io.save_checkpoint(state, path)
        torch.cuda.synchronize()

    def finish() -> None:
        io._executor.submit(lambda: None).result()

    return Method(save, finish, io.teardown)


def cpu_copy(state: dict, directory: str) -> Method:
    path = os.path.join(directory, "cpu.pt")
    writers: list[threading.Thread] = []

    def save(_: int) -> None:
        copy = {"model": {k: v.cpu() for k, v in state["model"].items()}, "step": state["step"]}
        writers.append(threading.Thread(target=torch.save, args=(copy, path)))
        writers[-1].start()

    return Method(save, lambda: writers.pop().join(), lambda: None)


MAKERS = {"ranksafe": ranksafe_saver, "dcp": dcp_async, "lightning": lightning_io, "cpu": cpu_copy}


def _where(size_mib: int, directory: str | None) -> str:
    """Memory-backed when it has room for two copies of every method's file: the writes end sooner, and a save is
    timed only until it returns."""
    if directory:
        return directory
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free > 3 * 2 * size_mib * MiB * len(MAKERS):
        return shm
    return tempfile.gettempdir()


def measure(size_mib: int, reps: int, directory: str | None, only: list[str]) -> dict[str, tuple[list[float], int]]:
    """Seconds each method kept the caller, per rep, and the GPU memory it held above the state's, in bytes."""
    state = make_state(size_mib)
    results: dict[str, tuple[list[float], int]] = {}
    with tempfile.TemporaryDirectory(dir=_where(size_mib, directory)) as work:
        for name in ["floor", *only]:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            method = None
            times: list[float] = []
            try:
                method = (floor_copy if name == "floor" else MAKERS[name])(state, work)
                method.save(-1)
                method.finish()
                for rep in range(reps):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    method.save(rep)
                    times.append(time.perf_counter() - start)
                    method.finish()
            except Exception as e:  # a baseline that cannot run here is reported, not fatal
                if name == "floor":  # every ratio needs it
                    raise
                print(f"{name}: could not run: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            finally:
                if method is not None:
                    method.close()
            results[name] = times, torch.cuda.max_memory_allocated() - before
    return results


def collect(sizes_mib: list[int], reps: int, directory: str | None = None) -> list[dict]:
    """Rows for ``python -m benchmarks`` (benchmark ``cuda_async``), at the sizes it measures the others at."""
    rows = []
    for size_mib in sizes_mib:
        results = measure(size_mib, reps, directory, list(MAKERS))
        floor = results["floor"][0]
        for name, (times, _) in results.items():
            rows.append(
                {
                    "benchmark": "cuda_async",
                    "size_mib": size_mib,
                    "method": name,
                    "baseline": "floor",
                    "times": times,
                    "baseline_times": floor,
                    "extra": None,
                    "held": 0,
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-gib", type=float, nargs="+", default=[1, 4])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: /dev/shm when it has room)")
    p.add_argument("--only", nargs="*", default=list(MAKERS), choices=list(MAKERS))
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; CUDA {torch.version.cuda}; {args.reps} reps")
    print("| GiB | method | min ms | median ms | max ms | median / floor | GPU memory above the state, MiB |")
    print("|---|---|---|---|---|---|---|")
    for gib in args.sizes_gib:
        results = measure(int(gib * 1024), args.reps, args.dir, args.only)
        floor = statistics.median(results["floor"][0])
        for name, (times, gpu) in results.items():
            ms = [t * 1e3 for t in times]
            print(
                f"| {gib:g} | {name} | {min(ms):.1f} | {statistics.median(ms):.1f} | {max(ms):.1f} | "
                f"{statistics.median(times) / floor:.2f} | {gpu / MiB:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
