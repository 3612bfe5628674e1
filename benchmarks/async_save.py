"""How long is training blocked by an asynchronous checkpoint? Compared with the floor: one plain copy of the
same bytes into a buffer allocated beforehand (no snapshot can copy faster).

Side by side in one run, each method in a process of its own beside its own floor (see measure_apart):
  ranksafe     AsyncSaver.save (staged tensors reused while the state's layout stays, allocated by warmup)
  lightning    AsyncCheckpointIO(TorchCheckpointIO()).save_checkpoint (clones every tensor on each save)
  dcp          torch.distributed.checkpoint.async_save (1-rank gloo group if it needs one)

Each method saves once untimed, for its extra resident memory (the RSS it holds afterwards and its peak,
both above the RSS before it was set up). Then --reps rounds time every method once each, in turn (min /
median / max of the time save() blocks the caller; the background write is waited for after each save and
not counted). Each timed call, the floor's included, follows 30 ms of matrix products standing in for the
training step a checkpoint follows, so a slow spell of the machine hits all methods alike.

    python benchmarks/async_save.py --size-mib 100
    python benchmarks/async_save.py --size-mib 1024 --reps 5
    python benchmarks/async_save.py --score   # and a new score tensor before every save, as Lightning's
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import torch

from ranksafe.async_save import AsyncSaver

MiB = 1 << 20
SETTLE = 0.05  # seconds after the previous background write, before the training step
STEP = 0.03  # seconds of the stand-in training step right before each timed save


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


class Method:
    """One way to save: ``save(rep)`` is timed (the caller is blocked for it), ``finish()`` waits for the
    background write and is not, ``close()`` releases what the method holds."""

    def __init__(self, save: Callable[[int], None], finish: Callable[[], None], close: Callable[[], None]) -> None:
        self.save, self.finish, self.close = save, finish, close


def floor_copy(state: dict, directory: str) -> Method:
    """The floor: one copy of the same bytes into a buffer allocated (and its pages touched) beforehand."""
    src = torch.cat([t.flatten() for t in state["model"].values()])
    dst = torch.empty_like(src)
    dst.copy_(src)
    return Method(lambda _: dst.copy_(src), lambda: None, lambda: None)


class TrainingStep:
    """What runs before every timed save: matrix products for :data:`STEP` seconds, standing in for the step a
    checkpoint follows in training. Every method, the floor included, starts with torch's threads busy and the
    CPU clocked up, as after a real step, not from an idle machine (here an idle vCPU made any copy 1.5x
    slower, and by how much varied from one save to the next)."""

    def __init__(self) -> None:
        self.a, self.b = torch.randn(512, 512), torch.randn(512, 512)

    def __call__(self) -> None:
        end = time.perf_counter() + STEP
        while time.perf_counter() < end:
            torch.mm(self.a, self.b)


def ranksafe_saver(state: dict, directory: str) -> Method:
    saver = AsyncSaver()
    saver.warmup(state, directory)  # allocates the staging buffers and starts the threads, as training would
    path = os.path.join(directory, "ranksafe.pt")
    return Method(lambda _: saver.save(state, path), saver.wait, saver.close)


def lightning_io(state: dict, directory: str) -> Method:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    io = AsyncCheckpointIO(TorchCheckpointIO())
    path = os.path.join(directory, "lightning.ckpt")

    def finish() -> None:
        io._executor.submit(lambda: None).result()  # the single worker has finished the write before it

    return Method(lambda _: io.save_checkpoint(state, path), finish, io.teardown)


def dcp_async(state: dict, directory: str) -> Method:
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

    return Method(save, finish, lambda: None)


Result = tuple[list[float], int, int | None]


def run_methods(
    state: dict, reps: int, directory: str | None, only: list[str], score: bool = False
) -> dict[str, Result]:
    """Blocked seconds per rep, and RSS held and peak RSS (bytes above the RSS before the method was set up);
    the floor always runs, as every ratio needs it.

    Two phases. Memory: each method in turn is set up and saves once (untimed), so its held and peak RSS are
    its own. Time: ``reps`` rounds, each timing every method once, in turn, :data:`SETTLE` seconds after the
    previous method's background write finished (what one method leaves running, a pool freeing its copies,
    does not land on the next one's clock) and right after a :class:`TrainingStep`. A slow spell of a shared
    machine hits all methods alike. ``score``: a new scalar tensor in the state before every timed save (the old
    ones kept alive, so it is elsewhere in memory each time), as a monitored ``ModelCheckpoint`` puts in every
    Lightning checkpoint.
    """
    makers = {"floor": floor_copy, "ranksafe": ranksafe_saver, "lightning": lightning_io, "dcp": dcp_async}
    names = ["floor", *(n for n in makers if n != "floor" and n in only)]
    methods: dict[str, Method] = {}
    memory: dict[str, tuple[int, int | None]] = {}
    times: dict[str, list[float]] = {}
    scores: list[torch.Tensor] = []
    with tempfile.TemporaryDirectory(dir=directory) as work:
        try:
            for name in names:
                base = rss()
                can_peak = reset_peak()
                try:
                    m = makers[name](state, work)
                    m.save(-1)
                    m.finish()
                except Exception as e:  # a baseline that cannot run here is reported, not fatal
                    print(f"{name}: could not run: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                methods[name] = m
                memory[name] = rss() - base, (peak() - base if can_peak else None)
                times[name] = []
            step = TrainingStep()
            for rep in range(reps):
                for name, m in methods.items():
                    gc.collect()  # the garbage of the method before (DCP leaves thousands of objects) is not ours
                    time.sleep(SETTLE)
                    if score:
                        scores.append(torch.tensor(float(rep)))
                        state["score"] = scores[-1]
                    step()
                    start = time.perf_counter()
                    m.save(rep)
                    times[name].append(time.perf_counter() - start)
                    m.finish()
        finally:
            for m in methods.values():
                m.close()
    return {name: (times[name], *memory[name]) for name in methods}


def row(name: str, times: list[float], floor: float, held: int, top: int | None) -> str:
    ms = [t * 1e3 for t in times]
    med = statistics.median(times)
    top_text = f"{top / MiB:8.0f}" if top is not None else "     n/a"
    return (
        f"{name:10s} {min(ms):8.1f} {statistics.median(ms):8.1f} {max(ms):8.1f}   "
        f"{med / floor:6.2f}x {max(times) / floor:6.2f}x   {held / MiB:8.0f} {top_text}"
    )


def measure(
    size_mib: int, small: int, reps: int, directory: str | None, method: str, score: bool = False
) -> tuple[dict, int, int]:
    """The floor and ``method`` on a fresh state, interleaved (:func:`run_methods`); also the state's bytes
    and number of tensors."""
    state = make_state(size_mib, small)
    return run_methods(state, reps, directory, [method], score), nbytes(state), len(state["model"])


def measure_apart(
    size_mib: int, small: int, reps: int, directory: str | None, method: str, score: bool = False
) -> tuple[dict, int, int]:
    """:func:`measure` in a process of its own. Methods share nothing: a library that runs torch ops on a
    thread of its own (DCP's stager) gives OpenMP a second team, more threads than cores, and from then on
    OpenMP puts its threads to sleep between parallel regions in that process. Measured here: the floor went
    from 8.5 ms to a bimodal 10-16 ms, and ranksafe (one region per large tensor) from 9.1 to 13.1 ms."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(measure, size_mib, small, reps, directory, method, score).result()


METHODS = ("ranksafe", "lightning", "dcp")


def collect(sizes_mib: list[int], reps: int, directory: str | None = None) -> list[dict]:
    """One row per state, method and size: ``benchmark`` (``async_save`` for 1,000 small tensors and large
    ones, ``async_save_large`` for the large ones only: the cost that grows with the number of tensors shows as
    the difference), ``size_mib``, ``method``, ``baseline`` (``floor``), ``times`` (seconds save() blocked, per
    rep), ``baseline_times`` (the floor's, timed in the same process), ``extra`` (peak extra RSS / state size;
    None where the peak cannot be reset) and ``held`` (RSS left behind / state size); plain data so ``python -m
    benchmarks`` can pass it between processes. Each method runs in a process of its own beside its own floor
    (:func:`measure_apart`); the floor row is ranksafe's. A method that fails is reported on stderr and left out.
    """
    rows = []
    for benchmark, small in (("async_save", 1000), ("async_save_large", 0)):
        for size_mib in sizes_mib:
            for method in METHODS:
                results, size, _ = measure_apart(size_mib, small, reps, directory, method)
                floor_times = results["floor"][0]
                for name, (times, held, top) in results.items():
                    if name == "floor" and method != METHODS[0]:
                        continue
                    rows.append(
                        {
                            "benchmark": benchmark,
                            "size_mib": size / MiB,
                            "method": name,
                            "baseline": "floor",
                            "times": times,
                            "baseline_times": floor_times,
                            "extra": [top / size] if top is not None else None,
                            "held": held / size,
                        }
                    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=100, help="bytes of tensors in the state (100 or 1024)")
    p.add_argument("--reps", type=int, default=5, help="saves timed per method (>= 5)")
    p.add_argument("--small", type=int, default=1000, help="number of small (4 KiB) tensors in the state")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--only", nargs="*", default=list(METHODS), choices=METHODS)
    p.add_argument("--score", action="store_true", help="a new scalar tensor in the state before every save")
    args = p.parse_args()
    print(f"{args.reps} reps; torch {torch.__version__}; {os.cpu_count()} CPUs; each method in its own process")
    print("blocked ms:   min   median      max   median/floor max/floor   extra RSS MiB: held  peak")
    for method in args.only:
        results, size, count = measure_apart(args.size_mib, args.small, args.reps, args.dir, method, args.score)
        floor = statistics.median(results["floor"][0])
        print(f"-- {method}: state of {count} tensors, {size / MiB:.0f} MiB, beside its own floor")
        for name, (times, held, top) in results.items():
            print(row(name, times, floor, held, top))
    print("targets for ranksafe: median <= 1.5x floor at 100 MiB, <= 1.15x at 1 GiB")


if __name__ == "__main__":
    main()
