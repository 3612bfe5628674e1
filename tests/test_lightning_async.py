"""Background saves in Lightning (``RankSafeCheckpointIO(async_save=True)``) and RankSafe's CheckpointManager.

One process: the snapshot holds the values of save time, removals wait for the commit (and are dropped when
it fails), loads wait for the write, against stock ``AsyncCheckpointIO`` on the same Trainer scenario.
Real ``Trainer(strategy="ddp", devices=2)`` runs (tests/lightning_scripts/ddp_async.py, three in all): a
background failure raised on both ranks within one step with the previous checkpoint kept, and
``RankSafe(checkpoint_dir=..., keep=2)`` retention and resume from the agreed latest step.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import pickle
import shutil
import signal
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import AsyncCheckpointIO, TorchCheckpointIO

import ranksafe
from ranksafe.lightning import RankSafe, RankSafeCheckpointIO
from ranksafe.lightning.steps import TrainerSteps
from ranksafe.lock import StateDictLock
from tests.ranks import run_ranks
from tests.test_lightning_ddp import finish, start

SCRIPT = Path(__file__).parent / "lightning_scripts" / "ddp_async.py"


class GatedIO(RankSafeCheckpointIO):
    """Background writes wait for ``gate``; ``fail`` makes them raise; commits and deletions are logged."""

    def __init__(self) -> None:
        super().__init__(async_save=True)
        self.gate = threading.Event()
        self.fail = False
        self.log: list[tuple[str, str]] = []

    def _write(self, checkpoint, path, **kw):
        assert self.gate.wait(30)
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        super()._write(checkpoint, path, **kw)
        self.log.append(("commit", Path(path).name))

    def _remove(self, path):
        self.log.append(("delete", Path(path).name))
        super()._remove(path)


class GatedTorchIO(TorchCheckpointIO):
    """Stock TorchCheckpointIO with the same gate and fault, to run under stock ``AsyncCheckpointIO``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.fail = False

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        assert self.gate.wait(30)
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        super().save_checkpoint(checkpoint, path, storage_options)


def _state(w: torch.Tensor) -> dict:
    return {"state_dict": {"w": w}, "optimizer_states": [{"state": {0: {"momentum": w * 2}}}], "epoch": 0}


def test_file_holds_the_values_at_save_time_while_training_mutates_them(tmp_path):
    io, w = GatedIO(), torch.arange(4.0)
    state = _state(w)
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()  # save_checkpoint returned before the write
    w.add_(100)  # the optimizer step that follows the save
    state["epoch"] = 5
    io.gate.set()
    io.wait()
    loaded = io.load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(4.0)) and loaded["epoch"] == 0
    assert torch.equal(loaded["optimizer_states"][0]["state"][0]["momentum"], torch.arange(4.0) * 2)
    assert ranksafe.verify_file(tmp_path / "a.ckpt") is True
    allocations = io.saver.staging.allocations
    io.save_checkpoint(_state(w), tmp_path / "b.ckpt")  # same structure: the staging buffers are reused
    io.teardown()
    assert io.saver.staging.allocations == allocations == 1
    assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["state_dict"]["w"], torch.arange(4.0) + 100)

    # control: writing the live dict in the background (no snapshot) stores the mutated values
    live, gate = _state(torch.arange(4.0)), threading.Event()
    naive = threading.Thread(target=lambda: gate.wait(30) and torch.save(live, tmp_path / "naive.ckpt"))
    naive.start()
    live["state_dict"]["w"].add_(100)
    gate.set()
    naive.join()
    assert torch.equal(torch.load(tmp_path / "naive.ckpt")["state_dict"]["w"], torch.arange(4.0) + 100)


def test_removal_waits_for_the_commit_and_is_dropped_when_the_save_fails(tmp_path):
    a, b, c, d = (tmp_path / f"{n}.ckpt" for n in "abcd")
    io = GatedIO()
    io.gate.set()
    io.save_checkpoint(_state(torch.zeros(2)), a)
    io.wait()
    io.gate.clear()
    io.save_checkpoint(_state(torch.ones(2)), b)
    io.remove_checkpoint(a)  # what ModelCheckpoint(save_top_k=1) does right after submitting b
    assert a.exists() and not b.exists()
    io.gate.set()
    io.wait()
    assert io.log == [("commit", "a.ckpt"), ("commit", "b.ckpt"), ("delete", "a.ckpt")]
    assert not a.exists() and b.exists()

    io.gate.clear()
    io.fail = True
    io.save_checkpoint(_state(torch.ones(2)), c)
    io.remove_checkpoint(b)
    io.gate.set()
    io.wait()
    assert b.exists() and not c.exists() and len(io.log) == 3  # the failed save's removal was dropped
    with pytest.raises(OSError, match="No space left"):
        io.check()  # one process: the original error, unchanged
    io.check()  # reported once
    io.fail = False
    io.save_checkpoint(_state(torch.ones(2)), d)
    io.wait()
    io.remove_checkpoint(b)  # nothing in flight: removed at once
    assert not b.exists() and d.exists()
    io.teardown()

    # control: stock AsyncCheckpointIO deletes the old file when the new save is submitted; the save fails
    # and no checkpoint is left
    stock_dir = tmp_path / "stock"
    base = GatedTorchIO()
    stock = AsyncCheckpointIO(base)
    base.gate.set()
    stock.save_checkpoint(_state(torch.zeros(2)), stock_dir / "a.ckpt")
    stock.teardown()  # its only way to wait
    base.gate.clear()
    base.fail = True
    stock.save_checkpoint(_state(torch.ones(2)), stock_dir / "b.ckpt")
    stock.remove_checkpoint(stock_dir / "a.ckpt")
    assert not (stock_dir / "a.ckpt").exists()  # gone while b is still in flight
    base.gate.set()
    with pytest.raises(OSError, match="No space left"):
        stock.teardown()
    assert os.listdir(stock_dir) == []


def test_load_and_teardown_wait_for_the_write_in_flight(tmp_path):
    path = tmp_path / "p.ckpt"
    io = GatedIO()
    io.save_checkpoint(_state(torch.full((3,), 7.0)), path)
    threading.Timer(0.3, io.gate.set).start()
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.full((3,), 7.0))  # not FileNotFoundError

    io.gate.clear()
    io.save_checkpoint(_state(torch.full((3,), 8.0)), path)
    threading.Timer(0.3, io.gate.set).start()
    io.teardown()
    assert not [t for t in threading.enumerate() if t.name == "ranksafe-async-save"]
    assert torch.load(path, weights_only=True)["state_dict"]["w"][0] == 8.0

    # after teardown (ddp_spawn's final hand-over, a save after fit) saves are synchronous
    io.gate.clear()
    threading.Timer(0.3, io.gate.set).start()
    io.save_checkpoint(_state(torch.full((3,), 9.0)), tmp_path / "after.ckpt")
    assert (tmp_path / "after.ckpt").exists()

    # without RankSafe to report it, a background failure is raised at teardown, as stock does
    orphan = GatedIO()
    orphan.gate.set()
    orphan.fail = True
    orphan.save_checkpoint(_state(torch.ones(1)), tmp_path / "x.ckpt")
    with pytest.raises(OSError, match="No space left"):
        orphan.teardown()
    orphan.check()  # reported once

    # ddp_spawn pickles the plugin with the Trainer: no thread or lock travels
    plain = RankSafeCheckpointIO(async_save=True)
    plain.save_checkpoint(_state(torch.ones(1)), tmp_path / "y.ckpt")
    clone = pickle.loads(pickle.dumps(plain))
    plain.teardown()
    assert clone.async_save and clone._saver is None and clone._lock is None
    callback = pickle.loads(pickle.dumps(RankSafe(checkpoint_dir=tmp_path / "managed", keep=2, async_save=True)))
    assert callback.manager.async_save and callback.manager.keep == 2 and callback.manager._saver.lock is callback.lock


class Model(pl.LightningModule):
    def __init__(self, step_time: float = 0.15) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.step_time = step_time

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_time)  # a step longer than a write: the stock control's timeline is deterministic
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StepProbe(pl.Callback):
    raised_at = None

    def on_exception(self, trainer, pl_module, exception):
        self.raised_at = trainer.global_step


class SlowFull:
    """The 2nd write takes 0.1 s; from the 3rd one on the disk is full. ``on_disk``: the files at each deletion."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.writes, self.on_disk = directory, 0, []
        self.fault_step: int | None = None
        self.trainer: pl.Trainer | None = None

    def write(self) -> None:
        self.writes += 1
        if self.writes >= 3:
            self.fault_step = self.fault_step or self.trainer.global_step  # where training is when it fails
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        time.sleep(0.1 if self.writes == 2 else 0)

    def deleting(self) -> None:
        self.on_disk.append(sorted(os.listdir(self.directory)))


def _fit_failing(tmp_path: Path, stock: bool) -> tuple[StepProbe, SlowFull, BaseException]:
    """12 steps, ModelCheckpoint(save_top_k=1) every 3; the write of step 9 and all later ones fail."""
    disk = SlowFull(tmp_path)

    class Ours(RankSafeCheckpointIO):
        def _write(self, checkpoint, path, **kw):
            disk.write()
            super()._write(checkpoint, path, **kw)

        def _remove(self, path):
            disk.deleting()
            super()._remove(path)

    class Stock(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            disk.write()
            super().save_checkpoint(checkpoint, path, storage_options)

        def remove_checkpoint(self, path):
            disk.deleting()
            super().remove_checkpoint(path)

    probe = StepProbe()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=1, every_n_train_steps=3)
    disk.trainer = trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[checkpoint, probe, RankSafe()],
        plugins=[AsyncCheckpointIO(Stock()) if stock else Ours(async_save=True)],
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g))
    with pytest.raises(OSError, match="No space left") as caught:
        trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=4))
    return probe, disk, caught.value


@pytest.fixture
def signal_handlers_put_back():
    """The stock control's failed fit leaves Lightning's SIGTERM handler installed: stock ``AsyncCheckpointIO``
    raises its write failure again from ``teardown``, which ``Trainer._teardown`` calls before its signal connector
    puts back the handlers of before the fit. Left there, it reaches the tests that run next in this process (an
    in-process preemption test found it on SIGTERM). Stock Lightning's, not ranksafe's: put back here."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield before
    for s, handler in before.items():
        signal.signal(s, handler)


def test_one_process_trainer_against_stock_async_checkpoint_io(tmp_path, signal_handlers_put_back):
    probe, disk, _ = _fit_failing(tmp_path / "ours", stock=False)
    # under RankSafe the plugin's teardown does not raise the failure again (RankSafe raised it at a step's end), so
    # Lightning's teardown goes on to put back the signal handlers; the stock control's, below, does not
    assert {s: signal.getsignal(s) for s in signal_handlers_put_back} == signal_handlers_put_back
    assert disk.fault_step >= 9 and probe.raised_at - disk.fault_step <= 1  # within one step
    assert disk.on_disk == [["step=3.ckpt", "step=6.ckpt"]]  # step 3 deleted once step 6 was on disk
    assert os.listdir(tmp_path / "ours") == ["step=6.ckpt"]  # the failed save did not cost the previous one
    assert torch.load(tmp_path / "ours" / "step=6.ckpt", weights_only=True)["global_step"] == 6

    probe, disk, _ = _fit_failing(tmp_path / "stock", stock=True)
    assert disk.fault_step >= 9 and probe.raised_at == 12  # learnt at the next save
    assert disk.on_disk[0] == ["step=3.ckpt"]  # step 3 deleted while step 6 was still being written
    assert os.listdir(tmp_path / "stock") == []  # ... and after the failure nothing is left


def test_ddp_background_failure_raised_on_both_ranks_at_the_same_step(tmp_path):
    # 12 steps; ModelCheckpoint(save_top_k=1) every 3 steps; writes take 0.5 s; from the 3rd (step 9) on they fail
    run = finish(start(tmp_path, "--async-save", "--slow-write", "0.5", "--fail-write", "3", "--every-n-steps", "3",
                       script=SCRIPT))  # fmt: skip
    assert not run.hung
    fault = run.fault_time()
    fault_step = json.loads((tmp_path / "fault.json").read_text())["step"]
    r0, r1 = run.rank(0), run.rank(1)
    for r, result in enumerate((r0, r1)):
        assert "RankFailure" in result["error_type"] and "OSError" in result["error_type"], (r, result["error"])
        assert "step=9.ckpt" in result["error"] and "No space left on device (injected)" in result["error"]
        # the write fails while step fault_step + 1 trains; its end notices it, the end of the next raises it
        assert result["raised_step"] - fault_step <= 2, (r, result["raised_step"], fault_step)
        assert result["t_raised"] - fault < 5
        # the optimizer step holds the write side of the plugin's lock: a snapshot thread waits for it
        assert result["reader_blocked"] == [True, True] and result["reader_free"] == [True, True]
    events = [e for e in r0["events"] if e["kind"] != "fault"]  # the fault races the removal request
    kinds = [(e["kind"], Path(e["path"]).name) for e in events]
    assert kinds == [
        ("commit", "step=3.ckpt"),
        ("remove requested", "step=3.ckpt"),
        ("commit", "step=6.ckpt"),
        ("delete", "step=3.ckpt"),
        ("remove requested", "step=6.ckpt"),
    ], kinds  # no delete of step 6: its successor failed
    assert events[1]["on_disk"] == ["step=3.ckpt"] and events[3]["on_disk"] == ["step=3.ckpt", "step=6.ckpt"]
    assert events[2]["live"] > 6 and events[2]["thread"] == "ranksafe-async-save"  # training ran ahead
    assert r0["names"] == ["step=6.ckpt"]  # the previous checkpoint survives, no temporaries
    saved = r0["files"]["step=6.ckpt"]
    assert saved["verified"] and saved["global_step"] == 6
    assert saved["weights"] == saved["weights_at_step"] != saved["weights_next_step"]  # step 6's, not later


def test_ddp_checkpoint_manager_keeps_two_steps_and_resumes_from_the_latest(tmp_path):
    # 3 epochs of 12 steps, RankSafe(checkpoint_dir, keep=2, async_save=True), and background ModelCheckpoint
    # saves at the same time
    common = ("--async-save", "--slow-write", "0.3", "--every-n-steps", "12", "--manager-keep", "2", "--manager-async")
    first = finish(start(tmp_path, *common, "--epochs", "3", script=SCRIPT))
    assert not first.hung and first.proc.returncode == 0, first.output[-4000:]
    for result in (first.rank(0), first.rank(1)):
        assert result["error"] is None and result["global_step"] == 36
        assert result["managed"] == [[24, "committed"], [36, "committed"]]  # exactly keep=2 committed steps
        assert result["writer_threads"] == []  # teardown waited for the last background write
    last = first.rank(0)["files"]["step=36.ckpt"]  # in flight when training ended, committed by teardown
    assert last["verified"] and last["weights"] == last["weights_at_step"]
    state = torch.load(tmp_path / "managed" / "step_00000036" / "state.pt", weights_only=True)
    assert state["global_step"] == 36 and state["optimizer_states"] and state["loops"]
    ranksafe.verify_step(tmp_path / "managed" / "step_00000036")

    resumed = finish(start(tmp_path, *common, "--epochs", "4", "--resume", script=SCRIPT))
    assert not resumed.hung and resumed.proc.returncode == 0, resumed.output[-4000:]
    for result in (resumed.rank(0), resumed.rank(1)):
        assert result["error"] is None
        assert result["ckpt_path"] == str(tmp_path / "managed" / "step_00000036" / "state.pt")
        assert result["start_step"] == 36 and result["global_step"] == 48
        assert result["managed"] == [[36, "committed"], [48, "committed"]]


class BatchCount(pl.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args):
        self.batches += 1


def _fit_managed(root: Path, epochs: int, **rank_safe) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[BatchCount(), RankSafe(checkpoint_dir=root, **rank_safe)],
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    trainer.fit(Model(step_time=0), torch.utils.data.DataLoader(data, batch_size=4))
    return trainer


def test_one_process_resume_from_the_manager_verifies_the_step(tmp_path):
    root = tmp_path / "managed"
    first = _fit_managed(root, 2, keep=1, async_save=True)  # 4 steps an epoch
    assert [(s.step, s.status) for s in ranksafe.list_steps(root)] == [(8, "committed")]
    assert first.callbacks[0].batches == 8
    resumed = _fit_managed(root, 3, keep=1, resume=True)
    assert resumed.ckpt_path == str(root / "step_00000008" / "state.pt") and resumed.global_step == 12
    assert resumed.callbacks[0].batches == 4  # only the third epoch ran
    assert [s.step for s in ranksafe.list_steps(root)] == [12]
    state = root / "step_00000012" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(ranksafe.CorruptCheckpoint, match="step_00000012"):  # checked against the manifest
        _fit_managed(root, 4, keep=1, resume=True)


def test_a_resume_falls_back_over_a_damaged_newest_step_and_saves_over_it(tmp_path):
    """Before: ``resume=True`` loaded the newest step without a fallback: a damaged one failed the fit, and a
    requeued job failed the same way at every start. Now it resumes from the newest step that verifies, with a
    warning; when there is none older, the damage is raised (the test above)."""
    root = tmp_path / "managed"
    _fit_managed(root, 2, keep=None)  # steps 4 and 8
    state = root / "step_00000008" / "state.pt"
    with open(state, "r+b") as f:
        f.truncate(state.stat().st_size - 100)
    with pytest.warns(RuntimeWarning, match="falling back to step 4"):
        resumed = _fit_managed(root, 3, keep=None, resume=True)
    assert resumed.global_step == 12 and resumed.callbacks[0].batches == 8  # the second and third epochs ran
    assert [s.step for s in ranksafe.list_steps(root)] == [4, 8, 12]
    assert ranksafe.verify_step(root / "step_00000008")["step"] == 8  # saved again, whole


def _teardown_reports_once(rank: int, root: str) -> dict:
    import contextlib
    import io

    from ranksafe.async_save import _wait_at_exit

    class Failing(RankSafeCheckpointIO):
        def _write(self, checkpoint, path, **kw):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    plugin = Failing(async_save=True)  # no RankSafe callback: teardown is where the failure surfaces
    if rank == 0:  # Lightning calls the plugin on global rank 0 only
        plugin.save_checkpoint({"w": torch.ones(2)}, os.path.join(root, "a.ckpt"))
    out = {}
    try:
        plugin.teardown()
        out["teardown"] = "no error"
    except OSError as e:
        out["teardown"] = type(e).__name__
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        _wait_at_exit()
    out["exit_hook"] = printed.getvalue()
    return out


def test_a_failure_raised_by_teardown_is_not_reported_again_at_exit(tmp_path):
    r0, r1 = run_ranks(_teardown_reports_once, 2, args=(str(tmp_path),), timeout=90).values
    assert r0["teardown"] == "OSError" and r1["teardown"] == "no error"
    assert r0["exit_hook"] == "" == r1["exit_hook"]  # was: the same failure printed a second time at exit


class SlowIO(RankSafeCheckpointIO):
    """Each background write takes longer than a training step."""

    def _write(self, checkpoint, path, **kw):
        time.sleep(0.3)
        super()._write(checkpoint, path, **kw)


class LoggedModel(Model):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def test_a_file_still_being_written_counts_as_existing_when_model_checkpoint_picks_a_name(tmp_path):
    """ModelCheckpoint with a fixed filename names each new save ``ckpt-vN`` when the name is taken; a save in
    flight must take it too, or the next save reuses its name and overwrites it."""
    versions = ModelCheckpoint(
        dirpath=tmp_path, filename="ckpt", monitor="train_loss", save_top_k=-1, every_n_train_steps=1
    )
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[RankSafe(), versions], plugins=[SlowIO(async_save=True)],
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
    trainer.fit(LoggedModel(step_time=0), torch.utils.data.DataLoader(data, batch_size=4))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt-v1.ckpt", "ckpt-v2.ckpt", "ckpt-v3.ckpt", "ckpt-v4.ckpt", "ckpt-v5.ckpt", "ckpt.ckpt"]
    assert len(versions.best_k_models) == 6  # was: 3 files, each written twice over


class ThirdWriteFails(RankSafeCheckpointIO):
    """The third background write fails (a full disk); the first two commit."""

    def __init__(self) -> None:
        super().__init__(async_save=True)
        self.writes = 0

    def _write(self, checkpoint, path, **kw):
        self.writes += 1
        if self.writes == 3:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        super()._write(checkpoint, path, **kw)


@pytest.mark.parametrize("save_last", [True, "link"])
def test_last_checkpoint_never_runs_ahead_of_a_failed_background_write(tmp_path, save_last):
    """ModelCheckpoint saves a top-k file, then last.ckpt, in the same step. When the top-k write fails in the
    background, last.ckpt must stay the previous one: not a file claiming a top-k file that never came
    (save_last=True), not a link to it (save_last="link", whose directory did not exist at the first link)."""
    directory = tmp_path / "ckpts"  # created by the first save
    checkpoint = ModelCheckpoint(
        dirpath=directory, filename="{step}", every_n_train_steps=1, save_top_k=1, save_last=save_last
    )
    trainer = pl.Trainer(
        max_steps=6, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[RankSafe(), checkpoint], plugins=[ThirdWriteFails()],
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g))
    with pytest.raises(OSError, match="No space left"):
        trainer.fit(Model(step_time=0), torch.utils.data.DataLoader(data, batch_size=4))
    last = torch.load(directory / "last.ckpt", weights_only=True)  # there, and whole
    saved = next(v for k, v in last["callbacks"].items() if "ModelCheckpoint" in k)
    named = Path(saved["best_model_path"]).name
    assert (directory / named).exists()  # the file it names is on disk ...
    assert named == f"step={last['global_step']}.ckpt"  # ... and is the one of its own step
    assert "step=3.ckpt" not in os.listdir(directory)


def test_inside_lightnings_async_wrapper_the_plugin_is_torn_down_after_fit(tmp_path):
    """Lightning's AsyncCheckpointIO does not pass teardown on to the plugin it wraps: RankSafe does."""
    inner = RankSafeCheckpointIO(async_save=True)
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[AsyncCheckpointIO(inner)],
        callbacks=[RankSafe(), ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)],
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    trainer.fit(Model(step_time=0), torch.utils.data.DataLoader(data, batch_size=4))
    assert [t.name for t in threading.enumerate() if t.name.startswith("ranksafe")] == []
    assert inner._torn_down  # a later trainer.save_checkpoint is synchronous: nothing would wait for it


class FallingLoss(Model):
    """val_loss falls at every epoch: ModelCheckpoint's best file moves at every epoch end."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", 1.0 / (self.current_epoch + 1))


def _fit_tracked(root: Path, epochs: int, resume: bool) -> tuple[pl.Trainer, ModelCheckpoint]:
    best = ModelCheckpoint(dirpath=root / "best", monitor="val_loss", save_top_k=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[best, RankSafe(checkpoint_dir=root / "managed", keep=1, resume=resume)],
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer.fit(FallingLoss(step_time=0), loader, loader)
    return trainer, best


def test_a_step_holds_the_model_checkpoint_state_of_its_epoch_and_a_resume_tracks_every_file(tmp_path):
    """Before: the step was saved before ModelCheckpoint's epoch end, with its state of the epoch before; resumed
    from it, ModelCheckpoint(save_top_k=1) never knew the last best file, which stayed on disk beside the new one."""
    _, best = _fit_tracked(tmp_path, 3, resume=False)  # 4 steps an epoch
    state = ranksafe.load_file(tmp_path / "managed" / "step_00000012" / "state.pt", weights_only=False)
    assert best.best_model_path.endswith("epoch=2-step=12.ckpt")
    assert state["callbacks"][best.state_key]["best_model_path"] == best.best_model_path
    resumed, best = _fit_tracked(tmp_path, 5, resume=True)
    assert resumed.global_step == 20 and sorted(os.listdir(tmp_path / "best")) == ["epoch=4-step=20.ckpt"]


def test_a_ranksafe_given_to_a_second_fresh_fit_saves_that_fits_steps(tmp_path):
    """Before: the step number the first fit saved last (4) stayed marked as saved, and the second fit, into the
    emptied directory, skipped its save of step 4 without a word."""
    root = tmp_path / "managed"
    rank_safe = RankSafe(checkpoint_dir=root, keep=None)
    for _ in range(2):
        shutil.rmtree(root, ignore_errors=True)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, callbacks=[rank_safe],
        )  # fmt: skip
        trainer.fit(Model(step_time=0), _tiny_loader())
        assert [s.step for s in ranksafe.list_steps(root)] == [4]


class EpochCount(pl.LightningModule):
    """Counts its epochs in a buffer, in its own ``on_train_epoch_end``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.register_buffer("epochs", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_train_epoch_end(self) -> None:
        self.epochs += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_epochs_step_holds_what_the_module_did_at_the_epochs_end(tmp_path):
    """Without a monitoring callback, the epoch's step was saved before the module's ``on_train_epoch_end`` (Lightning
    runs the callbacks' first): the step of epoch 2 held 1 epoch counted, and the resumed run ended one short of an
    uninterrupted one. The wrapper on the module goes at the fit's end."""
    root = tmp_path / "managed"

    def fit(epochs: int, **options) -> EpochCount:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False,
            callbacks=[RankSafe(checkpoint_dir=root, keep=None, **options)],
        )  # fmt: skip
        model = EpochCount()
        trainer.fit(model, _tiny_loader())
        assert "on_train_epoch_end" not in vars(model)
        return model

    fit(2)
    saved = torch.load(root / "step_00000008" / "state.pt", weights_only=True)
    assert saved["state_dict"]["epochs"].item() == 2
    assert fit(4, resume=True).epochs.item() == 4


def test_a_copy_of_the_module_taken_during_the_fit_saves_nothing_for_that_fit(tmp_path):
    """The module's ``on_train_epoch_end`` is wrapped during a fit without monitoring callbacks. Before, a copy of the
    module taken then (an EMA's, a pickle) kept the wrapper and a copy of RankSafe, and each epoch a Trainer later
    trained the copy for ended saved a step into the first run's directory (here: refused, step 4 under step 8)."""
    root = tmp_path / "managed"
    copies: list[pl.LightningModule] = []

    class CopyAtStart(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            copies.append(copy.deepcopy(pl_module))

    def trainer(*callbacks: pl.Callback) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, callbacks=list(callbacks),
        )  # fmt: skip

    trainer(CopyAtStart(), RankSafe(checkpoint_dir=root, keep=None)).fit(EpochCount(), _tiny_loader())
    trainer().fit(copies[0], _tiny_loader())
    assert [s.step for s in ranksafe.list_steps(root)] == [4, 8]
    assert copies[0].epochs.item() == 2  # its own hook still ran


def test_a_hook_set_on_the_module_instance_runs_before_the_epochs_step(tmp_path):
    """Before: the wrapper took the Trainer from the hook it wraps (``original.__self__``), which a function set on
    the instance does not have: the fit failed at the first epoch's end."""
    root = tmp_path / "managed"
    model, seen = Model(step_time=0), []
    model.on_train_epoch_end = lambda: seen.append(model.trainer.current_epoch)
    pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[RankSafe(checkpoint_dir=root, keep=None)],
    ).fit(model, _tiny_loader())  # fmt: skip
    assert seen == [0, 1] and [s.step for s in ranksafe.list_steps(root)] == [4, 8]
    assert isinstance(vars(model)["on_train_epoch_end"], type(lambda: None))  # the user's, put back


class ManualSteps(Model):
    """Manual optimization with the raw optimizer: ``trainer.global_step`` stays 0 however much it trains."""

    def __init__(self) -> None:
        super().__init__(step_time=0)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers(use_pl_optimizer=False)
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()


def test_a_later_fit_under_manual_optimization_goes_on_from_memory_with_resume(tmp_path):
    """Before: ``global_step == 0`` said that the Trainer had not trained, and the second fit reloaded the newest step
    (the first fit's end) over the progress in memory, training its epoch again."""
    count = BatchCount()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[count, RankSafe(checkpoint_dir=tmp_path / "managed", keep=None, every_n_epochs=2, resume=True)],
    )  # fmt: skip
    model = ManualSteps()
    trainer.fit(model, _tiny_loader())
    for epochs in (3, 4):
        trainer.fit_loop.max_epochs = epochs
        trainer.fit(model, _tiny_loader())
        assert trainer.ckpt_path is None
    assert trainer.global_step == 0 and count.batches == 16  # every epoch once


def test_a_resume_falls_back_over_a_newest_step_whose_state_is_missing(tmp_path):
    """Before: a step without ``state.pt`` was taken for a step of sharded state, and its load into the model failed
    on the older step it fell back to ("holds no sharded state")."""
    root = tmp_path / "managed"
    _fit_managed(root, 2, keep=None)  # steps 4 and 8
    (root / "step_00000008" / "state.pt").unlink()
    with pytest.warns(RuntimeWarning, match=r"step_00000008/state.pt: missing.*falling back to step 4"):
        resumed = _fit_managed(root, 3, keep=None, resume=True)
    assert resumed.global_step == 12 and resumed.callbacks[0].batches == 8


def test_a_later_fit_of_the_same_trainer_goes_on_from_memory_with_resume(tmp_path):
    """Before: ``resume=True`` loaded the newest step (6) into a Trainer that had trained to step 8, and two steps of
    training were lost without a word; without RankSafe, a second fit goes on from where the first ended."""
    root = tmp_path / "managed"
    count = BatchCount()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[count, RankSafe(checkpoint_dir=root, keep=None, every_n_epochs=None, every_n_train_steps=3,
                                   resume=True)],
    )  # fmt: skip
    model = Model(step_time=0)
    trainer.fit(model, _tiny_loader())
    assert trainer.global_step == 8 and [s.step for s in ranksafe.list_steps(root)] == [3, 6]
    trainer.fit_loop.max_epochs = 3
    trainer.fit(model, _tiny_loader())
    assert trainer.ckpt_path is None and trainer.global_step == 12 and count.batches == 12


def _tiny_loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def test_a_step_named_after_a_resume_that_failed_loads_as_named(tmp_path):
    """The resume's fallback is for the load it chose: once the resume is over (here it failed before loading), a
    load of the same step, named by the user, verifies that step and raises, as any named load does."""
    root = tmp_path / "managed"
    _fit_managed(root, 2, keep=None)  # steps 4 and 8
    state = root / "step_00000008" / "state.pt"
    with open(state, "r+b") as f:
        f.truncate(state.stat().st_size - 100)
    steps = TrainerSteps(StateDictLock(), None, root=root, keep=None)
    with pytest.raises(OSError, match="injected"), steps.resuming() as path:
        assert path == str(state)
        raise OSError("injected: a failure between the resume's choice and its load")
    with pytest.raises(ranksafe.CorruptCheckpoint, match="step_00000008"):
        steps.load(None, 8, str(state), weights_only=True)
