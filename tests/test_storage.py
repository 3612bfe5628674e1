"""Storage topology on real ranks: one probe tells shared from node-local directories, and who writes.

Several "nodes" run on this one machine. Each simulated node gets its own mount namespace in which the
same path (``base/root``) is a bind mount of that node's own directory (``base/node<N>-disk``), so the
same path reaches a different disk per node, as on a cluster. Where mount namespaces are not permitted,
each node falls back to its own root directory (a different path per node).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import tempfile

import pytest
import torch

from ranksafe import collectives, storage
from ranksafe import exchange as protocol
from ranksafe.checkpoint import CheckpointManager
from tests.ranks import run_ranks

_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x00020000, 0x1000, 0x4000, 0x40000


def _bind_in_own_namespace(disk: str, root: str) -> bool:
    """Give this thread a private mount namespace in which ``root`` shows ``disk``; False if not permitted.

    Only the calling (main) thread moves to the new namespace: ranksafe's file calls all run on it.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    return (
        libc.unshare(_CLONE_NEWNS) == 0
        and libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) == 0
        and libc.mount(disk.encode(), root.encode(), None, _MS_BIND, None) == 0
    )


def as_node(rank: int, per_node: int, base: str, shared: bool = False) -> str:
    """Make this rank local rank ``rank % per_node`` of node ``rank // per_node``; return the root to use.

    ``shared``: every node sees the same ``base/root``. Otherwise ``base/root`` is node-local (see module doc).
    """
    node, local = divmod(rank, per_node)
    os.environ.update(GROUP_RANK=str(node), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per_node))
    root = os.path.join(base, "root")
    os.makedirs(root, exist_ok=True)
    if shared:
        return root
    disk = os.path.join(base, f"node{node}-disk")
    os.makedirs(disk, exist_ok=True)
    return root if _bind_in_own_namespace(disk, root) else disk


def node_disk(base, node: int) -> str:
    """What node ``node`` sees as its root, seen from the test process."""
    return os.path.join(base, f"node{node}-disk")


def _detect(rank, base, per_node, shared):
    root = as_node(rank, per_node, base, shared)
    kind = storage.detect(root)
    seq = protocol._session.seq
    again = storage.placement(root)
    cached = protocol._session.seq - seq
    collectives.barrier("probe done everywhere")
    return {
        "kind": kind,
        "writer": again.writer,
        "group": sorted(again.group) if again.group is not None else None,
        "cached_exchanges": cached,
        "root": root,
        "leftovers": sorted(os.listdir(root)),
    }


def test_a_shared_root_is_detected_as_shared_with_one_writer(tmp_path):
    values = run_ranks(_detect, 4, args=(str(tmp_path), 2, True)).values
    assert [v["kind"] for v in values] == ["shared"] * 4
    assert [v["writer"] for v in values] == [True, False, False, False]  # global main only
    assert all(v["cached_exchanges"] == 0 for v in values)  # cached per directory
    assert all(v["leftovers"] == [] for v in values)  # the probe's tokens are removed


def test_separate_node_roots_are_detected_as_local_with_a_writer_per_node(tmp_path):
    values = run_ranks(_detect, 4, args=(str(tmp_path), 2, False)).values
    assert [v["kind"] for v in values] == ["local"] * 4
    assert [v["writer"] for v in values] == [True, False, True, False]  # each node's local main
    assert [v["group"] for v in values] == [[0], [0], [1], [1]]
    assert all(v["cached_exchanges"] == 0 for v in values)
    assert os.listdir(node_disk(tmp_path, 0)) == [] and os.listdir(node_disk(tmp_path, 1)) == []


def _mixed(rank, base):
    # nodes 0 and 1 share one disk, node 2 has its own
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0")
    root = os.path.join(base, "root")
    os.makedirs(root, exist_ok=True)
    if rank == 2:
        disk = os.path.join(base, "node2-disk")
        os.makedirs(disk, exist_ok=True)
        root = root if _bind_in_own_namespace(disk, root) else disk
    where = storage.placement(root)
    return where.kind, where.writer, sorted(where.group)


def test_nodes_sharing_a_disk_get_one_writer_per_disk(tmp_path):
    values = run_ranks(_mixed, 3, args=(str(tmp_path),)).values
    assert values == [("mixed", True, [0, 1]), ("mixed", False, [0, 1]), ("mixed", True, [2])]


def _explicit(rank, base):
    root = as_node(rank, 2, base, shared=True)
    collectives.barrier("warm")
    seq = protocol._session.seq
    local = storage.placement(root, "local")
    shared = storage.placement(root, "shared")
    return local.kind, local.writer, shared.kind, shared.writer, protocol._session.seq - seq


def test_explicit_storage_overrides_the_probe_without_collectives(tmp_path):
    values = run_ranks(_explicit, 4, args=(str(tmp_path),)).values
    assert [v[:4] for v in values] == [
        ("local", True, "shared", True),
        ("local", False, "shared", False),
        ("local", True, "shared", False),
        ("local", False, "shared", False),
    ]
    assert all(v[4] == 0 for v in values)


def test_unknown_storage_is_rejected():
    with pytest.raises(ValueError, match=re.escape("Storage takes 'auto', 'shared', 'local', not 'nfs'")):
        storage.placement("/tmp", "nfs")


_MS_RDONLY, _MS_REMOUNT = 0x1, 0x20


def _read_only(root: str, own_namespace: bool) -> str:
    """Make ``root`` read-only for this process (a bind mount remounted read-only, which holds for root too), in
    its own mount namespace unless it has one already; where mounts are not permitted, refuse the probe's token
    as a read-only file system would. Returns which of the two it did."""
    libc = ctypes.CDLL(None, use_errno=True)
    mounted = (
        (own_namespace or libc.unshare(_CLONE_NEWNS) == 0)
        and (own_namespace or libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) == 0)
        and libc.mount(root.encode(), root.encode(), None, _MS_BIND, None) == 0
        and libc.mount(b"none", root.encode(), None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY, None) == 0
    )
    if mounted:
        return "mount"
    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):
        if storage.PROBE_PREFIX in os.fspath(path) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *args, **kwargs)

    os.open = read_only_open
    return "patched"


def _save_per_node(rank, base, shared):
    """Step 4 saved by two nodes of one rank each: each node's writer writes its own rank's state."""
    root = as_node(rank, 1, base, shared)
    mgr = CheckpointManager(root, storage="shared" if shared else "local")
    mgr.save(4, {"w": torch.tensor([4.0, float(rank)])})


def _load_read_only(rank, base, shared):
    root = as_node(rank, 2, base, shared)
    how = _read_only(root, own_namespace=not shared and root == os.path.join(base, "root"))  # as_node's
    mgr = CheckpointManager(root)
    state = mgr.load()
    where = mgr.placement
    try:
        open(os.path.join(root, "x"), "w").close()
        writable = True
    except OSError:
        writable = False
    return {"how": how, "step": mgr.loaded_step, "w": state["w"].tolist(), "kind": where.kind, "writer": where.writer,
            "writable": writable}  # fmt: skip


@pytest.mark.parametrize("shared", [True, False])
def test_checkpoints_on_a_read_only_root_load_with_the_default_probe(tmp_path, shared):
    """Fine-tuning from checkpoints on a read-only mount: the probe could not write its token, and every rank
    failed with EROFS unless storage= was given. Where no node can write, the copies' listings decide."""
    run_ranks(_save_per_node, 2, args=(str(tmp_path), shared), timeout=120).check()  # one save, a copy per node
    values = run_ranks(_load_read_only, 4, args=(str(tmp_path), shared), timeout=120).values
    assert [v["step"] for v in values] == [4] * 4
    assert [v["w"] for v in values] == [[4.0, 0.0]] * 4 if shared else [[4.0, 0.0]] * 2 + [[4.0, 1.0]] * 2
    assert [v["kind"] for v in values] == ["shared" if shared else "local"] * 4
    assert [v["writer"] for v in values] == ([True, False, False, False] if shared else [True, False, True, False])
    if values[0]["how"] == "mount":
        assert not any(v["writable"] for v in values)  # the mount was read-only indeed


def _own_directory(rank, base):
    try:
        storage.placement(os.path.join(base, f"run-{rank}"))  # a path made per rank: a timestamp, a rank number
        return "placed"
    except RuntimeError as e:
        return str(e)


def test_ranks_given_different_directories_are_told_so_naming_their_own():
    with tempfile.TemporaryDirectory() as base:
        for rank, said in enumerate(run_ranks(_own_directory, 2, args=(base,)).values):
            assert said.startswith(f"{base}/run-{rank} (rank {rank}): "), said
            assert "were the ranks given different directories?" in said, said
