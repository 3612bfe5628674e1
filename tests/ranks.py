"""Run a function on N real ranks (separate processes, gloo, TCP store) with a hard deadline.

Every multi-process test goes through :func:`run_ranks`. It never blocks CI: processes still alive at the
deadline are killed and reported as hung. Results travel through files, so a rank that dies or is
killed cannot wedge a queue.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


@dataclass
class RankResult:
    rank: int
    ok: bool = False
    value: Any = None
    error_type: str | None = None  # class names along the MRO, most specific first
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    hung: bool = False

    def raised(self, name: str) -> bool:
        return self.error_type is not None and name in self.error_type.split(",")


@dataclass
class Ranks:
    results: list[RankResult]
    elapsed: float
    log: list[str] = field(default_factory=list)

    def __getitem__(self, r: int) -> RankResult:
        return self.results[r]

    @property
    def values(self) -> list[Any]:
        self.check()
        return [r.value for r in self.results]

    @property
    def hung(self) -> list[int]:
        return [r.rank for r in self.results if r.hung]

    def check(self) -> Ranks:
        """Raise with every rank's traceback unless all ranks returned normally."""
        bad = [r for r in self.results if not r.ok]
        if bad:
            detail = "\n".join(
                f"--- rank {r.rank}: {'HUNG' if r.hung else r.error_type} exit={r.exitcode}\n{r.traceback or r.error}"
                for r in bad
            )
            raise AssertionError(f"{len(bad)} rank(s) failed:\n{detail}")
        return self


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks fork from one server process that imported torch once (Python 3.14's default start method on Linux),
# instead of each rank starting an interpreter and importing torch again, as spawn does: on a 2-core machine
# that import was most of a short multi-rank test. A rank is still a process of its own with its own gloo group.
# The server imports nothing of ranksafe, Lightning or fastai: each rank imports those itself.
_START = mp.get_context("forkserver")
_START.set_forkserver_preload(["torch", "torch.distributed"])


def _child(
    call: bytes, rank: int, world: int, port: int, outdir: str, environ: dict, init: bool, launch_env: bool
) -> None:
    # The server's environment and output are those it started with. Take the caller's environment, as a spawned
    # process would, before unpickling the test's function imports its module; the output goes to files that
    # the caller copies to its own (where pytest captures it) once the ranks are done.
    os.environ.clear()
    os.environ.update(environ)
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        out = os.open(os.path.join(outdir, f"{rank}.{stream}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(out, fd)
        os.close(out)
    if launch_env:  # like torchrun
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    res = RankResult(rank)
    try:
        fn, args = pickle.loads(call)
        if init:
            from datetime import timedelta

            import torch.distributed as dist

            method = "env://" if launch_env else f"tcp://127.0.0.1:{port}"
            timeout = timedelta(seconds=float(os.environ.get("TEST_PG_TIMEOUT", "60")))
            dist.init_process_group("gloo", init_method=method, rank=rank, world_size=world, timeout=timeout)
        res.value = fn(rank, *args)
        res.ok = True
    except BaseException as e:
        res.error_type = ",".join(t.__name__ for t in type(e).__mro__)
        res.error = str(e)
        res.traceback = traceback.format_exc()
    try:
        data = pickle.dumps(res)
    except Exception as e:  # an unpicklable return value is a test bug; report it
        data = pickle.dumps(RankResult(rank, error_type="PicklingError", error=str(e)))
    tmp = os.path.join(outdir, f".{rank}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(outdir, f"{rank}.pkl"))
    # Run the exit hooks as a normal exit would, then skip interpreter teardown: a rank whose peers died
    # can block in the process group's destructor.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    fn: Callable,
    nprocs: int = 2,
    *,
    args: tuple = (),
    timeout: float = 90,
    env: dict[str, str] | None = None,
    init: bool = True,
    launch_env: bool = False,
) -> Ranks:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes; return every rank's result.

    ``init``: initialise a gloo process group first (rank passed explicitly, as under ``mp.spawn``).
    ``launch_env``: also export torchrun's variables and initialise from ``env://``.
    ``timeout``: seconds for the whole run; ranks still alive then are killed and marked ``hung``.
    ``fn`` must be a module-level function (it is pickled by name).
    """
    # Like mp.spawn: no launcher variables unless the test asks for them.
    environ = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    environ.update({"RANKSAFE_TIMEOUT": "30", **(env or {})})
    call = pickle.dumps((fn, args))
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ranks-") as outdir:
        port = free_port()
        procs = [
            _START.Process(target=_child, args=(call, r, nprocs, port, outdir, environ, init, launch_env), daemon=True)
            for r in range(nprocs)
        ]
        for p in procs:
            p.start()
        deadline = start + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        results = []
        for r, p in enumerate(procs):
            hung = p.is_alive()
            if hung:
                p.kill()
                p.join(5)
            for fd, stream in ((1, "stdout"), (2, "stderr")):
                with contextlib.suppress(FileNotFoundError), open(fd, "wb", closefd=False) as caller:
                    caller.write(Path(outdir, f"{r}.{stream}").read_bytes())
            path = os.path.join(outdir, f"{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    res = pickle.load(f)
            else:
                res = RankResult(r, error_type="Died" if not hung else "Hung", error="no result")
            res.hung, res.exitcode = hung, p.exitcode
            results.append(res)
    return Ranks(results, time.monotonic() - start)


def signal_when_at_step(root: str | os.PathLike, rank: int, at_step: int, sig: int) -> threading.Thread:
    """From outside, as a cluster does: send ``sig`` to ``rank``'s process once it reported ``at_step`` (it writes
    its pid to ``root/pid-RANK`` and each finished step to ``root/step-RANK``). Gives up after two minutes."""

    def send() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if int(Path(root, f"step-{rank}").read_text() or -1) >= at_step:
                    os.kill(int(Path(root, f"pid-{rank}").read_text()), sig)
                    return
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.002)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread
