"""The private names of fastai and NumPy that ranksafe.fastai reaches (all in ranksafe/fastai/compat.py) still exist
and still do what ranksafe relies on. A failure here names the attribute an upstream release renamed or removed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("fastai")

import torch
from fastai.data.load import DataLoader
from fastai.distributed import DistributedDL

from ranksafe.fastai import compat
from tests.private_names import private_reads, private_reads_outside_compat
from tests.test_fastai import _learner

PACKAGE = Path(compat.__file__).parent


@pytest.mark.parametrize("dotted", sorted(compat.PRIVATE_NAMES))
def test_the_private_name_still_exists(dotted):
    owner, attribute = compat.PRIVATE_NAMES[dotted]
    assert hasattr(owner, attribute), f"{dotted} is gone: ranksafe/fastai/compat.py must follow the rename"


def test_distributed_loaders_share_their_sample_order_through_the_broadcast_compat_sets():
    calls = []

    def broadcast(t: list, rank: int) -> list:
        calls.append((list(t), rank))
        return list(reversed(t))  # what rank 0 would have sent

    dl = DistributedDL(DataLoader(list(range(8)), bs=4), rank=0, world_size=1)
    compat.set_broadcast(dl, broadcast)
    assert dl.get_idxs() == [7, 6, 5, 4, 3, 2, 1, 0]
    assert calls == [(list(range(8)), 0)], "DistributedDL.get_idxs no longer calls self._broadcast"


def test_end_cleanup_drops_the_last_batch_as_fastais_export_does(tmp_path):
    learn = _learner(tmp_path, False)
    learn.pred, learn.loss = torch.ones(2), torch.tensor(1.0)
    compat.end_cleanup(learn)
    assert learn.pred is None and learn.loss is None


def test_the_numpy_scalar_reconstructor_is_what_numpy_pickles_scalars_with():
    import numpy as np

    assert np.float32(1.5).__reduce__()[0] is compat.numpy_scalar()


def test_no_other_module_names_a_private_attribute_of_fastai_or_numpy():
    """Only compat.py reaches a private name: every other module of the package reads a private attribute only from
    ``self`` or as a function the package defines itself."""
    assert private_reads_outside_compat(PACKAGE) == {}


def test_the_check_above_sees_private_names():
    """The control: the same walk finds ``learn._end_cleanup`` and a private import, and not ``self._fit``."""
    tree = ast.parse(
        "from fastai.text.learner import _get_text_vocab\ndef f(self, learn):\n    learn._end_cleanup(self._fit)\n"
    )
    assert private_reads(tree, {"f"}) == ["1: from fastai.text.learner import _get_text_vocab", "3: learn._end_cleanup"]
