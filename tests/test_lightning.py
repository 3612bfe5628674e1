"""ranksafe.lightning in one process (stock behaviour and files, corrupt files refused, no collectives
without a process group) and MonitorAgreement on real ranks."""

from __future__ import annotations

import os
import re
import shutil
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import SingleDeviceStrategy

import ranksafe
from ranksafe.lightning import MonitorAgreement, RankSafe, RankSafeCheckpointIO, UnsyncedMetricWarning
from tests.ranks import run_ranks


class Model(pl.LightningModule):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


class _RestoredAfterSetup(SingleDeviceStrategy):
    """Restores the checkpoint after ``on_fit_start``, as FSDP, ModelParallelStrategy and DeepSpeed do."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


def _fit(
    root, ranksafe_on: bool, epochs: int = 3, ckpt_path=None, overwrite: bool = False, strategy="auto"
) -> pl.Trainer:
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(dirpath=root, monitor="val_loss", save_top_k=2, save_last=True)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
        callbacks=[checkpoint, RankSafe(overwrite=overwrite)] if ranksafe_on else [checkpoint],
        plugins=[RankSafeCheckpointIO()] if ranksafe_on else [],
    )  # fmt: skip
    trainer.fit(Model(), _loader(), _loader(), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    stock, ours = _fit(root / "stock", False), _fit(root / "ours", True)
    return root, stock, ours


def test_one_process_same_files_and_state_as_stock(runs):
    root, stock, ours = runs
    names = sorted(os.listdir(root / "stock"))
    assert names == sorted(os.listdir(root / "ours")) and "last.ckpt" in names and len(names) == 3
    best = stock.checkpoint_callback.best_model_path
    assert best.replace("stock", "ours") == ours.checkpoint_callback.best_model_path
    for name in names:
        a = torch.load(root / "stock" / name, weights_only=True)
        b = torch.load(root / "ours" / name, weights_only=True)  # stock torch.load reads ranksafe's files
        assert a.keys() == b.keys() and (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"])
        for key, tensor in a["state_dict"].items():
            assert torch.equal(tensor, b["state_dict"][key]), (name, key)
        assert ranksafe.verify_file(root / "ours" / name) is True  # ours carries the integrity footer
        assert ranksafe.verify_file(root / "stock" / name) is False  # stock's has none
    model = Model.load_from_checkpoint(root / "ours" / "last.ckpt")
    assert torch.equal(model.layer.weight, ours.lightning_module.layer.weight)


def test_corrupt_or_torn_checkpoint_refused_naming_the_file(runs, tmp_path):
    root, _, _ = runs
    data = (root / "ours" / "last.ckpt").read_bytes()
    torn, flipped = tmp_path / "torn.ckpt", tmp_path / "flipped.ckpt"
    torn.write_bytes(data[: len(data) // 2])
    offset = data.index(b"data/0") + 200  # inside the first tensor's bytes
    flipped.write_bytes(data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1 :])
    io = RankSafeCheckpointIO()
    for path in (torn, flipped):
        with pytest.raises(ranksafe.CorruptCheckpoint, match=re.escape(str(path))):
            io.load_checkpoint(path)
    # control: stock Lightning loads the bit-flipped file without a word, with wrong values
    assert TorchCheckpointIO().load_checkpoint(flipped)["state_dict"]
    # through the Trainer: refused before anything is restored
    with pytest.raises(ranksafe.CorruptCheckpoint, match=re.escape("flipped.ckpt")):
        _fit(tmp_path / "resume", True, ckpt_path=flipped)


def test_io_uses_no_collectives_without_a_process_group(tmp_path, monkeypatch):
    # a ddp_spawn parent, or a rank before init: the launcher says 2 processes, no process group exists
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match=re.escape("no torch.distributed process group")):
        ranksafe.barrier("control")  # a collective here would fail: the IO must not use any
    io = RankSafeCheckpointIO()
    path = tmp_path / "sub" / ".temp.ckpt"
    io.save_checkpoint({"weights": torch.arange(3)}, path)  # a bare dict, as the spawn launcher sends
    assert torch.equal(io.load_checkpoint(path)["weights"], torch.arange(3))
    io.remove_checkpoint(path)
    io.remove_checkpoint(path)  # missing: no error, as stock
    assert not path.exists()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, path, storage_options={"x": 1})
    # a path the plugin saves to, it removes, however it is spelled
    monkeypatch.setenv("HOME", str(tmp_path))
    for spelled in ("~/home.ckpt", f"file://{tmp_path}/url.ckpt"):
        io.save_checkpoint({"weights": torch.arange(3)}, spelled)
        io.remove_checkpoint(spelled)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub"]


class Opaque:
    """An object a weights-only load refuses."""


@pytest.mark.filterwarnings("ignore:Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
def test_weights_only_none_leaves_the_choice_to_torch_as_stock_lightning(tmp_path, monkeypatch):
    path = tmp_path / "opaque.ckpt"
    io = RankSafeCheckpointIO()
    io.save_checkpoint({"weights": torch.arange(3), "extra": Opaque()}, path)
    manager = ranksafe.CheckpointManager(tmp_path / "managed")
    manager.save(1, {"extra": Opaque()})
    with pytest.raises(ranksafe.UntrustedCheckpoint, match=re.escape(str(path))):
        io.load_checkpoint(path)  # torch's default: weights only
    # the user's opt-out through torch's own switch, which only decides where the caller left weights_only None
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert isinstance(TorchCheckpointIO().load_checkpoint(path)["extra"], Opaque)  # control: stock Lightning
    assert isinstance(io.load_checkpoint(path)["extra"], Opaque)
    assert isinstance(manager.load(weights_only=None)["extra"], Opaque)
    with pytest.raises(ranksafe.UntrustedCheckpoint):
        io.load_checkpoint(path, weights_only=True)  # an explicit choice stands
    with pytest.raises(ranksafe.UntrustedCheckpoint):
        manager.load()  # ranksafe's own default is an explicit True


def test_overwrite_empties_the_checkpoint_dir_unless_resuming(tmp_path):
    root = tmp_path / "ckpts"
    root.mkdir()
    (root / "stale.ckpt").write_bytes(b"old run")
    _fit(root, True, epochs=1)
    assert (root / "stale.ckpt").exists()  # default: left alone, as stock Lightning does
    _fit(root, True, epochs=1, overwrite=True)
    assert not (root / "stale.ckpt").exists() and (root / "last.ckpt").exists()
    (root / "stale.ckpt").write_bytes(b"old run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(root, True, epochs=2, overwrite=True, ckpt_path=root / "last.ckpt")
    assert trainer.global_step == 8 and (root / "stale.ckpt").exists()
    assert any("the run resumes" in str(w.message) for w in caught)
    # resumed from a checkpoint kept elsewhere (a manager's step): the restored state still names the files here
    elsewhere = tmp_path / "elsewhere.ckpt"
    shutil.copy(root / "last.ckpt", elsewhere)
    trainer = _fit(root, True, epochs=3, overwrite=True, ckpt_path=elsewhere)
    best = trainer.checkpoint_callback.best_model_path
    assert trainer.global_step == 12 and (root / "stale.ckpt").exists() and os.path.exists(best), best
    # a strategy that restores after on_fit_start: the directory is still kept (it held the file to resume from)
    strategy = _RestoredAfterSetup(device=torch.device("cpu"))
    trainer = _fit(root, True, epochs=4, overwrite=True, ckpt_path=root / "last.ckpt", strategy=strategy)
    assert trainer.global_step == 16 and (root / "stale.ckpt").exists()


def test_overwrite_keeps_what_an_earlier_fit_of_the_same_trainer_saved(tmp_path):
    """A second fit of one Trainer (a second stage) is the same run. Before: overwrite=True emptied the directory
    again, and best_model_path, still the first fit's best, named a deleted file (validate(ckpt_path="best")
    raised FileNotFoundError)."""
    root = tmp_path / "ckpts"
    checkpoint = ModelCheckpoint(dirpath=root, monitor="val_loss", save_top_k=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[checkpoint, RankSafe(overwrite=True)],
    )  # fmt: skip
    model = Model()
    trainer.fit(model, _loader(), _loader())
    best = checkpoint.best_model_path
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.0)  # the first fit's best stays
    trainer.fit_loop.max_epochs = 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader(), _loader())
    assert checkpoint.best_model_path == best and os.path.exists(best), os.listdir(root)
    assert any("an earlier fit of this Trainer saved there" in str(w.message) for w in caught)
    trainer.validate(model, _loader(), ckpt_path="best", verbose=False)


def _managed_fit(checkpoint_dir, epochs: int, ckpt_path=None) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False,
        callbacks=[RankSafe(checkpoint_dir=checkpoint_dir)],
    )  # fmt: skip
    trainer.fit(Model(), _loader(), _loader(), ckpt_path=ckpt_path)
    return trainer


def test_a_step_interval_that_ends_an_epoch_saves_that_step_once(tmp_path):
    """Four batches an epoch, every_n_train_steps=4 and every_n_epochs=1: both rules fall on steps 4 and 8. Before:
    each step was dumped and committed twice (the second commit replaced the first)."""
    callback = RankSafe(checkpoint_dir=tmp_path / "managed", keep=None, every_n_train_steps=4, every_n_epochs=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False, callbacks=[callback],
    )  # fmt: skip
    saved = []
    save = callback.manager.save
    callback.manager.save = lambda step, *args, **kwargs: saved.append(step) or save(step, *args, **kwargs)
    trainer.fit(Model(), _loader(), _loader())
    assert saved == [4, 8]
    assert [s.step for s in ranksafe.list_steps(tmp_path / "managed")] == [4, 8]


def test_a_home_relative_checkpoint_dir_is_expanded_and_a_step_directory_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    first = _managed_fit("~/managed", epochs=1)  # as ModelCheckpoint(dirpath="~/...") takes it
    assert os.listdir(tmp_path) == ["home"], "nothing in a folder named '~' under the working directory"
    (step,) = ranksafe.list_steps(tmp_path / "home" / "managed")
    assert step.step == first.global_step
    # the directory list_steps reports, given as ckpt_path (it holds state.pt: not a sharded step)
    again = _managed_fit("~/managed", epochs=2, ckpt_path=step.path)
    assert again.global_step == 2 * first.global_step


def _agree_metrics(rank, op):
    monitors = MonitorAgreement(op)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        differing = monitors.agree("val_loss", torch.tensor([1.0, 3.0][rank]))
        again = monitors.agree("val_loss", torch.tensor([1.0, 3.0][rank]))  # warned once per name
        synced = monitors.agree("acc", torch.tensor(0.5))
        missing = monitors.agree("val_f1", None if rank == 1 else torch.tensor(0.25))
    warned = [str(w.message) for w in caught if issubclass(w.category, UnsyncedMetricWarning)]
    return float(differing), float(again), float(synced), float(missing), warned


def test_monitor_agreement_on_real_ranks():
    for op, expected in (("mean", 2.0), ("main", 1.0)):
        values = run_ranks(_agree_metrics, 2, args=(op,)).values
        for differing, again, synced, missing, _ in values:
            assert (differing, again, synced, missing) == (expected, expected, 0.5, 0.25)
        warned = values[0][4]
        assert len(warned) == 2 and "'val_loss' differs across ranks" in warned[0] and "'val_f1'" in warned[1]
        assert values[1][4] == []  # warnings on rank 0 only


def _agree_all(rank, op):
    read = {
        "acc": torch.tensor([0.5, 0.7][rank]),  # per rank
        "epoch": torch.tensor(3, dtype=torch.int32),  # the same everywhere: kept as it is, dtype too
        "histogram": torch.tensor([1.0, 2.0]) * (rank + 1),  # not one number: left as each rank has it
        "flag": [True, False][rank],  # a bool is not a metric value
        **({"score": 10.0} if rank == 0 else {"debug": torch.tensor(1.0)}),  # on one rank only
    }
    read["loss"] = torch.tensor([1.0, 2.0][rank])  # not asked for: each rank's own, and no warning
    names = ["acc", "epoch", "histogram", "flag", "score", "debug"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        agreed = MonitorAgreement(op).agree_all(read, names, reader="ModelCheckpoint")
    assert not [w for w in caught if "'loss'" in str(w.message)]
    return {name: value.tolist() if isinstance(value, torch.Tensor) else value for name, value in agreed.items()}


def test_the_metrics_that_rank_or_name_a_checkpoint_are_agreed_in_one_exchange():
    for op, expected in (("mean", {"acc": 0.6, "score": 10.0, "debug": 1.0}), ("main", {"acc": 0.5, "score": 10.0})):
        ranks = run_ranks(_agree_all, 2, args=(op,)).values
        for rank, agreed in enumerate(ranks):
            # with op="main", "debug" (not logged on rank 0) is left out everywhere
            assert set(agreed) == {"epoch", "histogram", "flag", "loss", *expected}, (op, rank, agreed)
            assert {name: agreed[name] for name in expected} == pytest.approx(expected), (op, rank)
            assert agreed["epoch"] == 3 and agreed["histogram"] == [1.0 + rank, 2.0 + 2 * rank]
            assert agreed["flag"] is [True, False][rank] and agreed["loss"] == [1.0, 2.0][rank]


@pytest.mark.parametrize(
    "kwargs, said",
    [
        ({"async_save": True}, r"RankSafe\(async_save=...\) needs a checkpoint_dir"),
        ({"every_n_epochs": 2}, r"RankSafe\(every_n_epochs=...\) needs a checkpoint_dir"),
        ({"storage": "nfs"}, "Storage takes 'auto', 'shared', 'local', not 'nfs'"),
        ({"storage": "local"}, r"RankSafe\(storage=...\) needs a checkpoint_dir"),
        ({"storage_options": {"anon": True}}, r"RankSafe\(storage_options=...\) needs a checkpoint_dir"),
        ({"checkpoint_dir": ""}, "root must name a directory, not ''"),
    ],
    ids=["async_save", "every_n_epochs", "storage", "storage without a dir", "storage_options", "empty dir"],
)
def test_options_that_would_be_ignored_or_land_in_the_working_directory_are_refused(kwargs, said):
    with pytest.raises(ValueError, match=said):
        RankSafe(**kwargs)
