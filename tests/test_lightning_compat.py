"""The Lightning methods RankSafe wraps, and the private names it reads (ranksafe/lightning/compat.py), exist with
the parameters it passes on, and the SLURM requeue it takes over still runs the command ranksafe runs in its place: a
Lightning release that renames, removes or changes one fails here, naming it."""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning
import lightning.pytorch as pl
import pytest
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from ranksafe.lightning import compat
from tests.private_names import private_reads_outside_compat

_STRATEGIES = (Strategy, DDPStrategy, SingleDeviceStrategy)
_OWN_LOADERS = (FSDPStrategy, ModelParallelStrategy)
WRAPPED = [  # (class, method, the parameters RankSafe's replacement takes)
    *((cls, "save_checkpoint", ["self", "checkpoint", "filepath", "storage_options"]) for cls in _STRATEGIES),
    *((cls, "remove_checkpoint", ["self", "filepath"]) for cls in _STRATEGIES),
    # FSDP's and ModelParallel's own load_checkpoint reads a step's state.pt (steps.TrainerSteps.load)
    *((cls, "load_checkpoint", ["self", "checkpoint_path", "weights_only"]) for cls in _STRATEGIES + _OWN_LOADERS),
    *((cls, "optimizer_step", ["self", "optimizer", "closure", "model", "kwargs"]) for cls in _STRATEGIES),
    (ModelCheckpoint, compat.LINK_CHECKPOINT, ["trainer", "filepath", "linkpath"]),  # a staticmethod
    (ModelCheckpoint, compat.MONITOR_CANDIDATES, ["self", "trainer"]),
    (ModelCheckpoint, "file_exists", ["self", "filepath", "trainer"]),
    (ModelCheckpoint, "on_train_epoch_end", ["self", "trainer", "pl_module"]),
    (ModelCheckpoint, "on_train_batch_end", ["self", "trainer", "pl_module", "outputs", "batch", "batch_idx"]),
    (ModelCheckpoint, "on_validation_end", ["self", "trainer", "pl_module"]),
    (EarlyStopping, compat.CONDITION_METRIC, ["self", "logs"]),
    (EarlyStopping, compat.STOPPING_CRITERIA, ["self", "current"]),
    (EarlyStopping, "on_train_epoch_end", ["self", "trainer", "pl_module"]),
    (EarlyStopping, "on_train_batch_end", ["self", "trainer", "pl_module", "outputs", "batch", "batch_idx"]),
    (EarlyStopping, "on_validation_end", ["self", "trainer", "pl_module"]),
    (pl.LightningModule, "on_train_epoch_end", ["self"]),
    (_SignalConnector, "register_signal_handlers", ["self"]),
    (_TrainingEpochLoop, compat.VALIDATION_DUE, ["self", "data_fetcher"]),
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


def test_the_trainer_has_the_signal_connector_and_cluster_environment_ranksafe_reads():
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    for name in (compat.SIGNAL_CONNECTOR, compat.ACCELERATOR_CONNECTOR):
        where = f"Lightning {lightning.__version__}: Trainer.{name}"
        assert hasattr(trainer, name), f"{where} is gone; ranksafe/lightning/compat.py must follow it"
    assert isinstance(compat.signal_connector(trainer), _SignalConnector)
    where = f"Lightning {lightning.__version__}: Trainer.{compat.ACCELERATOR_CONNECTOR}.cluster_environment"
    assert isinstance(compat.cluster_environment(trainer), ClusterEnvironment), f"{where} is gone"


def test_the_trainer_has_the_training_epoch_loop_ranksafe_wraps():
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    where = f"Lightning {lightning.__version__}: Trainer.fit_loop.epoch_loop"
    assert isinstance(compat.epoch_loop(trainer), _TrainingEpochLoop), f"{where} is gone or of another class"
    assert compat.trained_batches(trainer) == 0, f"{where}.batch_progress.total.completed is gone"


def test_lightnings_slurm_handler_still_requeues_with_the_command_ranksafe_runs_in_its_place():
    """RankSafe(preemption=True) replaces Lightning's SLURM requeue handler and runs its command: if the handler's
    command changes, ranksafe/preemption.py must follow it."""
    source = inspect.getsource(_SignalConnector._slurm_sigusr_handler_fn)
    where = f"Lightning {lightning.__version__}: _SignalConnector._slurm_sigusr_handler_fn"
    assert '["scontrol", "requeue", job_id]' in source, f"{where} no longer runs scontrol requeue <job id>"
    for variable in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_ID"):
        assert variable in source, f"{where} no longer reads {variable}"
    assert "self.trainer.is_global_zero" in source, f"{where} no longer requeues from rank 0 only"


def test_no_other_module_names_a_private_attribute_of_lightning():
    """Only compat.py reaches a private name of Lightning: every other module of the package reads a private
    attribute only from ``self`` or as a function the package defines itself, and imports no private name (the
    walk's control is in ``tests/test_fastai_compat.py``)."""
    assert private_reads_outside_compat(Path(compat.__file__).parent) == {}
