"""Checkpoint write cost: RankSafeCheckpointIO vs Lightning's TorchCheckpointIO vs a raw write + fsync.

For each state size, every method saves the same Lightning-style checkpoint (a state_dict of 4 MiB float32
tensors) ``--runs`` times, interleaved; we report wall time and peak extra resident memory (RSS sampled every
millisecond by a thread, minus the RSS before the call), min/median/max, and ratios to the raw write.

* ``raw``: the tensors' bytes written to one file, then fsync: the floor for a durable write of this data.
* ``stock``: ``TorchCheckpointIO.save_checkpoint``; serialises into memory, writes via $TMPDIR, no fsync.
* ``ranksafe``: ``RankSafeCheckpointIO.save_checkpoint``; streams beside the target, CRC footer, fsync, rename.
  (``atomic_save`` skips torch's zip CRC32s, which its footer CRC makes redundant.)
* ``ranksafe.atomic_save``: the function alone, without the plugin around it.
* ``atomic_save@REV`` (with ``--baseline REV``): ``atomic_save`` as of git revision REV, loaded
  beside the current one (see ``save_path.py``), so before/after numbers come from the same run.

Usage: python benchmarks/lightning_io.py [--sizes-mib 100 1024] [--runs 5] [--baseline REV] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch
from lightning.pytorch.plugins import TorchCheckpointIO

from ranksafe.checkpoint_file import atomic_save
from ranksafe.lightning import RankSafeCheckpointIO

_PAGE = os.sysconf("SC_PAGE_SIZE")
_TENSOR_MIB = 4


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Highest RSS seen while the block runs, sampled every millisecond by a background thread."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def make_checkpoint(size_mib: int) -> dict:
    n = max(1, size_mib // _TENSOR_MIB)
    elems = _TENSOR_MIB * (1 << 20) // 4
    state = {f"layer{i}.weight": torch.full((elems,), float(i)) for i in range(n)}
    return {"epoch": 0, "global_step": 0, "state_dict": state, "loops": {}, "callbacks": {}}


def raw_write(checkpoint: dict, path: str) -> None:
    with open(path, "wb") as f:
        for t in checkpoint["state_dict"].values():
            f.write(t.numpy().data)
        f.flush()
        os.fsync(f.fileno())


def methods(baseline: str | None) -> dict[str, Callable[[dict, str], None]]:
    stock, ours = TorchCheckpointIO(), RankSafeCheckpointIO()
    chosen = {
        "raw": raw_write,
        "stock": stock.save_checkpoint,
        "ranksafe": ours.save_checkpoint,
        "ranksafe.atomic_save": atomic_save,
    }
    if baseline:
        if __package__:  # imported as benchmarks.lightning_io
            from .save_path import load_revision
        else:  # run as a script: the sibling benchmark's directory is on sys.path
            from save_path import load_revision

        chosen[f"atomic_save@{baseline}"] = load_revision(baseline).atomic_save
    return chosen


def spread(values: list[float], fmt: str) -> str:
    return "/".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def measure(size_mib: int, runs: int, directory: str, fns: dict[str, Callable[[dict, str], None]]) -> list[dict]:
    """One row per method: ``benchmark``, ``size_mib``, ``method``, ``baseline`` (``raw``), ``times`` (seconds per
    run) and ``extra`` (peak extra RSS / state size per run), plain data so ``python -m benchmarks`` can pass it
    between processes."""
    checkpoint = make_checkpoint(size_mib)
    size = sum(t.numel() * 4 for t in checkpoint["state_dict"].values())
    times: dict[str, list[float]] = {m: [] for m in fns}
    extras: dict[str, list[float]] = {m: [] for m in fns}
    for _ in range(runs):
        for name, fn in fns.items():  # interleaved, so drift in the disk's speed hits every method alike
            path = os.path.join(directory, f"{name}.ckpt")
            if os.path.exists(path):
                os.unlink(path)
            os.sync()
            with PeakRSS() as mem:
                start = time.perf_counter()
                fn(checkpoint, path)
                times[name].append(time.perf_counter() - start)
            extras[name].append(mem.extra / size)
            os.unlink(path)
    return [
        {
            "benchmark": "lightning_io",
            "size_mib": size / (1 << 20),
            "method": name,
            "baseline": "raw",
            "times": times[name],
            "extra": extras[name],
        }
        for name in fns
    ]


def collect(sizes_mib: list[int], runs: int, directory: str | None = None) -> list[dict]:
    """The default methods (no baseline revision) at every size, written in a temporary directory."""
    work = tempfile.mkdtemp(prefix="lightning_io-", dir=directory or os.getcwd())
    try:
        return [row for size in sizes_mib for row in measure(size, runs, work, methods(None))]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench(size_mib: int, runs: int, directory: str, fns: dict[str, Callable[[dict, str], None]]) -> None:
    rows = measure(size_mib, runs, directory, fns)
    raw = statistics.median(rows[0]["times"])
    print(f"\n{rows[0]['size_mib']:.0f} MiB state, {runs} runs each (min/median/max)")
    print(f"{'method':<21} {'seconds':>22} {'x raw+fsync (median)':>21} {'extra RAM / size':>22}")
    for row in rows:
        seconds, extra = spread(row["times"], "{:.3f}"), spread(row["extra"], "{:.3f}")
        print(f"{row['method']:<21} {seconds:>22} {statistics.median(row['times']) / raw:>21.2f} {extra:>22}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[100, 1024])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline", default=None, help="git revision of atomic_save to compare with")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir in the cwd)")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="lightning_io-", dir=args.dir or os.getcwd())
    print(f"torch {torch.__version__}, load average {os.getloadavg()}, writing to {directory}")
    print(f"$TMPDIR={tempfile.gettempdir()} (stock's temp files)")
    fns = methods(args.baseline)
    try:
        for size in args.sizes_mib:
            bench(size, args.runs, directory, fns)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
