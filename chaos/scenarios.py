"""Fault scenarios: each runs real ranks (tests/ranks.py), injects one fault, and judges the outcome.

Every scenario returns an :class:`Outcome`; the judgement never trusts the ranks' own report alone: files are
re-read and verified by the parent process. What counts as bad:

* ``hang``: a rank still alive at the hard deadline;
* ``torn``: the checkpoint on disk is unreadable or mixes two versions;
* ``lost``: the checkpoint on disk is older than the last save that returned successfully (a lost commit);
* ``wrong``: a load returned values that differ from what was committed;
* ``unseen``: a rank that survived the fault did not raise (the error was not shared).
"""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tests.ranks import Ranks, run_ranks

import ranksafe

_FAST = {"RANKSAFE_TIMEOUT": "3", "TEST_PG_TIMEOUT": "20"}  # a missing rank is noticed in seconds
_BIG = 4 * 1024 * 1024  # float32 elements per version: 16 MiB, so a kill lands mid-save


@dataclass
class Outcome:
    hang: bool = False
    torn: bool = False
    lost: bool = False
    wrong: bool = False
    unseen: bool = False
    skipped: str | None = None
    note: str = ""

    @property
    def bad(self) -> bool:
        return self.hang or self.torn or self.lost or self.wrong or self.unseen


def _version_on_disk(path: str) -> tuple[float | None, bool]:
    """(version, torn): the version a verified load finds, or torn if the file cannot be trusted."""
    try:
        w = ranksafe.load_file(path)["w"]
    except FileNotFoundError:
        return None, False
    except Exception:
        return None, True
    v = float(w[0])
    return v, not bool(torch.all(w == v))


def _judge_file(path: str, last_ok: int, out: Outcome) -> Outcome:
    version, torn = _version_on_disk(path)
    out.torn |= torn
    if version is None and not torn and last_ok >= 0:
        out.lost = True
    if version is not None and not torn:
        out.lost |= version < last_ok
        out.note = f"on disk v{version:g}, last acknowledged v{last_ok}"
    return out


def _failed(res: Ranks, ranks: list[int]) -> bool:
    """Every rank in ``ranks`` raised a shared ranksafe error (and did not hang)."""
    return all(res[r].value and res[r].value[0] in ("RankFailure", "BarrierTimeout") for r in ranks)


# --- SIGKILL during a save ------------------------------------------------------------------------------


def _saving_loop(rank: int, path: str, victim: int, delay: float) -> tuple[str, int]:
    ranksafe.save({"w": torch.zeros(_BIG)}, path)  # version 0, committed before any fault
    pids = ranksafe.all_gather(os.getpid())
    if rank != victim:
        threading.Timer(delay, os.kill, (pids[victim], signal.SIGKILL)).start()
    last_ok = 0
    try:
        for v in range(1, 10_000):
            ranksafe.save({"w": torch.full((_BIG,), float(v))}, path)
            last_ok = v
    except ranksafe.RankFailure as e:
        return ("BarrierTimeout" if isinstance(e, ranksafe.BarrierTimeout) else "RankFailure", last_ok)
    return ("no error", last_ok)


def _kill(victim: int, run: int, workdir: str) -> Outcome:
    path = os.path.join(workdir, "model.pth")
    delay = random.Random(run).uniform(0.05, 1.0)
    res = run_ranks(_saving_loop, 2, args=(path, victim, delay), timeout=60, env=_FAST)
    survivor = 1 - victim
    out = Outcome(hang=bool(res.hung), unseen=not _failed(res, [survivor]))
    last_ok = res[survivor].value[1] if res[survivor].value else 0
    return _judge_file(path, last_ok, out)


def kill_writer(run: int, workdir: str) -> Outcome:
    """SIGKILL of the writer (rank 0, which also hosts the store) at a random point of a save."""
    return _kill(0, run, workdir)


def kill_nonwriter(run: int, workdir: str) -> Outcome:
    """SIGKILL of a non-writer at a random point while rank 0 saves."""
    return _kill(1, run, workdir)


# --- write failures -------------------------------------------------------------------------------------


def _save_twice(rank: int, path: str, fsize: int | None) -> tuple[str, int]:
    ranksafe.save({"w": torch.full((_BIG // 16,), 1.0)}, path)  # 1 MiB, committed
    if rank == 0 and fsize is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))
    try:
        ranksafe.save({"w": torch.full((_BIG // 4,), 2.0)}, path)  # 4 MiB
    except ranksafe.RankFailure:
        return ("RankFailure", 1)
    return ("no error", 2)


def _judge_write_failure(res: Ranks, path: str) -> Outcome:
    out = Outcome(hang=bool(res.hung), unseen=not _failed(res, [0, 1]))
    debris = [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".ranksafe-tmp")]
    if debris:
        out.note = f"debris left: {debris}"
        out.torn = True
    return _judge_file(path, 1, out)


def file_too_large(run: int, workdir: str) -> Outcome:
    """The writer hits RLIMIT_FSIZE mid-write (EFBIG, holds for root)."""
    path = os.path.join(workdir, "model.pth")
    res = run_ranks(_save_twice, 2, args=(path, 2 * 1024 * 1024), timeout=60, env=_FAST)
    return _judge_write_failure(res, path)


def disk_full(run: int, workdir: str) -> Outcome:
    """The writer's file system is full (a 3 MiB tmpfs): ENOSPC mid-write."""
    mnt = os.path.join(workdir, "tmpfs")
    os.makedirs(mnt)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", mnt], capture_output=True, text=True)
    if mounted.returncode != 0:
        return Outcome(skipped=f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        path = os.path.join(mnt, "model.pth")
        res = run_ranks(_save_twice, 2, args=(path, None), timeout=60, env=_FAST)
        return _judge_write_failure(res, path)
    finally:
        subprocess.run(["umount", mnt], check=False)


# --- decisions and barriers -----------------------------------------------------------------------------


def _disagreeing_epochs(rank: int, path: str, seed: int) -> list[int]:
    rng = random.Random(seed * 100 + rank)  # every rank sees different metric values
    best, saved = float("inf"), []
    for epoch in range(8):
        loss = rng.random()
        if ranksafe.agree(loss < best, op="all", name="new best"):
            best = min(best, ranksafe.agree(loss, op="max"))
            ranksafe.save({"w": torch.full((16,), float(epoch))}, path)
            saved.append(epoch)
    return saved


def disagreeing_ranks(run: int, workdir: str) -> Outcome:
    """Ranks compute different metrics and decide whether to save through ``agree``."""
    res = run_ranks(_disagreeing_epochs, 3, args=(os.path.join(workdir, "best.pth"), run), timeout=60, env=_FAST)
    out = Outcome(hang=bool(res.hung))
    decisions = [r.value for r in res.results]
    out.wrong = any(d != decisions[0] for d in decisions) or any(not r.ok for r in res.results)
    out.note = f"saved at epochs {decisions[0]}"
    return out


def _dies_before_barrier(rank: int, seed: int) -> tuple[str, list[int]] | None:
    rng = random.Random(seed)
    steps = rng.randint(0, 3)
    for _ in range(steps):
        ranksafe.barrier("step")
    if rank == 1:
        time.sleep(rng.uniform(0, 0.3))
        os._exit(1)
    try:
        ranksafe.barrier("step")
    except ranksafe.BarrierTimeout as e:
        return ("BarrierTimeout", e.missing)
    return ("no error", [])


def rank_dies_before_barrier(run: int, workdir: str) -> Outcome:
    """A rank exits before a barrier: the others get BarrierTimeout naming it, in seconds."""
    res = run_ranks(_dies_before_barrier, 3, args=(run,), timeout=60, env=_FAST)
    out = Outcome(hang=bool(res.hung))
    out.unseen = not all(res[r].value == ("BarrierTimeout", [1]) for r in (0, 2))
    return out


# --- bad files on load ----------------------------------------------------------------------------------


def _load(rank: int, path: str) -> str:
    try:
        ranksafe.load(path)
    except (ranksafe.CorruptCheckpoint, FileNotFoundError) as e:
        return "RankFailure" if isinstance(e, ranksafe.RankFailure) else f"local {type(e).__name__}"
    return "loaded"


def bad_file_on_load(run: int, workdir: str) -> Outcome:
    """A truncated, bit-flipped or missing checkpoint at a random position: refused on every rank."""
    rng = random.Random(run)
    path = os.path.join(workdir, "model.pth")
    ranksafe.atomic_save({"w": torch.arange(4096, dtype=torch.float32)}, path)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    kind = ["truncate", "flip", "missing"][run % 3]
    if kind == "truncate":
        data = data[: rng.randrange(len(data))]
    elif kind == "flip":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    with open(path, "wb") as f:
        f.write(data)
    if kind == "missing":
        os.unlink(path)
    res = run_ranks(_load, 2, args=(path,), timeout=60, env=_FAST)
    out = Outcome(hang=bool(res.hung), note=kind)
    out.wrong = any(r.value == "loaded" for r in res.results)
    out.unseen = not all(r.value == "RankFailure" for r in res.results)
    return out


SCENARIOS: dict[str, Callable[[int, str], Outcome]] = {
    f.__name__: f
    for f in (
        kill_writer,
        kill_nonwriter,
        file_too_large,
        disk_full,
        disagreeing_ranks,
        rank_dies_before_barrier,
        bad_file_on_load,
    )
}


def run_scenario(name: str, runs: int, root: str) -> list[Outcome]:
    outcomes = []
    for run in range(runs):
        workdir = os.path.join(root, f"{name}-{run}")
        os.makedirs(workdir)
        outcomes.append(SCENARIOS[name](run, workdir))
    return outcomes
