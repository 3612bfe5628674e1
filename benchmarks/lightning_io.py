"""Checkpoint write cost: RankSafeCheckpointIO vs Lightning's TorchCheckpointIO vs a raw write + fsync.

For each state size, every method saves the same Lightning-style checkpoint (a state_dict of 4 MiB float32
tensors) ``--runs`` times, interleaved; we report wall time and peak extra resident memory (RSS sampled every
millisecond by a thread, minus the RSS before the call), min/median/max, and ratios to the raw write.

* ``raw``: the tensors' bytes written to one file, then fsync: the floor for a durable write of this data.
* ``stock``: ``TorchCheckpointIO.save_checkpoint``; serialises into memory, writes via $TMPDIR, no fsync.
* ``ranksafe``: ``RankSafeCheckpointIO.save_checkpoint``; streams beside the target, CRC footer, fsync, rename.
* ``ranksafe-nozipcrc``: the same with ``torch.serialization.set_crc32_options(False)``: torch skips the
  zip's own CRC32s, ranksafe's footer CRC (zlib.crc32 while streaming) remains the integrity check.

Usage: python benchmarks/lightning_io.py [--sizes-mib 100 1024] [--runs 5] [--dir DIR]
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


def methods() -> dict[str, Callable[[dict, str], None]]:
    stock, ours = TorchCheckpointIO(), RankSafeCheckpointIO()

    def ranksafe_nozipcrc(checkpoint: dict, path: str) -> None:
        torch.serialization.set_crc32_options(False)
        try:
            ours.save_checkpoint(checkpoint, path)
        finally:
            torch.serialization.set_crc32_options(True)

    return {
        "raw": raw_write,
        "stock": stock.save_checkpoint,
        "ranksafe": ours.save_checkpoint,
        "ranksafe-nozipcrc": ranksafe_nozipcrc,
    }


def spread(values: list[float], fmt: str) -> str:
    return "/".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def bench(size_mib: int, runs: int, directory: str) -> None:
    checkpoint = make_checkpoint(size_mib)
    size = sum(t.numel() * 4 for t in checkpoint["state_dict"].values())
    fns = methods()
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
    raw = statistics.median(times["raw"])
    print(f"\n{size / (1 << 20):.0f} MiB state, {runs} runs each (min/median/max)")
    print(f"{'method':<19} {'seconds':>22} {'x raw+fsync (median)':>21} {'extra RAM / size':>22}")
    for name in fns:
        ratio = statistics.median(times[name]) / raw
        print(f"{name:<19} {spread(times[name], '{:.3f}'):>22} {ratio:>21.2f} {spread(extras[name], '{:.3f}'):>22}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[100, 1024])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir in the cwd)")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="lightning_io-", dir=args.dir or os.getcwd())
    print(f"torch {torch.__version__}, writing to {directory}; $TMPDIR={tempfile.gettempdir()} (stock's temp files)")
    try:
        for size in args.sizes_mib:
            bench(size, args.runs, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
