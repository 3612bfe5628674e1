"""``ranksafe demo``: a real multi-process CPU training that saves the naive way and the ranksafe way.

Each rank trains a small DDP model, then every round
1. *naive*: every rank clears the run directory and ``torch.save``s the weights, as many scripts do;
2. *ranksafe*: ``prepare_dir`` + ``save`` + ``load``: one writer, atomic file, barrier inside load.
Finally rank 0's write is made to fail, and we time how fast every rank hears about it.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _naive_round(run_dir: str, state: dict) -> int:
    """Every rank clears and recreates the directory and writes the same file. Returns errors seen."""
    errors = 0
    try:
        if os.path.exists(run_dir):
            shutil.rmtree(run_dir)
        time.sleep(0.01)  # the check and the creation are never instantaneous (a busy NFS server, say)
        os.makedirs(run_dir)
        torch.save(state, os.path.join(run_dir, "model.pth"))
    except Exception:  # OSError from the file system, RuntimeError from torch.save's writer
        errors += 1
    dist.barrier()
    try:
        loaded = torch.load(os.path.join(run_dir, "model.pth"), weights_only=True)
        errors += not all(torch.equal(loaded[k], v) for k, v in state.items())
    except Exception:
        errors += 1
    dist.barrier()
    return errors


def _ranksafe_round(run_dir: str, state: dict) -> int:
    import ranksafe

    ranksafe.prepare_dir(run_dir, overwrite=True)
    path = ranksafe.save(state, os.path.join(run_dir, "model.pth"))
    loaded = ranksafe.load(path)
    return int(not all(torch.equal(loaded[k], v) for k, v in state.items()))


def _worker(rank: int, world: int, port: int, root: str, rounds: int, queue: Any) -> None:
    import ranksafe

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(rank)  # different data per rank; DDP keeps the weights identical
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(20):
        x = torch.randn(64, 32)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}

    naive = safe = 0
    for i in range(rounds):  # the two patterns side by side, round after round
        n = _naive_round(os.path.join(root, "naive"), state)
        s = _ranksafe_round(os.path.join(root, "ranksafe"), state)
        naive, safe = naive + n, safe + s
        queue.put({"progress": i, "rank": rank, "naive": n, "ranksafe": s})

    blocker = os.path.join(root, "blocker")
    if rank == 0:
        with open(blocker, "w") as f:
            f.write("a file where a directory must go")
    ranksafe.barrier("blocker ready")
    start = time.monotonic()
    try:
        ranksafe.save(state, os.path.join(blocker, "model.pth"))
        failure = "no error"
    except ranksafe.RankFailure as e:
        failure = f"{type(e).__name__} after {time.monotonic() - start:.3f}s: {e.failures[0]}"
    report = {"rank": rank, "local_rank": ranksafe.local_rank(), "env_rank": os.environ.get("RANK")}
    queue.put({**report, "loss": loss.item(), "naive": naive, "ranksafe": safe, "failure": failure})
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Progress:
    """One line per save round, once every rank has reported it: errors so far, naive versus ranksafe."""

    def __init__(self, ranks: int, rounds: int):
        self.ranks, self.rounds = ranks, rounds
        self.seen: dict[int, list[dict]] = {}
        self.naive = self.safe = 0

    def add(self, message: dict) -> None:
        reports = self.seen.setdefault(message["progress"], [])
        reports.append(message)
        if len(reports) < self.ranks:
            return
        self.naive += sum(m["naive"] for m in reports)
        self.safe += sum(m["ranksafe"] for m in reports)
        done = message["progress"] + 1
        bar = "#" * (20 * done // self.rounds)
        print(
            f"  round {done:>3}/{self.rounds} [{bar:<20}]  errors so far: naive {self.naive:>3}, ranksafe {self.safe}"
        )


def run(ranks: int = 4, rounds: int = 10, timeout: float = 180.0) -> int:
    """Run the demo on ``ranks`` spawned CPU processes; print what happened. Returns an exit code."""
    print(f"ranksafe demo: {ranks} processes (torch.multiprocessing spawn, gloo, CPU), {rounds} save rounds each\n")
    with tempfile.TemporaryDirectory(prefix="ranksafe-demo-") as root:
        results, exitcodes = _run_ranks(ranks, rounds, timeout, root)
    if len(results) < ranks:
        print(f"FAILED: only {len(results)} of {ranks} ranks reported (exit codes {exitcodes})")
        return 1
    return _report(sorted(results, key=lambda r: r["rank"]), rounds, root)


def _run_ranks(ranks: int, rounds: int, timeout: float, root: str) -> tuple[list[dict], list[int | None]]:
    """Start the ranks, print their progress, and collect each rank's result (fewer if some never report)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, ranks, port, root, rounds, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + timeout
    progress = _Progress(ranks, rounds)
    while len(results) < ranks and time.monotonic() < deadline:
        try:
            message = queue.get(timeout=1)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            continue
        if "progress" in message:
            progress.add(message)
        else:
            results.append(message)
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    return results, [p.exitcode for p in procs]


def _report(results: list[dict], rounds: int, root: str) -> int:
    """Print each rank's result and the totals; 0 when ranksafe made no error and every rank heard the failure."""
    ranks = len(results)
    print(f"{'rank':>4} {'RANK env':>8} {'local':>5} {'loss':>8} {'naive errors':>12} {'ranksafe errors':>15}")
    for r in results:
        env_rank = r["env_rank"] or "-"
        print(
            f"{r['rank']:>4} {env_rank:>8} {r['local_rank']:>5} {r['loss']:>8.3f} {r['naive']:>12} {r['ranksafe']:>15}"
        )
    naive, safe = sum(r["naive"] for r in results), sum(r["ranksafe"] for r in results)
    total = ranks * rounds
    print(f"\nnaive   (every rank: rmtree, mkdir, torch.save, torch.load): {naive} errors in {total} rank-rounds")
    print(f"ranksafe (prepare_dir, save, load: one writer, atomic, barrier): {safe} errors in {total} rank-rounds")
    print(f"\nA write that fails on rank 0 (a file where the directory must go), as seen by each rank ({root} = DIR):")
    for r in results:
        print(f"  rank {r['rank']}: {r['failure'].replace(root, 'DIR')[:200]}")
    heard = sum(r["failure"].startswith("RankFailure") for r in results)
    ok = safe == 0 and heard == ranks
    print(f"\n{'OK' if ok else 'FAILED'}: ranksafe {safe} errors; failure raised on {heard}/{ranks} ranks, no hang")
    return 0 if ok else 1
