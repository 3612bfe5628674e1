"""``ranksafe doctor ROOT``: what ranksafe sees of this job and of ROOT, in plain language.

Run it the way the training runs (``torchrun --nproc_per_node=N -m ranksafe doctor ROOT``, ``srun ...``) so
that it meets the same ranks, nodes and file systems. It reports the topology, whether ROOT is shared or
node-local (and so who writes there), the latency of a barrier and an agreement, and ROOT's write bandwidth
for an atomic, fsynced save. ROOT is created if missing, as a checkpoint save would. ROOT may be a URL of remote
storage (``s3://bucket/run``): shared by every rank, written by rank 0. Only rank 0 prints; a problem with ROOT (a
file in the way, no permission, a bucket that does not exist) is one ``BAD`` line and exit status 1, on every rank.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from . import remote, topology
from .checkpoint_file import atomic_save
from .collectives import agree, all_gather, barrier, together
from .errors import RankSafeError
from .files import make_dirs
from .storage import StorageKind, check_every_rank_sees, placement


def _init() -> bool:
    """Join the launcher's process group if there is one; True when this process created it."""
    if topology.is_distributed() or topology.world_size() == 1:
        return False
    dist.init_process_group("gloo")
    return True


def _latency(fn, repeats: int = 20) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def run(root: str, megabytes: int = 64) -> int:
    created = _init()
    try:
        root = remote.canonical(root)  # a URL stays one: made absolute, it would name a local folder "s3:"
        return _report(root, megabytes)
    except (OSError, ValueError, RankSafeError) as e:  # raised on every rank alike: the probes below are shared
        if topology.is_main():
            print(f"BAD {root}: {e.strerror if isinstance(e, OSError) and e.strerror else e}", file=sys.stderr)
        return 1
    finally:
        if created:
            dist.destroy_process_group()


def _report(root: str, megabytes: int) -> int:
    me = {"rank": topology.rank(), "local": topology.local_rank(), "host": topology.hostname()}
    ranks = all_gather(me, name="doctor: topology")
    nodes = all_gather(topology.node_rank(), name="doctor: nodes")
    where = placement(root)
    barrier_ms = _latency(lambda: barrier("doctor"))
    agree_ms = _latency(lambda: agree(1.0, "max", name="doctor"))

    seconds, written = None, None
    with together("doctor: bandwidth", what=f"doctor: save to {root}"):
        if where.writer:
            state = {"probe": torch.zeros(megabytes * (1 << 20) // 4)}
            name = f".ranksafe-doctor-{topology.rank()}.pt"
            if remote.is_url(root):
                written = remote.Remote.of(root).child(name)
            path = os.path.join(make_dirs(root), name) if written is None else written.url
            start = time.perf_counter()
            atomic_save(state, path)
            seconds = time.perf_counter() - start
            if written is None:
                os.unlink(path)
    if remote.is_url(root):  # every rank must reach the object rank 0 wrote (memory:// lives in one process)
        check_every_rank_sees(remote.Remote.of(root), written)  # and it is removed
    speeds = all_gather(None if seconds is None else megabytes / seconds, name="doctor: bandwidth")

    if not topology.is_main():
        return 0
    world, n_nodes = len(ranks), len(set(nodes))
    print(f"ranksafe doctor: {world} process(es) on {n_nodes} node(s); process group: {topology.is_distributed()}")
    for r, node in zip(ranks, nodes, strict=True):
        print(f"  rank {r['rank']:>3}  node {node}  local rank {r['local']}  host {r['host']}")
    writers = [r for r, s in enumerate(speeds) if s is not None]
    print(f"\n{root}: {where.kind}")
    if remote.is_url(root):
        verdict = "remote storage: every rank reaches the same objects; global rank 0 writes"
    elif world == 1:
        verdict = "one process: nothing to compare it with; run under the launcher, as training does"
    elif where.kind is StorageKind.SHARED:
        verdict = "every rank sees the same files: global rank 0 writes (writer='main', storage='shared')"
    elif where.kind is StorageKind.LOCAL:
        verdict = (
            "each node has its own copy: the local rank 0 of every node writes (writer='local', storage='local'); "
            "a file written by rank 0 alone would be missing on the other nodes"
        )
    else:
        verdict = "some nodes share this directory, others do not: one writer per group of nodes (storage='auto')"
    print(f"  verdict: {verdict}")
    print(f"  writers: ranks {writers}")
    print("\nlatency (median of 20):")
    print(f"  barrier {barrier_ms:.2f} ms, agree {agree_ms:.2f} ms")
    print(f"\natomic, fsynced save of {megabytes} MiB to {root}:")
    for r in writers:
        print(f"  rank {r}: {speeds[r]:.0f} MiB/s")
    return 0
