"""How long is training blocked by an asynchronous checkpoint? Compared with the floor: one plain copy of the
same bytes into a buffer allocated beforehand (no snapshot can copy faster).

Side by side, in one process and one run:
  ranksafe     AsyncSaver.save (reused per-dtype staging buffers, allocated by warmup)
  lightning    AsyncCheckpointIO(TorchCheckpointIO()).save_checkpoint (clones every tensor on each save)
  dcp          torch.distributed.checkpoint.async_save (1-rank gloo group if it needs one)

Each method is timed over --reps saves (min / median / max of the time save() blocks the caller; the
background write is waited for between reps and not counted), then its extra resident memory is reported:
the RSS it leaves behind and its peak over the reps, both above the RSS before it started.

    python benchmarks/async_save.py --size-mib 100
    python benchmarks/async_save.py --size-mib 1024 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

from ranksafe.async_save import AsyncSaver

MiB = 1 << 20


def make_state(size_mib: int, small: int) -> dict:
    """A model-like state: ``small`` 4 KiB tensors (biases, norms) and 1..4 MiB weights up to the size."""
    state: dict[str, torch.Tensor] = {f"small{i}": torch.randn(1024) for i in range(small)}
    left, i = size_mib * MiB - small * 4096, 0
    while left > 0:
        n = min(left, (1 + i % 4) * MiB) // 4
        state[f"w{i}"] = torch.randn(n)
        left -= n * 4
        i += 1
    return {"model": state, "step": 1000, "optimizer": {"lr": 1e-3}}


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def timed(reps: int, save: Callable[[int], None], finish: Callable[[], None]) -> tuple[list[float], int, int | None]:
    """Blocked seconds per rep, RSS left behind, and peak RSS, both relative to before the first rep."""
    base = rss()
    can_peak = reset_peak()
    out = []
    for rep in range(reps):
        start = time.perf_counter()
        save(rep)
        out.append(time.perf_counter() - start)
        finish()
    return out, rss() - base, (peak() - base if can_peak else None)


def bench_floor(state: dict, reps: int) -> tuple[list[float], int, int | None]:
    src = torch.cat([t.flatten() for t in state["model"].values()])
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages: the floor must not pay first-touch faults
    return timed(reps, lambda _: dst.copy_(src), lambda: None)


def bench_ranksafe(state: dict, reps: int, directory: str) -> tuple[list[float], int, int | None]:
    saver = AsyncSaver()
    base = rss()
    saver.warmup(state, directory)  # allocates the staging buffers: counted in the memory below
    times, _, _ = timed(reps, lambda r: saver.save(state, os.path.join(directory, "ranksafe.pt")), saver.wait)
    saver.close()
    held, top = rss() - base, peak() - base
    return times, held, top


def bench_lightning(state: dict, reps: int, directory: str) -> tuple[list[float], int, int | None]:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    io = AsyncCheckpointIO(TorchCheckpointIO())
    path = os.path.join(directory, "lightning.ckpt")

    def finish() -> None:
        io._executor.submit(lambda: None).result()  # the single worker has finished the write before it

    result = timed(reps, lambda _: io.save_checkpoint(state, path), finish)
    io.teardown()
    return result


def bench_dcp(state: dict, reps: int, directory: str) -> tuple[list[float], int, int | None]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        # an in-process store: no port to collide with another run on the machine
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # we overwrite on purpose
    pending = []

    def save(rep: int) -> None:
        pending.append(dcp.async_save(state, checkpoint_id=os.path.join(directory, f"dcp{rep % 2}")))

    def finish() -> None:
        pending.pop().result()

    return timed(reps, save, finish)


def row(name: str, times: list[float], floor: float, held: int, top: int | None) -> str:
    ms = [t * 1e3 for t in times]
    med = statistics.median(times)
    top_text = f"{top / MiB:8.0f}" if top is not None else "     n/a"
    return (
        f"{name:10s} {min(ms):8.1f} {statistics.median(ms):8.1f} {max(ms):8.1f}   "
        f"{med / floor:6.2f}x {max(times) / floor:6.2f}x   {held / MiB:8.0f} {top_text}"
    )


Result = tuple[list[float], int, int | None]


def run_methods(state: dict, reps: int, directory: str | None, only: list[str]) -> dict[str, Result]:
    """Blocked seconds, held bytes and peak bytes per method; the floor always runs, as every ratio needs it."""
    with tempfile.TemporaryDirectory(dir=directory) as work:
        results = {"floor": bench_floor(state, reps)}
        benches = {"ranksafe": bench_ranksafe, "lightning": bench_lightning, "dcp": bench_dcp}
        for name, fn in benches.items():
            if name in only:
                try:
                    results[name] = fn(state, reps, work)
                except Exception as e:  # a baseline that cannot run here is reported, not fatal
                    print(f"{name}: could not run: {type(e).__name__}: {e}", file=sys.stderr)
    return results


def collect(sizes_mib: list[int], reps: int, directory: str | None = None) -> list[dict]:
    """One row per state, method and size: ``benchmark`` (``async_save`` for 1,000 small tensors and large
    ones, ``async_save_large`` for the large ones only: the cost that grows with the number of tensors shows as
    the difference), ``size_mib``, ``method``, ``baseline`` (``floor``), ``times`` (seconds save() blocked, per
    rep), ``extra`` (peak extra RSS / state size; None where the peak cannot be reset) and ``held`` (RSS left
    behind / state size); plain data so ``python -m benchmarks`` can pass it between processes. A method that
    fails is reported on stderr and left out."""
    rows = []
    for benchmark, small in (("async_save", 1000), ("async_save_large", 0)):
        for size_mib in sizes_mib:
            state = make_state(size_mib, small)
            size = nbytes(state)
            methods = ["ranksafe", "lightning", "dcp"]
            for name, (times, held, top) in run_methods(state, reps, directory, methods).items():
                rows.append(
                    {
                        "benchmark": benchmark,
                        "size_mib": size / MiB,
                        "method": name,
                        "baseline": "floor",
                        "times": times,
                        "extra": [top / size] if top is not None else None,
                        "held": held / size,
                    }
                )
            del state
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=100, help="bytes of tensors in the state (100 or 1024)")
    p.add_argument("--reps", type=int, default=5, help="saves timed per method (>= 5)")
    p.add_argument("--small", type=int, default=1000, help="number of small (4 KiB) tensors in the state")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--only", nargs="*", default=["floor", "ranksafe", "lightning", "dcp"])
    args = p.parse_args()
    state = make_state(args.size_mib, args.small)
    print(
        f"state: {len(state['model'])} tensors, {nbytes(state) / MiB:.0f} MiB; {args.reps} reps; "
        f"torch {torch.__version__}; {os.cpu_count()} CPUs"
    )
    results = run_methods(state, args.reps, args.dir, args.only)
    floor = statistics.median(results["floor"][0])
    print("blocked ms:   min   median      max   median/floor max/floor   extra RSS MiB: held  peak")
    for name, (times, held, top) in results.items():
        print(row(name, times, floor, held, top))
    print("targets for ranksafe: median <= 1.15x floor, max <= 2x floor")


if __name__ == "__main__":
    main()
