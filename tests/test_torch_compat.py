"""The private names of torch that the ranksafe core reaches (all in ranksafe/torch_compat.py) still exist: a torch
release that renames or removes one fails here, naming it."""

from __future__ import annotations

import torch.distributed as dist

from ranksafe import torch_compat


def test_the_default_store_getter_still_exists():
    getter = getattr(dist.distributed_c10d, torch_compat.DEFAULT_STORE, None)
    assert callable(getter), f"torch.distributed.distributed_c10d.{torch_compat.DEFAULT_STORE} is gone"


def test_it_returns_the_store_of_the_default_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        store = torch_compat.default_store()
        store.set("ranksafe-compat", b"1")
        assert isinstance(store, dist.Store) and store.get("ranksafe-compat") == b"1"
    finally:
        dist.destroy_process_group()


def test_every_global_a_checkpoint_index_may_name_still_exists():
    """What a weights-only load of sharded state lets DCP's .metadata name: a renamed one would refuse every index."""
    import importlib

    for module_name, name in sorted(torch_compat.DCP_METADATA_GLOBALS):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            assert module_name == "pathlib._local", module_name  # pathlib's classes live there from Python 3.13
            continue
        assert hasattr(module, name), f"{module_name}.{name} is gone"


def test_the_sharded_tensor_of_fsdp1_is_still_where_it_was():
    import importlib

    module = importlib.import_module(torch_compat.SHARDED_TENSOR)
    kind = getattr(module, "ShardedTensor", None)
    assert isinstance(kind, type), f"{torch_compat.SHARDED_TENSOR}.ShardedTensor is gone"
    assert torch_compat.sharded_tensor_type() is kind
