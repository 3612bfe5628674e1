"""Collective save, load and directory preparation: the three calls most training scripts need.

Each is called by every rank. One writer acts, the outcome is shared, and every rank returns or raises
the same way, so no rank can run ahead into a collective the others never reach.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Hashable
from typing import Any

from . import remote, topology
from .checkpoint_file import load_file, save_file
from .choice import Choice
from .collectives import barrier, together
from .errors import naming_target
from .exchange import learn_nodes
from .files import local_path, make_dirs
from .sharded import refuse_sharded


class Writer(Choice):
    """Which ranks write: ``main``, global rank 0 (storage every rank shares); ``local``, local rank 0 of each node
    (node-local disks); ``all``, every rank (per-rank files, such as sharded state)."""

    MAIN = "main"
    LOCAL = "local"
    ALL = "all"


def is_writer(writer: Writer | str = Writer.MAIN) -> bool:
    """Whether this rank writes under the ``writer`` policy. For ``local``, every rank of a process group started
    without launcher variables (``mp.spawn``) must call it the first time: the nodes are learned from each rank's
    host name (:func:`~ranksafe.exchange.learn_nodes`)."""
    writer = Writer(writer)
    if writer is Writer.MAIN:
        return topology.is_main()
    if writer is Writer.ALL:
        return True
    learn_nodes()
    return topology.is_local_main()


StorageOptions = dict[str, Any] | None


def _checked(path: str | os.PathLike, storage_options: StorageOptions, file: bool = True) -> tuple[str, bool]:
    """``(path or URL, is a URL)``, the URL resolved once on every rank: one without a file system, or a ``file``'s
    ending in ``/``, raises here, on every rank, before any collective."""
    if remote.is_url(path):
        return remote.file_url(path, storage_options) if file else remote.Remote.of(path, storage_options).url, True
    return local_path(path), False


def save(
    obj: Any,
    path: str | os.PathLike,
    writer: Writer | str = Writer.MAIN,
    storage_options: StorageOptions = None,
    **torch_save_kwargs: Any,
) -> str:
    """Save ``obj`` to ``path`` from the writer rank(s), atomically; collective.

    The writer creates the parent directory and commits the file atomically; non-writers touch no file.
    A failed write raises :class:`RankFailure` on every rank (also an instance of the original error type
    when it is a built-in one, e.g. ``PermissionError``). Returns the path on every rank. Every rank passes the
    path its writer writes (with ``local``, the path of its node's writer); one that passes another path would
    get back a path where no file is, so every rank raises ``ValueError`` instead. ``path`` may be a URL
    of remote storage (``s3://``, ``gs://``...; ``storage_options`` for its fsspec file system), written in one
    upload that appears whole or not at all. Sharded tensors (a ``DTensor`` sharded across ranks) need
    ``writer="all"`` and a path per rank: one writer would keep its own shards only, so every rank raises
    ``ValueError`` instead.
    """
    path, _ = _checked(path, storage_options)
    writer = Writer(writer)
    # the outcome's exchange carries each rank's path: a rank whose writer wrote elsewhere must not return its path
    with together("save", what=f"save {path}", reduce=paths_apart) as outcome:
        if writer is not Writer.ALL:
            refuse_sharded(obj, f"save {path}")
        if is_writer(writer):  # with "local", the nodes are known from here on
            save_file(obj, path, storage_options=storage_options, **torch_save_kwargs)
        outcome.value = (writer_group(writer), (path,))
    refuse_paths_apart(writer, outcome.result, "save")
    return path


def writer_group(writer: Writer) -> Hashable:
    """What this rank's writer writes for under ``writer``: the job (``main``), this rank's node (``local``), or this
    rank alone (``all``). Collective the first time with ``local``, as :func:`is_writer` is."""
    if writer is Writer.LOCAL:
        learn_nodes()
    return {Writer.MAIN: None, Writer.LOCAL: topology.node_rank(), Writer.ALL: topology.rank()}[writer]


def paths_apart(posts: list[tuple[Hashable, Collection[str]]]) -> list[str]:
    """``posts``: each rank's group (the ranks one writer writes for) and the paths it passed. The paths a rank
    passed that the first rank of its group (its writer) did not, described: paths where that writer writes nothing."""
    first: dict[Hashable, tuple[int, Collection[str]]] = {}
    apart = []
    for rank, (group, paths) in enumerate(posts):
        writer, written = first.setdefault(group, (rank, paths))
        if missing := sorted(set(paths) - set(written)):
            had = ", ".join(sorted(written)) or "none"
            apart.append(f"rank {rank} has {', '.join(missing)} where rank {writer} has {had}")
    return apart


def refuse_paths_apart(writer: Writer, apart: list[str], what: str) -> None:
    """Raise ``ValueError`` naming ``apart`` (from :func:`paths_apart`) unless it is empty: those ranks were given a
    path where their writer writes nothing. ``what`` names the call (``save``, a saver's name). One message for
    :func:`save` and :func:`~ranksafe.saver_failures.check_savers`: the slip and its remedy are the same."""
    if apart:
        raise ValueError(
            f"{what}: with writer={writer.value!r} one rank writes for the "
            f"{'job' if writer is Writer.MAIN else 'node'}, but ranks saved to paths their writer did not "
            f"({'; '.join(apart)}): no file is there. Pass every rank the writer's path, or writer='all' for a "
            "file per rank"
        )


def load(
    path: str | os.PathLike,
    map_location: Any = "cpu",
    weights_only: bool | None = True,
    verify: bool = True,
    storage_options: StorageOptions = None,
    **kw: Any,
) -> Any:
    """Load ``path`` on every rank once every rank has arrived; collective.

    The barrier inside means no rank reads before the writer committed (the writer reaches ``load``
    only after its save returned). A missing, truncated or corrupt file raises the same error on every
    rank (``FileNotFoundError``, :class:`CorruptCheckpoint`, ...), naming the path and the ranks, even
    when only some ranks could not read it. ``weights_only``, ``verify`` and the rest as
    :func:`~ranksafe.load_file`: ``None`` leaves the choice to ``torch.load``; ``verify=False`` skips the
    footer's checksum. ``path`` may be a URL of remote storage.
    """
    path, _ = _checked(path, storage_options)
    barrier("load", what=f"load {path}")
    result = None
    with together("load", what=f"load {path}"), naming_target("cannot load", path):
        result = load_file(path, map_location, weights_only, verify=verify, storage_options=storage_options, **kw)
    return result


def prepare_dir(
    path: str | os.PathLike,
    overwrite: bool = False,
    writer: Writer | str = Writer.MAIN,
    storage_options: StorageOptions = None,
) -> str:
    """Create ``path`` for a run's outputs without races; collective.

    Only the writer looks at the directory (once: on NFS other ranks' caches can disagree), removes it when
    ``overwrite`` is set, and creates it. A non-empty directory without ``overwrite`` raises
    ``FileExistsError`` on every rank. All ranks return together, after the directory exists. On remote storage
    (a URL) "non-empty" means any object under the prefix.
    """
    path, url = _checked(path, storage_options, file=False)
    with together("prepare_dir", what=f"prepare_dir {path}"):
        if is_writer(writer):
            if url:
                _prepare_remote(remote.Remote.of(path, storage_options), overwrite)
                return path
            if os.path.isdir(path) and os.listdir(path):
                if not overwrite:
                    raise FileExistsError(
                        f"{remote.where(path)} exists and is not empty; pass overwrite=True to replace it"
                    )
                shutil.rmtree(path)
            elif os.path.exists(path) and not os.path.isdir(path):
                raise NotADirectoryError(f"{remote.where(path)} exists and is not a directory")
            make_dirs(path)
    return path


def _prepare_remote(target: remote.Remote, overwrite: bool) -> None:
    if target.names():
        if not overwrite:
            raise FileExistsError(f"{remote.where(target.url)} is not empty; pass overwrite=True to replace it")
        target.remove()
    target.fs.makedirs(target.path, exist_ok=True)
