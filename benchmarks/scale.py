"""How ranksafe's collectives scale with the number of processes, next to gloo's own collectives.

For each world size (default 2, 4, 8, 16, 32 processes, one gloo process group each, started in one run) every
operation below runs ``--reps`` times; before each repetition a gloo barrier lines the ranks up, and the
repetition's latency is the slowest rank's. Printed as one markdown table: median and p90 in milliseconds, and
the median over gloo's barrier at the same world size.

  gloo barrier           torch.distributed.barrier (the baseline)
  gloo all_reduce        torch.distributed.all_reduce of one float
  ranksafe barrier       ranksafe.barrier: one exchange over the c10d store
  ranksafe agree         ranksafe.agree(x, "max"): one exchange
  ranksafe save          ranksafe.save of a 4 KiB state to a temporary directory (one writer, fsync, shared outcome)
  AsyncSaver.check       the full check of background saves: one exchange, which waits for every rank
  AsyncSaver.poll        the per-step check: one store read per rank while no rank has a failure

More processes than CPU cores share the cores: there, latencies measure the scheduler as much as the protocol
(the output says so).

    python benchmarks/scale.py
    python benchmarks/scale.py --worlds 2 4 --reps 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

import ranksafe

OPERATIONS = (
    "gloo barrier",
    "gloo all_reduce",
    "ranksafe barrier",
    "ranksafe agree",
    "ranksafe save",
    "AsyncSaver.check",
    "AsyncSaver.poll",
)
BASELINE = "gloo barrier"
HEADER = ("ranks", "operation", "median ms", "p90 ms", "median / gloo barrier")


def _operations(directory: str) -> dict[str, Callable[[], object]]:
    """Every operation, ready to call once on this rank (the process group is up)."""
    one = torch.ones(1)
    state = {"w": torch.zeros(1024)}
    path = os.path.join(directory, "state.pt")
    saver = ranksafe.AsyncSaver(writer="all")
    return {
        "gloo barrier": dist.barrier,
        "gloo all_reduce": lambda: dist.all_reduce(one),
        "ranksafe barrier": lambda: ranksafe.barrier("scale"),
        "ranksafe agree": lambda: ranksafe.agree(float(ranksafe.rank()), "max"),
        "ranksafe save": lambda: ranksafe.save(state, path),
        "AsyncSaver.check": saver.check,
        "AsyncSaver.poll": saver.poll,
    }


def _rank(rank: int, world: int, port: int, reps: int, directory: str, results: mp.Queue) -> None:
    """One process: time every operation ``reps`` times; rank 0 puts the slowest rank's times on ``results``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    operations = _operations(directory)
    for call in operations.values():  # warm: the first exchange of a group also swaps host names
        call()
    times: dict[str, list[float]] = {}
    for name, call in operations.items():
        mine = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            call()
            mine.append(time.perf_counter() - start)
        slowest = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times[name] = slowest.tolist()
    if rank == 0:
        results.put(times)
    dist.barrier()  # no rank leaves while rank 0, which hosts the store, may still be needed
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, reps: int, directory: str, timeout: float = 300) -> dict[str, list[float]]:
    """Seconds per repetition of every operation (the slowest rank's) with ``world`` processes."""
    # fork: the processes start with torch and ranksafe imported (32 imports of torch took most of a run)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    results = ctx.Queue()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="ranksafe-scale-", dir=directory) as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, port, reps, tmp, results)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            times = results.get(timeout=timeout)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
    return times


def rows(measured: dict[int, dict[str, list[float]]]) -> list[tuple[str, ...]]:
    """The table's rows: one per world size and operation."""
    out = []
    for world, times in measured.items():
        baseline = statistics.median(times[BASELINE])
        for name in OPERATIONS:
            ms = sorted(t * 1e3 for t in times[name])
            median, p90 = statistics.median(ms), ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))]
            out.append((str(world), name, f"{median:.2f}", f"{p90:.2f}", f"{median / (baseline * 1e3):.2f}"))
    return out


def table(measured: dict[int, dict[str, list[float]]]) -> str:
    """The markdown table of :func:`rows`."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(measured)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 32], help="process counts")
    parser.add_argument("--reps", type=int, default=40, help="repetitions per operation and world size")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where ranksafe save writes (a temporary dir)")
    args = parser.parse_args()
    os.environ.setdefault("RANKSAFE_TIMEOUT", "120")
    cpus = os.cpu_count() or 1
    start = time.monotonic()
    measured = {world: measure(world, args.reps, args.dir) for world in args.worlds}
    crowded = [w for w in args.worlds if w > cpus]
    print(
        f"{cpus} CPUs, {args.reps} repetitions per operation; load average {os.getloadavg()[0]:.2f} (1 min); "
        f"{time.monotonic() - start:.0f} s in all"
    )
    if crowded:
        print(
            f"oversubscribed: {', '.join(map(str, crowded))} processes on {cpus} CPUs share the cores, so their "
            "latencies measure the scheduler as much as the protocol"
        )
    print()
    print(table(measured))
    print(
        "\nms: the slowest rank's wall time of one call, the ranks lined up by a gloo barrier before each; "
        "ratios divide by gloo's barrier median at the same world size."
    )


if __name__ == "__main__":
    main()
