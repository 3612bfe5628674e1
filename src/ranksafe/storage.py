"""Is a directory shared by every rank, or local to each node? And so: which ranks write there.

On storage every rank shares (NFS, Lustre, one machine's disk), one writer (global rank 0) is enough; on
node-local disks every node needs its own copy, written by its local main. Guessing wrong breaks jobs in
both directions: rank 0 alone writing to a local disk leaves the other nodes without the file; every node
writing to shared storage races on the same names.

The answer comes from one probe per directory, cached: each node's local main (and nobody else) writes a
token file with a random name, every rank lists the directory and reports which nodes' tokens it sees, and
the reports are agreed. Because *every* local main writes, the probe is correct on both kinds of storage:
on node-local disks each node sees exactly its own token, on shared storage every node sees all of them.
A mix (some nodes share a disk, others do not) is recognised too: each group of nodes that share a disk
gets one writer, the local main of its lowest node.

Remote storage (a URL) is shared by definition, but only if every rank reaches the same store: the warmup of a
root there checks it (:func:`check_every_rank_sees`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from dataclasses import dataclass

from . import remote, topology
from .checkpoint_file import probe_write
from .choice import Choice
from .collectives import broadcast, exchange_outcome, together
from .commit import Place, name_of, open_for_commit
from .errors import Failure, naming_target, rank_failure
from .exchange import learn_nodes
from .files import local_path, make_dirs
from .remote import Remote


class Storage(Choice):
    """What a user says of a directory: probe it (``auto``), or it is ``shared`` by every rank, or ``local``."""

    AUTO = "auto"
    SHARED = "shared"
    LOCAL = "local"


class StorageKind(Choice):
    """What a directory is found to be: ``shared`` by every rank, ``local`` to each node, or ``mixed`` (some nodes
    share a disk, others do not)."""

    SHARED = "shared"
    LOCAL = "local"
    MIXED = "mixed"


PROBE_PREFIX = ".ranksafe-probe-"


@dataclass(frozen=True)
class Placement:
    """Where a directory lives, from this rank's point of view.

    ``kind``: see :class:`StorageKind`.
    ``writer``: this rank writes the full copy that the nodes of its ``group`` read, and commits it.
    ``group``: the nodes that read the files this rank's node sees; ``None`` means every node.
    """

    kind: StorageKind
    writer: bool
    group: frozenset[int] | None


_cache: dict[tuple[str, int | None], Placement] = {}


def _group_key() -> int | None:
    import torch.distributed as dist

    return id(dist.group.WORLD) if topology.is_distributed() else None


def placement(
    directory: str | os.PathLike, storage: Storage | str = Storage.AUTO, timeout: float | None = None
) -> Placement:
    """Decide who writes ``directory``; collective the first time for ``storage="auto"``, cached after.

    ``shared`` and ``local`` skip the probe (no file-system call): use them when you know (``local`` learns the
    nodes from the ranks' host names first, a collective once per group where no launcher variable says them). A
    URL of remote storage is one store that every rank reaches: global rank 0 writes, and ``local`` is refused.
    """
    storage = Storage(storage)
    if remote.is_url(directory):
        if storage is Storage.LOCAL:
            raise ValueError(f"{remote.where(directory)}: remote storage is shared by every rank, not storage='local'")
        storage = Storage.SHARED
    if storage is Storage.SHARED:
        return Placement(StorageKind.SHARED, topology.is_main(), None)
    if storage is Storage.LOCAL:
        learn_nodes(timeout, f"storage of {directory}")
        return Placement(StorageKind.LOCAL, topology.is_local_main(), frozenset({topology.node_rank()}))
    if topology.world_size() == 1:
        return Placement(StorageKind.SHARED, True, None)
    key = (os.path.abspath(local_path(directory)), _group_key())
    if key not in _cache:
        _cache[key] = _from_groups(probe(directory, timeout), key[0])
    return _cache[key]


def detect(directory: str | os.PathLike, timeout: float | None = None) -> StorageKind:
    """What ``directory`` is found to be; collective on first call, cached after."""
    return placement(directory, Storage.AUTO, timeout).kind


def probe(directory: str | os.PathLike, timeout: float | None = None) -> dict[int, frozenset[int]]:
    """For every node, the nodes whose token its ranks all see in ``directory``; collective, uncached.

    Two exchanges. Only local mains touch the file system to write (create the directory, write and
    then remove their token); every rank lists the directory once. Where no local main can write (a read-only
    mount, to load from), the listings are compared instead (:func:`_compare_listings`).
    """
    directory = os.path.abspath(local_path(directory))
    what = f"storage probe {directory}"
    learn_nodes(timeout, what)
    node = topology.node_rank()
    path, token, error, read_only = _write_token(directory, node) if topology.is_local_main() else (None,) * 4
    try:
        posted = exchange_outcome("storage probe: tokens", (node, token, read_only), error, list, timeout, what=what)
        mains = [ro is not None for _, t, ro in posted if t is not None or ro is not None]
        if mains and all(mains):  # no node can write here: tell the copies apart by what they hold
            return _compare_listings(directory, timeout)
        if any(mains):  # some nodes can write here and others cannot
            raise rank_failure(what, [ro for _, _, ro in posted if ro is not None])
        tokens = {n: t for n, t, _ in posted if t is not None}
        headless = sorted({n for n, _, _ in posted} - tokens.keys())
        if headless:
            raise ValueError(f"node(s) {headless} have no local rank 0 to write for them; check LOCAL_RANK")
        visible, error = _tokens_seen(directory, tokens)
        seen = exchange_outcome("storage probe: seen", (node, visible), error, list, timeout, what=what)
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
    groups: dict[int, frozenset[int]] = {}
    for n, vis in seen:
        groups[n] = groups.get(n, vis) & vis
    return groups


def _write_token(directory: str, node: int) -> tuple[str | None, str | None, OSError | None, Failure | None]:
    """A local main's token in ``directory``: its path and random name, or the error that prevented it (a read-only
    mount is not a failure yet, as loading from one is fine: it comes back as a :class:`Failure` to compare)."""
    try:
        make_dirs(directory)
        token = secrets.token_hex(8)
        path = os.path.join(directory, f"{PROBE_PREFIX}{node}-{token}")
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return path, token, None, None
    except OSError as e:
        if e.errno in _READ_ONLY:
            return None, None, None, Failure.from_exception(topology.rank(), e)
        return None, None, e, None


def _tokens_seen(directory: str, tokens: dict[int, str]) -> tuple[frozenset[int], OSError | None]:
    """The nodes whose token this rank sees in ``directory`` (none where its copy does not exist), or the error."""
    try:
        names = set(os.listdir(directory))
    except FileNotFoundError:
        return frozenset(), None
    except OSError as e:
        return frozenset(), e
    return frozenset(n for n, t in tokens.items() if f"{PROBE_PREFIX}{n}-{t}" in names), None


_READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})  # no token can be written here, by anyone


def _listing(directory: str) -> tuple | None:
    """What tells one copy of a directory from another without writing to it: its inode and every entry's name,
    inode and size (on shared storage every node reads the server's numbers; on separate disks they differ)."""
    try:
        with os.scandir(directory) as entries:
            held = sorted((e.name, e.inode(), e.stat(follow_symlinks=False).st_size) for e in entries)
        return os.stat(directory).st_ino, tuple(held)
    except FileNotFoundError:
        return None


def _compare_listings(directory: str, timeout: float | None) -> dict[int, frozenset[int]]:
    """:func:`probe` where no node can write a token (a read-only mount of checkpoints to load): nodes whose
    listings of ``directory`` are the same share a copy, as far as reading goes. One exchange."""
    error, mine = None, None
    try:
        mine = _listing(directory)
    except OSError as e:
        error = e
    what = f"storage probe {directory}"
    posted = exchange_outcome("storage probe: listings", (topology.node_rank(), mine), error, list, timeout, what=what)
    groups: dict[int, frozenset[int]] = {}
    for n, listing in posted:
        same = frozenset(m for m, other in posted if other == listing)
        groups[n] = groups.get(n, same) & same
    return groups


def _from_groups(groups: dict[int, frozenset[int]], directory: str) -> Placement:
    """This rank's placement from every node's visible group (the same on every rank); ``directory`` for messages."""
    nodes = frozenset(groups)
    here = f"{directory} (rank {topology.rank()})"
    for n, group in groups.items():
        if n not in group:
            raise RuntimeError(
                f"{here}: a rank of node {n} does not see the probe file its local main wrote here: were the ranks "
                "given different directories?"
            )
        if any(groups[m] != group for m in group):
            raise RuntimeError(
                f"{here}: nodes {sorted(group)} do not see each other's files symmetrically (lagging or partial "
                "mounts?); pass storage='shared' or storage='local' explicitly"
            )
    node = topology.node_rank()
    if all(g == nodes for g in groups.values()):
        return Placement(StorageKind.SHARED, topology.is_main(), None)
    kind = StorageKind.LOCAL if all(len(g) == 1 for g in groups.values()) else StorageKind.MIXED
    mine = groups[node]
    return Placement(kind, topology.is_local_main() and node == min(mine), mine)


def probe_root(base: Place, needs: int = 0) -> Remote | None:
    """Whether a root of checkpoints can be written (an ``OSError`` names it). Locally, a small checkpoint written
    and removed, and ``needs`` bytes free (``ENOSPC`` otherwise); on remote storage, one object uploaded as a
    checkpoint is and left there for :func:`check_every_rank_sees`, which removes it (returned). Local: the writer's
    part of a warmup (unlike :func:`probe`, it asks whether the root can be written, not who shares it)."""
    root = name_of(base)
    with naming_target("cannot write checkpoints to", root):
        if not isinstance(base, Remote):
            probe_write(root, needs=needs)
            return None
        probe = base.child(f"{PROBE_PREFIX}{os.getpid()}")
        with open_for_commit(probe) as f:
            f.write(b"probe")
        return probe


def check_every_rank_sees(base: Remote, probe: Remote | None, timeout: float | None = None) -> None:
    """Every rank looks for the object the writer left at ``base`` (``probe``, on the writer): remote storage must be
    the same for every rank (``memory://`` is not). Collective."""
    name = broadcast(None if probe is None else probe.name, name="checkpoint warmup: probe")
    try:
        with together(f"checkpoint {base.url}: warmup, seen by every rank", timeout):
            if not base.child(name).exists():
                raise FileNotFoundError(
                    f"{remote.where(base.url)} does not see what rank 0 wrote there: remote storage must be"
                    " the same for every rank (memory:// lives in one process)"
                )
    finally:  # once every rank looked; a probe left behind harms nothing, so its removal fails no rank
        if probe is not None:
            with contextlib.suppress(OSError):
                probe.remove()
