"""Preemption and agreed save schedules in Lightning: real signals, in one process."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint

import ranksafe
from ranksafe.lightning import RankSafe, compat
from ranksafe.lightning.preemption import requeue
from tests.lightning_scripts.resumable import ResumableLoader

JOB_ID = "4242"


def _fake_scontrol(out: Path) -> Path:
    """An ``scontrol`` for the launch writing to ``out``, to put first on PATH: it records its arguments, the rank that
    ran it and the steps committed under ``out/ckpt`` at that moment. Returns its directory."""
    bin_dir = out / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "scontrol"
    script.write_text(
        f"#!{sys.executable}\n"
        "import glob, json, os, sys\n"
        f"committed = sorted(glob.glob({str(out / 'ckpt')!r} + '/step_*/MANIFEST.json'))\n"
        "record = {'args': sys.argv[1:], 'rank': os.environ['SLURM_PROCID'], 'committed': committed}\n"
        f"with open({str(out / 'scontrol.log')!r}, 'a') as f:\n"
        "    f.write(json.dumps(record) + '\\n')\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def _requeues(out: Path) -> list[dict]:
    log = out / "scontrol.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# --- one process: the same decisions, no process group -----------------------------------------------------------


def _decay(step: int) -> float:
    return 0.97**step


class StepModel(pl.LightningModule):
    """Records the global step each training step starts from; its learning rate decays once per optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.trained: list[int] = []

    def training_step(self, batch, batch_idx):
        self.trained.append(self.global_step)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, _decay)}}


def _loader() -> ResumableLoader:  # 4 batches an epoch
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    return ResumableLoader(data, batch_size=4)


class SignalAt(pl.Callback):
    """Sends ``sig`` to this very process at the end of optimizer step ``at``: a real signal, handled between two
    bytecodes of the main thread."""

    def __init__(self, at: int | None, sig: signal.Signals = signal.SIGUSR1) -> None:
        self.at, self.sig = at, sig

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.at:
            os.kill(os.getpid(), self.sig)


def _fit(rank_safe: RankSafe, signal_at: int | None = None, sig: signal.Signals = signal.SIGUSR1, epochs: int = 2):
    """One fit with a ModelCheckpoint (RankSafe saves after it); returns the trainer, the model and the steps saved."""
    torch.manual_seed(0)
    saved: list[int] = []
    save = rank_safe.manager.save
    rank_safe.manager.save = lambda step, *a, **kw: saved.append(step) or save(step, *a, **kw)
    callbacks = [SignalAt(signal_at, sig), rank_safe, ModelCheckpoint(monitor="val_loss", save_top_k=1)]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
        default_root_dir=rank_safe.manager.root + "-lightning",
    )  # fmt: skip
    model = StepModel()
    trainer.fit(model, _loader(), _loader())
    return trainer, model, saved


@pytest.mark.parametrize(
    "signal_at, async_save", [(1, False), (3, True)], ids=["mid-epoch", "at-the-epochs-last-step-async"]
)
def test_one_process_a_signal_saves_the_next_step_stops_and_the_next_fit_resumes_there(tmp_path, signal_at, async_save):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    first = RankSafe(checkpoint_dir=tmp_path / "ckpt", keep=None, preemption=True, async_save=async_save)
    trainer, model, saved = _fit(first, signal_at)
    stop = signal_at + 1  # the signal lands in step signal_at's end: posted there, acted on at the next one
    assert trainer.global_step == stop and first.manager.preempted and model.trained == list(range(stop))
    assert saved == [stop], "the step, and no epoch-end save of the epoch the stop cut short"
    assert ranksafe.CheckpointManager(tmp_path / "ckpt").latest() == stop
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers of before the fit
    # the next fit (resume is on with preemption) starts from that step and trains the rest once
    second = RankSafe(checkpoint_dir=tmp_path / "ckpt", keep=None, preemption=True)
    trainer, resumed, saved = _fit(second)
    assert trainer.global_step == 8 and not second.manager.preempted
    assert model.trained + resumed.trained == list(range(8)) and saved == [s for s in (4, 8) if s > stop]
    whole, uninterrupted, _ = _fit(RankSafe(checkpoint_dir=tmp_path / "whole"))
    assert trainer.optimizers[0].param_groups[0]["lr"] == whole.optimizers[0].param_groups[0]["lr"]
    assert torch.equal(resumed.layer.weight, uninterrupted.layer.weight)


def _slurm(monkeypatch, out: Path) -> None:
    """This process as one SLURM task, with a recording ``scontrol`` first on PATH."""
    for name, value in dict(
        SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="train", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="1",
        SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="localhost",
    ).items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", f"{_fake_scontrol(out)}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=lambda s: s.name)
def test_one_slurm_task_requeues_after_the_commit_on_its_requeue_signal_only(tmp_path, monkeypatch, sig):
    _slurm(monkeypatch, tmp_path)
    rank_safe = RankSafe(checkpoint_dir=tmp_path / "ckpt", preemption=True)
    trainer, _, saved = _fit(rank_safe, signal_at=2, sig=sig)
    assert isinstance(compat.cluster_environment(trainer), SLURMEnvironment)  # Lightning took it for a SLURM task
    assert trainer.global_step == 3 and saved == [3]
    requeues = _requeues(tmp_path)
    if sig == signal.SIGUSR1:  # SLURM's --signal=USR1@...: Lightning's requeue signal
        assert [(r["args"], r["committed"]) for r in requeues] == [
            (["requeue", JOB_ID], [str(tmp_path / "ckpt" / "step_00000003" / "MANIFEST.json")])
        ]
    else:  # what scancel sends: a stop, as Lightning makes it, without requeue
        assert requeues == []
    assert not list(Path(trainer.default_root_dir).glob("hpc_ckpt*")), "Lightning's handler never saved"


def test_a_requeue_signal_ranksafe_does_not_handle_is_refused_and_a_failed_requeue_is_a_warning(tmp_path, monkeypatch):
    _slurm(monkeypatch, tmp_path)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        plugins=[SLURMEnvironment(requeue_signal=signal.SIGHUP)], default_root_dir=tmp_path,
        callbacks=[RankSafe(checkpoint_dir=tmp_path / "ckpt", preemption=True)],
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"SLURMEnvironment requeues on SIGHUP, but RankSafe.* handles SIGTERM, SIGUSR1"
    ):
        trainer.fit(StepModel(), _loader())
    (tmp_path / "bin" / "scontrol").write_text("#!/bin/sh\nexit 3\n")
    with pytest.warns(UserWarning, match=f"scontrol requeue {JOB_ID} exited with status 3; resubmit the job"):
        requeue()
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.warns(UserWarning, match="cannot requeue the SLURM job: FileNotFoundError"):
        requeue()


def test_schedule_arguments_are_checked_and_need_a_checkpoint_dir(tmp_path):
    for kwargs in ({"preemption": True}, {"every_n_train_steps": 5}, {"train_time_interval": 60.0}):
        with pytest.raises(ValueError, match=f"RankSafe\\({next(iter(kwargs))}=...\\) needs a checkpoint_dir"):
            RankSafe(**kwargs)
    for kwargs in ({"every_n_train_steps": 0}, {"every_n_epochs": 1.5}, {"train_time_interval": -1}):
        with pytest.raises(ValueError, match="must be a positive"):
            RankSafe(checkpoint_dir=tmp_path, **kwargs)
    assert RankSafe(checkpoint_dir=tmp_path, every_n_train_steps=5).every_n_epochs is None  # as ModelCheckpoint
    assert RankSafe(checkpoint_dir=tmp_path).every_n_epochs == 1
    assert RankSafe(checkpoint_dir=tmp_path, preemption=True).resume and not RankSafe(checkpoint_dir=tmp_path).resume
    before = signal.getsignal(signal.SIGTERM)
    RankSafe(checkpoint_dir=tmp_path, preemption=True)
    assert signal.getsignal(signal.SIGTERM) == before, "handlers are installed for a fit only"
