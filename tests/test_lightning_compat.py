"""The Lightning methods RankSafe wraps, and the private names it reads (ranksafe/lightning/compat.py), exist with
the parameters it passes on: a Lightning release that renames, removes or changes one fails here, naming it."""

from __future__ import annotations

import inspect

import lightning
import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy

from ranksafe.lightning import compat

_STRATEGIES = (Strategy, DDPStrategy, SingleDeviceStrategy)
WRAPPED = [  # (class, method, the parameters RankSafe's replacement takes)
    *((cls, "save_checkpoint", ["self", "checkpoint", "filepath", "storage_options"]) for cls in _STRATEGIES),
    *((cls, "remove_checkpoint", ["self", "filepath"]) for cls in _STRATEGIES),
    *((cls, "load_checkpoint", ["self", "checkpoint_path", "weights_only"]) for cls in _STRATEGIES),
    *((cls, "optimizer_step", ["self", "optimizer", "closure", "model", "kwargs"]) for cls in _STRATEGIES),
    (ModelCheckpoint, compat.LINK_CHECKPOINT, ["trainer", "filepath", "linkpath"]),  # a staticmethod
    (ModelCheckpoint, compat.MONITOR_CANDIDATES, ["self", "trainer"]),
    (ModelCheckpoint, "file_exists", ["self", "filepath", "trainer"]),
    (ModelCheckpoint, "on_train_epoch_end", ["self", "trainer", "pl_module"]),
    (EarlyStopping, compat.STOPPING_CRITERIA, ["self", "current"]),
    (EarlyStopping, "on_train_epoch_end", ["self", "trainer", "pl_module"]),
]


def _parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls, name, parameters", WRAPPED, ids=[f"{c.__name__}.{n}" for c, n, _ in WRAPPED])
def test_each_method_ranksafe_wraps_is_there_with_its_parameters(cls, name, parameters):
    where = f"Lightning {lightning.__version__}: {cls.__name__}.{name}"
    assert hasattr(cls, name), f"{where} is gone; ranksafe/lightning/compat.py must follow it"
    assert _parameters(getattr(cls, name)) == parameters, f"{where} now takes {_parameters(getattr(cls, name))}"
    if name == compat.LINK_CHECKPOINT:
        assert isinstance(inspect.getattr_static(cls, name), staticmethod), f"{where} is no longer a staticmethod"


def test_the_trainer_has_the_checkpoint_connector_ranksafe_calls():
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    where = f"Lightning {lightning.__version__}: Trainer.{compat.CHECKPOINT_CONNECTOR}"
    assert hasattr(trainer, compat.CHECKPOINT_CONNECTOR), f"{where} is gone; ranksafe/lightning/compat.py must follow"
    connector = compat.checkpoint_connector(trainer)
    for name, parameters in (
        ("resume_start", ["checkpoint_path", "weights_only"]),
        ("dump_checkpoint", ["weights_only"]),
    ):
        assert hasattr(connector, name), f"{where}.{name} is gone"
        assert _parameters(getattr(connector, name)) == parameters, f"{where}.{name} now takes other parameters"
