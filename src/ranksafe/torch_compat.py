"""The private names of torch that the ranksafe core uses: each one here, once, with why no public API does.

``tests/test_torch_compat.py`` fails, naming it, when a torch release renames or removes one of them.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

DEFAULT_STORE = "_get_default_store"
"""``torch.distributed.distributed_c10d._get_default_store()``: the key-value store of the default process group,
which every launcher sets up (torchrun's agent store, ``init_method``'s). ranksafe's exchanges run over it (named
timeouts, name checks, one outcome for every rank: :mod:`ranksafe.exchange`); torch offers no public way to reach
the store of a group made by ``init_process_group``."""


def default_store() -> dist.Store:
    """The default process group's store (see :data:`DEFAULT_STORE`)."""
    return getattr(dist.distributed_c10d, DEFAULT_STORE)()


DCP_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *((module, kind) for module in ("pathlib", "pathlib._local") for kind in ("PosixPath", "WindowsPath")),
})  # fmt: skip
"""The globals ``torch.distributed.checkpoint`` pickles into a checkpoint's ``.metadata`` (besides torch's dtypes), some
of them private: a weights-only load of sharded state lets that file name these and nothing else
(:mod:`ranksafe.shards`), as DCP itself reads it with ``pickle.load``, where any global runs."""


SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor"
"""The package of ``ShardedTensor``, the sharded tensor of FSDP1's sharded state dicts (what
``torch.distributed.checkpoint.state_dict.get_state_dict`` gives for an FSDP1 model). torch keeps it in a private
package only; ranksafe must recognise one, since one writer would save its own shards of it and drop the other
ranks'."""


def sharded_tensor_type() -> type | None:
    """``ShardedTensor``, once something has imported its package (no state holds one before); else None."""
    return getattr(sys.modules.get(SHARDED_TENSOR), "ShardedTensor", None)
