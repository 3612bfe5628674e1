"""The one markdown table of ``python -m benchmarks``: rows from the scripts' ``collect``, ratios to each
benchmark's baseline, and the project's targets with met / missed. Presentation only; nothing is timed here."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# (script, method as the script names it) -> what the reader sees; the order here is the table's order.
LABELS: dict[tuple[str, str], str] = {
    ("lightning_io", "raw"): "raw write + fsync",
    ("lightning_io", "stock"): "Lightning TorchCheckpointIO",
    ("lightning_io", "ranksafe"): "ranksafe RankSafeCheckpointIO",
    ("lightning_io", "ranksafe.atomic_save"): "ranksafe atomic_save",
    ("save_path", "raw"): "raw write + fsync",
    ("save_path", "torch.save"): "torch.save (plain, no fsync)",
    ("save_path", "torch.save+fsync"): "torch.save + fsync",
    ("save_path", "atomic_save"): "ranksafe atomic_save",
    ("async_save", "floor"): "memcpy into a preallocated buffer",
    ("async_save", "lightning"): "Lightning AsyncCheckpointIO",
    ("async_save", "dcp"): "torch.distributed.checkpoint.async_save",
    ("async_save", "ranksafe"): "ranksafe AsyncSaver",
    ("async_save_large", "floor"): "memcpy into a preallocated buffer",
    ("async_save_large", "lightning"): "Lightning AsyncCheckpointIO",
    ("async_save_large", "dcp"): "torch.distributed.checkpoint.async_save",
    ("async_save_large", "ranksafe"): "ranksafe AsyncSaver",
    ("cuda_async", "floor"): "device-to-pinned-host copy into a preallocated buffer",
    ("cuda_async", "ranksafe"): "ranksafe AsyncSaver",
    ("cuda_async", "dcp"): "torch.distributed.checkpoint.async_save, pinned stager",
    ("cuda_async", "lightning"): "Lightning AsyncCheckpointIO",
    ("cuda_async", "cpu"): ".cpu() copy, then torch.save on a thread",
    ("fastai_fit", "stock"): "stock fastai",
    ("fastai_fit", "ranksafe"): "fastai + RankSafe()",
    **{
        (f"sharded_{kind}_{world}", method): label
        for world in (2, 4)
        for kind, methods in (
            ("sync", {"dcp": "torch.distributed.checkpoint.save", "ranksafe": "ranksafe CheckpointManager.save"}),
            ("async", {"dcp": "torch.distributed.checkpoint.async_save", "ranksafe": "ranksafe, async_save=True"}),
        )
        for method, label in methods.items()
    },
}

BENCHMARKS: dict[str, str] = {
    "lightning_io": "sync save, Lightning plugin",
    "save_path": "sync save, function",
    "async_save": "async save, time blocked, 1,000 small tensors + large ones",
    "async_save_large": "async save, time blocked, large tensors only",
    "cuda_async": "async save of GPU state (bf16, 1,000 tensors), time until the state may change",
    "fastai_fit": "fastai DDP fit, 2 ranks, time per epoch",
    "sharded_sync_2": "sharded save (DTensors), 2 ranks, slowest rank's time",
    "sharded_async_2": "sharded async save, 2 ranks, time blocked",
    "sharded_sync_4": "sharded save (DTensors), 4 ranks, slowest rank's time",
    "sharded_async_4": "sharded async save, 4 ranks, time blocked",
}
# the scripts that measure them (each in its own process); async_save measures both of its kinds of state, sharded
# its four; cuda_async runs only where CUDA is (CUDA_SCRIPTS)
SCRIPTS = ("lightning_io", "save_path", "async_save", "fastai_fit", "sharded")
CUDA_SCRIPTS = ("cuda_async",)


@dataclass(frozen=True)
class Target:
    """A goal for one ranksafe method: ratios to the baseline's median, and peak extra RAM over the state size."""

    median: float
    max: float | None = None
    extra: float | None = None

    def describe(self) -> str:
        parts = [f"median <= {self.median:g}x"]
        if self.max is not None:
            parts.append(f"max <= {self.max:g}x")
        if self.extra is not None:
            parts.append(f"extra RAM <= {self.extra:g}x")
        return ", ".join(parts)

    def misses(self, median: float, worst: float, extra: float | None) -> list[str]:
        """What is over its bound (empty: met). Unmeasured memory counts as missed, not as met."""
        out = []
        if median > self.median:
            out.append(f"median {median:.2f}x")
        if self.max is not None and worst > self.max:
            out.append(f"max {worst:.2f}x")
        if self.extra is not None and (extra is None or extra > self.extra):
            out.append("extra RAM " + ("n/a" if extra is None else f"{extra:.2f}x"))
        return out


SYNC = Target(median=1.15, extra=0.05)
TARGETS: dict[tuple[str, str], Target] = {
    ("lightning_io", "ranksafe"): SYNC,
    ("lightning_io", "ranksafe.atomic_save"): SYNC,
    ("save_path", "atomic_save"): Target(median=1.15),  # save_path does not measure memory; lightning_io does
    # 1,040 tensors copied one by one against one memcpy of the same bytes: the per-tensor cost shows at 100 MiB
    ("async_save", "ranksafe"): Target(median=1.5, max=2.0),
    ("async_save_large", "ranksafe"): Target(median=1.15, max=2.0),
    # one non-blocking copy per tensor into pinned buffers and one synchronisation, against one copy of the bytes
    ("cuda_async", "ranksafe"): Target(median=1.1),
    # two collectives per epoch and one all-reduced float per batch must not show in a fit's time
    ("fastai_fit", "ranksafe"): Target(median=1.05),
    # the manifest and three exchanges must not show next to DCP's own write, nor the snapshot next to DCP's stager
    **{(f"sharded_{kind}_{world}", "ranksafe"): Target(median=1.05) for kind in ("sync", "async") for world in (2, 4)},
}

HEADER = (
    "benchmark",
    "size MiB",
    "method",
    "baseline",
    "min ms",
    "median ms",
    "max ms",
    "median / baseline",
    "max / baseline",
    "extra RAM / size",
    "target",
    "met",
)


def _order(row: dict) -> tuple[int, float, int]:
    keys = list(LABELS)
    key = (row["benchmark"], row["method"])
    return list(BENCHMARKS).index(row["benchmark"]), row["size_mib"], keys.index(key) if key in keys else len(keys)


def table(rows: list[dict]) -> str:
    """Markdown, one line per row. Ratios divide by the median of the same benchmark's baseline at the same size,
    timed in the same process and interleaved with (or right before) the method: the row's own
    ``baseline_times`` where it has them (a method measured in a process of its own), else the baseline row's.
    ``extra RAM / size`` is the highest peak over the runs (n/a where the script does not measure memory)."""
    baselines = {
        (r["benchmark"], r["size_mib"]): statistics.median(r["times"]) for r in rows if r["method"] == r["baseline"]
    }
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    for row in sorted(rows, key=_order):
        key = (row["benchmark"], row["method"])
        own = row.get("baseline_times")  # the baseline timed beside this method, in its process
        base = statistics.median(own) if own else baselines[(row["benchmark"], row["size_mib"])]
        times = row["times"]
        median, worst = statistics.median(times) / base, max(times) / base
        extra = max(row["extra"]) if row["extra"] else None
        target = TARGETS.get(key)
        if target is None:
            goal, met = "", ""
        else:
            misses = target.misses(median, worst, extra)
            goal, met = target.describe(), ("missed: " + ", ".join(misses)) if misses else "met"
        cells = (
            BENCHMARKS.get(row["benchmark"], row["benchmark"]),
            f"{row['size_mib']:.0f}",
            LABELS.get(key, row["method"]),
            LABELS.get((row["benchmark"], row["baseline"]), row["baseline"]),
            f"{min(times) * 1e3:.1f}",
            f"{statistics.median(times) * 1e3:.1f}",
            f"{max(times) * 1e3:.1f}",
            f"{median:.2f}",
            f"{worst:.2f}",
            "n/a" if extra is None else f"{extra:.3f}",
            goal,
            met,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
