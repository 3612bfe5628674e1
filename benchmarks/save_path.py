"""Where the time of ``ranksafe.atomic_save`` goes, and how it compares with an earlier version of it.

Saves a state dict of 4 MiB float32 tensors ``--runs`` times per method, interleaved (so drift in a shared
machine's load hits every method alike), and prints min/median/max seconds and the median's ratio to
``raw`` (the tensors' bytes written to one file, then fsync: the floor for a durable write of this data).

* ``raw``: write + fsync of the bytes.
* ``atomic_save``: the current ``ranksafe.atomic_save``.
* ``atomic_save@REV``: ``atomic_save`` as of git revision REV (``--baseline REV``), loaded beside
  the current one, so before/after numbers come from the same run.
* ``torch.save+fsync``: stock ``torch.save`` into a file opened here, flushed and fsynced (zip CRCs on).
* ``torch.save``: stock ``torch.save(state, path)``, as most training scripts call it (no fsync).

With ``--parts`` it also times the pieces on their own: ``torch.save`` into a sink that discards the bytes
(zip CRCs on and off), ``zlib.crc32`` over the bytes, and the raw write without fsync.

Usage: python benchmarks/save_path.py [--sizes-mib 100 1024] [--runs 7] [--baseline REV] [--parts] [--dir DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import types
import zlib
from collections.abc import Callable

import torch

import ranksafe
from ranksafe import checkpoint_file

_TENSOR_MIB = 4


def make_state(size_mib: int) -> dict[str, torch.Tensor]:
    elems = _TENSOR_MIB * (1 << 20) // 4
    return {f"layer{i}.weight": torch.full((elems,), float(i)) for i in range(max(1, size_mib // _TENSOR_MIB))}


def raw_write(state: dict, path: str, fsync: bool = True) -> None:
    with open(path, "wb") as f:
        for t in state.values():
            f.write(t.numpy().data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def stock_save_fsync(state: dict, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def load_revision(rev: str) -> types.ModuleType:
    """The module holding ``atomic_save`` as of git revision ``rev`` (``checkpoint_file.py``; ``files.py`` before
    it existed), as a module of the ranksafe package (relative imports work)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in ("src/ranksafe/checkpoint_file.py", "src/ranksafe/files.py"):
        shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True)
        if shown.returncode == 0:
            break
    shown.check_returncode()
    name = f"ranksafe._atomic_save_at_{rev.replace('~', '_').replace('^', '_')}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__ = "ranksafe"
    exec(compile(shown.stdout, f"{rev}:{path}", "exec"), module.__dict__)
    return module


class _Sink:
    """A file-like object that discards what torch.save writes: the cost of serialising alone."""

    def write(self, data) -> int:
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass


def _torch_save_sink(zip_crc: bool) -> Callable[[dict, str], None]:
    def run(state: dict, path: str) -> None:
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(zip_crc)
        try:
            torch.save(state, _Sink())
        finally:
            torch.serialization.set_crc32_options(previous)

    return run


def _crc(state: dict, path: str) -> None:
    crc = 0
    for t in state.values():
        crc = zlib.crc32(t.numpy().data, crc)


def methods(baseline: str | None, parts: bool) -> dict[str, Callable[[dict, str], None]]:
    chosen: dict[str, Callable[[dict, str], None]] = {"raw": raw_write, "atomic_save": checkpoint_file.atomic_save}
    if baseline:
        chosen[f"atomic_save@{baseline}"] = load_revision(baseline).atomic_save
    chosen["torch.save+fsync"] = stock_save_fsync
    chosen["torch.save"] = torch.save  # as most training scripts call it: to a path, no fsync
    if parts:
        chosen["part: write, no fsync"] = lambda state, path: raw_write(state, path, fsync=False)
        chosen["part: zlib.crc32"] = _crc
        chosen["part: torch.save, zip crc"] = _torch_save_sink(True)
        chosen["part: torch.save, no crc"] = _torch_save_sink(False)
    return chosen


def spread(values: list[float]) -> str:
    return "/".join(f"{v:.3f}" for v in (min(values), statistics.median(values), max(values)))


def measure(size_mib: int, runs: int, directory: str, fns: dict[str, Callable[[dict, str], None]]) -> list[dict]:
    """One row per method: ``benchmark``, ``size_mib``, ``method``, ``baseline`` (``raw``), ``times`` (seconds per
    run) and ``extra`` (None: memory is not measured here), plain data so ``python -m benchmarks`` can pass it
    between processes."""
    state = make_state(size_mib)
    size = sum(t.numel() * 4 for t in state.values())
    times: dict[str, list[float]] = {m: [] for m in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            path = os.path.join(directory, "state.pt")
            os.sync()  # every method starts with no dirty pages of an earlier one to flush
            start = time.perf_counter()
            fn(state, path)
            times[name].append(time.perf_counter() - start)
            if os.path.exists(path):
                if name.startswith("atomic_save"):
                    assert ranksafe.verify_file(path), name
                os.unlink(path)
    return [
        {
            "benchmark": "save_path",
            "size_mib": size / (1 << 20),
            "method": name,
            "baseline": "raw",
            "times": values,
            "extra": None,
        }
        for name, values in times.items()
    ]


def collect(sizes_mib: list[int], runs: int, directory: str | None = None) -> list[dict]:
    """The default methods (no baseline revision, no parts) at every size, written in a temporary directory."""
    work = tempfile.mkdtemp(prefix="save_path-", dir=directory or os.getcwd())
    try:
        return [row for size in sizes_mib for row in measure(size, runs, work, methods(None, False))]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench(size_mib: int, runs: int, directory: str, fns: dict[str, Callable[[dict, str], None]]) -> None:
    rows = measure(size_mib, runs, directory, fns)
    raw = statistics.median(rows[0]["times"])
    print(f"\n{rows[0]['size_mib']:.0f} MiB state, {runs} runs each, interleaved")
    print(f"{'method':<28} {'seconds min/median/max':>24} {'median / raw':>13}")
    for row in rows:
        values = row["times"]
        print(f"{row['method']:<28} {spread(values):>24} {statistics.median(values) / raw:>13.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[100, 1024])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--baseline", default=None, help="git revision of atomic_save to compare with")
    parser.add_argument("--parts", action="store_true", help="also time torch.save, crc32 and write alone")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir in the cwd)")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="save_path-", dir=args.dir or os.getcwd())
    fns = methods(args.baseline, args.parts)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()}, writing to {directory}")
    try:
        for size in args.sizes_mib:
            bench(size, args.runs, directory, fns)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
