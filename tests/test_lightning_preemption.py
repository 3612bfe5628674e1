"""Preemption and agreed save schedules in Lightning: real signals, in one process and sent from outside to real
DDP ranks.

Each DDP run is tests/lightning_scripts/preempt_run.py on two CPU ranks, started as Lightning's own launcher starts
it (the script re-runs itself for rank 1) or, under SLURM's variables, one process per rank as ``srun`` starts them.
A run is bounded in time: its whole session is killed at the deadline. Runs are few and each checks several claims:
a Lightning DDP start costs ~10 s on two cores.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

import ranksafe
from ranksafe.lightning import RankSafe, compat
from ranksafe.preemption import requeue_slurm_job
from tests.lightning_scripts.resumable import ResumableLoader
from tests.ranks import LAUNCH_VARS, free_port

SCRIPT = Path(__file__).parent / "lightning_scripts" / "preempt_run.py"
DEADLINE = 150  # seconds for one launch; a hang is killed and fails the test instead of blocking CI
EPOCHS, STEPS_PER_EPOCH = 3, 8
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
    """Records the global step each training step starts from, and the one each validation batch runs at; its
    learning rate decays once per optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.trained: list[int] = []
        self.validated: list[int] = []

    def training_step(self, batch, batch_idx):
        self.trained.append(self.global_step)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.validated.append(self.global_step)
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


def _fit(
    rank_safe: RankSafe,
    signal_at: int | None = None,
    sig: signal.Signals = signal.SIGUSR1,
    every_n_train_steps: int | None = None,
    **trainer_args,
):
    """One fit of 2 epochs with an EarlyStopping and a ModelCheckpoint that keeps the best and the last file
    (RankSafe saves after them); returns the trainer, the model and the steps saved."""
    torch.manual_seed(0)
    saved: list[int] = []
    save = rank_safe.manager.save
    rank_safe.manager.save = lambda step, *a, **kw: saved.append(step) or save(step, *a, **kw)
    # EarlyStopping checks at each epoch's end: after a stop whose epoch was not validated, with no val_loss yet, its
    # check would raise (strict=True)
    checkpoints = ModelCheckpoint(
        monitor="val_loss", save_top_k=1, save_last=True, every_n_train_steps=every_n_train_steps
    )
    monitors = [EarlyStopping(monitor="val_loss", patience=3), checkpoints]
    callbacks = [SignalAt(signal_at, sig), rank_safe, *monitors]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
        default_root_dir=rank_safe.manager.root + "-lightning", **trainer_args,
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
    # no validation after the commit, unless Lightning's schedule runs one at that step anyway (an epoch's last: the
    # resumed run starts after it). Before, Lightning validated the epoch the stop cut short (should_stop is set): 4
    # batches at step 2, in the grace time, and the resumed run validated that epoch again at its end
    validated_after_signal = sum(s > signal_at for s in model.validated)
    assert validated_after_signal == (4 if stop % 4 == 0 else 0), model.validated  # 4 batches an epoch
    assert ranksafe.CheckpointManager(tmp_path / "ckpt").latest() == stop
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers of before the fit
    # the preempted RankSafe given to another fit of the same process: it stops before its first step. Before, it
    # trained one step, saved it as a preemption step and stopped
    with pytest.warns(RuntimeWarning, match="earlier fit of this process was preempted"):
        again, not_trained, not_saved = _fit(first)
    assert again.global_step == stop and not_trained.trained == [] and not_saved == []
    assert ranksafe.CheckpointManager(tmp_path / "ckpt").latest() == stop
    # the next fit (resume is on with preemption) starts from that step and trains the rest once
    second = RankSafe(checkpoint_dir=tmp_path / "ckpt", keep=None, preemption=True)
    trainer, resumed, saved = _fit(second)
    assert trainer.global_step == 8 and not second.manager.preempted
    assert model.trained + resumed.trained == list(range(8)) and saved == [s for s in (4, 8) if s > stop]
    whole, uninterrupted, _ = _fit(RankSafe(checkpoint_dir=tmp_path / "whole"))
    assert trainer.optimizers[0].param_groups[0]["lr"] == whole.optimizers[0].param_groups[0]["lr"]
    assert model.validated + resumed.validated == uninterrupted.validated == [4] * 4 + [8] * 4, "each epoch once"
    assert torch.equal(resumed.layer.weight, uninterrupted.layer.weight)
    # ModelCheckpoint's files too: before, the validation Lightning runs as the stopped epoch ends saved a file (and
    # removed the one the committed step names as best) after the commit; the resumed run never tracked it
    kept = {run: sorted(os.listdir(tmp_path / f"{run}-lightning" / "checkpoints")) for run in ("ckpt", "whole")}
    assert kept["ckpt"] == kept["whole"], kept


def test_a_loop_that_min_steps_keeps_going_saves_the_preemption_step_once(tmp_path):
    """And no ModelCheckpoint file after it. Before, the steps Lightning trains on to reach ``min_steps`` saved theirs
    (``every_n_train_steps``), which the resumed run never tracks: it wrote its own beside them."""
    rank_safe = RankSafe(checkpoint_dir=tmp_path / "ckpt", keep=None, preemption=True)
    trainer, _, saved = _fit(rank_safe, signal_at=1, min_steps=6, every_n_train_steps=2)
    assert saved == [2] and trainer.global_step == 6  # Lightning trains on to min_steps, then takes the stop request
    # it saves from the first step after a validation (step 6, where the stock run saves too): none before the stop
    assert os.listdir(tmp_path / "ckpt-lightning" / "checkpoints") == []


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
        requeue_slurm_job()
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.warns(UserWarning, match="cannot requeue the SLURM job: FileNotFoundError"):
        requeue_slurm_job()


def test_schedule_arguments_are_checked_and_need_a_checkpoint_dir(tmp_path):
    for kwargs in ({"preemption": True}, {"every_n_train_steps": 5}, {"train_time_interval": 60.0}):
        with pytest.raises(ValueError, match=f"RankSafe\\({next(iter(kwargs))}=...\\) needs a checkpoint_dir"):
            RankSafe(**kwargs)
    for kwargs in ({"every_n_train_steps": 0}, {"every_n_epochs": 1.5}, {"train_time_interval": -1}):
        with pytest.raises(ValueError, match="must be a positive"):
            RankSafe(checkpoint_dir=tmp_path, **kwargs)
    with pytest.raises(ValueError, match="must be a positive number or None, not nan"):  # passed, and never saved
        RankSafe(checkpoint_dir=tmp_path, train_time_interval=math.nan)
    with pytest.raises(ValueError, match="SIGKILL cannot be handled"):  # passed, and failed at fit: OSError EINVAL
        RankSafe(checkpoint_dir=tmp_path, preemption=[signal.SIGKILL])
    assert RankSafe(checkpoint_dir=tmp_path, every_n_train_steps=5).every_n_epochs is None  # as ModelCheckpoint
    assert RankSafe(checkpoint_dir=tmp_path).every_n_epochs == 1
    assert RankSafe(checkpoint_dir=tmp_path, preemption=True).resume and not RankSafe(checkpoint_dir=tmp_path).resume
    before = signal.getsignal(signal.SIGTERM)
    RankSafe(checkpoint_dir=tmp_path, preemption=True)
    assert signal.getsignal(signal.SIGTERM) == before, "handlers are installed for a fit only"


# --- two DDP ranks: launches of tests/lightning_scripts/preempt_run.py -----------------------------------------


@dataclass
class Launch:
    """One launch of the script: its processes (one, or one per rank under SLURM) and what they printed."""

    out: Path
    run: str
    procs: list[subprocess.Popen]
    output: str = ""
    hung: bool = False
    senders: list[threading.Thread] = field(default_factory=list)

    def rank(self, r: int) -> dict:
        path = self.out / f"{self.run}-rank{r}.json"
        assert path.exists(), f"rank {r} of {self.run} reported nothing (hung={self.hung}):\n{self.output[-4000:]}"
        return json.loads(path.read_text())

    @property
    def ranks(self) -> list[dict]:
        return [self.rank(0), self.rank(1)]

    @property
    def exit_codes(self) -> list[int | None]:
        return [p.returncode for p in self.procs]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env["RANKSAFE_TIMEOUT"] = "30"
    env.update(extra)
    return env


def _start(out: Path, run: str, flags: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--run", run, "--epochs", str(EPOCHS), *flags]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def launch(out: Path, run: str, *flags: str) -> Launch:
    """Lightning's own launcher: rank 0 is this process, rank 1 the copy it starts."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("pid-0", "pid-1", "step-0", "step-1"):  # the previous launch's
        (out / name).unlink(missing_ok=True)
    return Launch(out, run, [_start(out, run, flags, _env())])


def launch_slurm(out: Path, run: str, *flags: str, path_first: Path) -> Launch:
    """As ``srun --ntasks-per-node=2`` starts a job step: one process per rank, SLURM's variables set, and
    ``path_first`` first on PATH."""
    out.mkdir(parents=True, exist_ok=True)
    common = dict(
        SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="train", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1",
        SLURM_NODEID="0", SLURM_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
        PATH=f"{path_first}{os.pathsep}{os.environ['PATH']}",
    )  # fmt: skip
    envs = [_env(**common, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)) for r in range(2)]
    return Launch(out, run, [_start(out, run, flags, env) for env in envs])


def finish(launch: Launch, timeout: float = DEADLINE) -> Launch:
    """Wait for every process of the launch (rank 1 holds rank 0's output pipe too), then kill what is left."""
    deadline = time.monotonic() + timeout
    outputs = []
    for proc in launch.procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            launch.hung = True
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    if launch.hung:
        outputs = [p.communicate()[0].decode(errors="replace") for p in launch.procs]
    launch.output = "\n".join(outputs)
    for sender in launch.senders:
        sender.join(1)
    return launch


def signal_when(launch: Launch, rank: int, at_step: int, sig: signal.Signals, delay: float = 0.0) -> None:
    """From outside, as a cluster does: send ``sig`` to ``rank``'s process ``delay`` seconds after it reported the end
    of step ``at_step``, while it trains the next one."""

    def send() -> None:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError):
                if int((launch.out / f"step-{rank}").read_text()) >= at_step:
                    time.sleep(delay)
                    os.kill(int((launch.out / f"pid-{rank}").read_text()), sig)
                    return
            time.sleep(0.002)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    launch.senders.append(sender)


def stopped_together(launch: Launch) -> int:
    """Every rank stopped at one step, committed, after a fit that returned and a process that ended with 0."""
    assert not launch.hung and launch.exit_codes == [0] * len(launch.procs), launch.output[-4000:]
    ranks = launch.ranks
    for r in ranks:
        assert r["error"] is None and r["preempted"], r
    stops = {r["global_step"] for r in ranks}
    assert len(stops) == 1, f"every rank must stop at the same step: {stops}"
    stop = stops.pop()
    assert {r["committed"][-1] for r in ranks} == {stop} and ranks[0]["saved"] == ranks[1]["saved"]
    assert ranks[0]["saved"][-1] == stop
    print(f"{launch.run}: both ranks stopped at step {stop}, committed")
    return stop


def trained_steps(*launches: Launch, rank: int) -> list[int]:
    return [step for launch in launches for _, _, step, _ in launch.rank(rank)["trained"]]


# --- preempted, resumed, preempted again, finished: the same training as one uninterrupted run ------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: one run to the end, saving by time with rank 1's clock skewed (which must change nothing)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return finish(launch(out, "whole", "--train-time-interval", "0.3", "--skew"))


def test_preempted_twice_and_resumed_the_runs_train_every_step_once_like_an_uninterrupted_run(tmp_path, uninterrupted):
    total = EPOCHS * STEPS_PER_EPOCH
    # the control, stock Lightning, meanwhile: the same SIGTERM to rank 1 (the timeout bounds the rendezvous too,
    # while Lightning starts rank 1 on a loaded machine)
    stock = launch(tmp_path / "stock", "stock", "--ranksafe", "none", "--pg-timeout", "30")
    signal_when(stock, 1, 4, signal.SIGTERM)
    # 1: SIGTERM to rank 1 alone, mid-epoch 0
    first = launch(tmp_path, "first", "--every-n-train-steps", "3")
    signal_when(first, 1, 4, signal.SIGTERM)
    stop1 = stopped_together(finish(first))
    assert 4 < stop1 < STEPS_PER_EPOCH, stop1  # the end of the step after rank 1's next one: mid-epoch
    assert first.rank(0)["committed"] == sorted({*range(3, stop1 + 1, 3), stop1})  # every 3 steps, and the stop
    # 2: resumed; SIGTERM to rank 1, then SIGUSR1 to rank 0, each during its step 11, mid-epoch 1
    second = launch(tmp_path, "second", "--every-n-train-steps", "3")
    signal_when(second, 1, 10, signal.SIGTERM)
    signal_when(second, 0, 10, signal.SIGUSR1, delay=0.025)
    stop2 = stopped_together(finish(second))
    assert 10 < stop2 < 2 * STEPS_PER_EPOCH, stop2
    # 3: resumed, to the end
    third = finish(launch(tmp_path, "third", "--every-n-train-steps", "3"))
    assert not third.hung and third.exit_codes == [0], third.output[-4000:]
    whole = uninterrupted.ranks
    for r in range(2):
        assert trained_steps(first, second, third, rank=r) == list(range(total)), "every step trained exactly once"
        samples = [(e, ids) for run in (first, second, third) for e, _, _, ids in run.rank(r)["trained"]]
        assert samples == [(e, ids) for e, _, _, ids in whole[r]["trained"]], "the same batches, in the same order"
        end = third.rank(r)
        assert end["global_step"] == whole[r]["global_step"] == total and not end["preempted"]
        assert end["lr"] == whole[r]["lr"] == pytest.approx(0.1 * 0.97**total)  # a scheduler stepped once per step
        assert end["weights"] == whole[r]["weights"]
        # each epoch validated once, at its end, as without preemption: before, each stop also validated the epoch
        # it cut short (Lightning validates when should_stop is set), after the commit, and the relaunch again
        validated = [step for run in (first, second, third) for step in run.rank(r)["validated"]]
        assert validated == whole[r]["validated"] == [s for s in (8, 16, 24) for _ in range(2)], validated
    for run in (first, second):  # during the fit ranksafe's recorder handles both signals; afterwards, nobody
        for r in run.ranks:
            assert set(r["during"]["handlers"].values()) == {"ranksafe.preemption._Handler"}, r["during"]
            assert r["after"]["handlers"] == {"SIGTERM": "SIG_DFL", "SIGUSR1": "SIG_DFL"}, r["after"]
            assert r["during"]["pickled"]["RankSafe"] == "ok"
            assert "register_signal_handlers" not in r["after"]["signal connector"]
            assert compat.VALIDATION_DUE not in r["after"]["epoch loop"]
    # stock Lightning: rank 1's handler broadcasts from inside the signal handler, paired with whatever collective
    # rank 0 is in. What rank 1 then raises depends on that pairing (SIGTERMException when it stops alone, a gloo
    # RuntimeError, or a TypeError when it unpickles rank 0's bytes of another collective); rank 0 loses its peer.
    # Either way both ranks fail and nothing is saved.
    stock = finish(stock)
    assert stock.exit_codes == [1] and not (tmp_path / "stock" / "ckpt").exists()
    errors = [r["error_type"] and r["error_type"][0] for r in stock.ranks]
    assert all(errors), errors
    assert {r["global_step"] for r in stock.ranks} < set(range(stop1))
    # what ranksafe installs pickles wherever stock Lightning's objects do (a stock rank that failed before its
    # first batch ended recorded nothing)
    stock_pickled = [r["during"]["pickled"] for r in stock.ranks if r["during"]]
    assert stock_pickled, [r["error_type"] for r in stock.ranks]
    for ours in (r["during"]["pickled"] for run in (first, second) for r in run.ranks):
        for theirs in stock_pickled:
            assert all(ours[k] == "ok" for k, v in theirs.items() if v == "ok"), (ours, theirs)
    print(
        f"stock Lightning: rank 1 raised {errors[1]}, rank 0 {errors[0]} (gloo), at step {stock.rank(1)['global_step']}"
        f", nothing saved; ranksafe: both stopped at step {stop1}, committed, and the relaunches trained the rest once"
    )


def test_train_time_interval_with_a_skewed_clock_saves_the_same_steps_on_every_rank(uninterrupted):
    assert not uninterrupted.hung and uninterrupted.exit_codes == [0], uninterrupted.output[-4000:]
    zero, one = uninterrupted.ranks
    naive = sum(a != b for a, b in zip(zero["naive"], one["naive"], strict=True))
    print(
        f"steps where the ranks' own clocks disagreed: {naive} of {len(zero['naive'])}; ranksafe saved {zero['saved']}"
    )
    assert naive > 0, "the control must show the skewed clock splitting the ranks"
    assert zero["saved"] == one["saved"] == zero["committed"] and len(zero["saved"]) >= 2
    assert not zero["preempted"] and zero["hpc"] == []


# --- SLURM: the agreed save, a clean stop, then Lightning's requeue from rank 0 ----------------------------------


def test_under_slurm_a_signal_is_an_agreed_save_a_clean_stop_and_one_requeue_from_rank_0(tmp_path):
    ours_out, stock_out = tmp_path / "ours", tmp_path / "stock"
    # the control, meanwhile: RankSafe without preemption leaves SIGUSR1 to Lightning's requeue handler (the timeout
    # bounds the rendezvous too, while Lightning starts rank 1 on a loaded machine)
    flags = ("--ranksafe", "without-preemption", "--pg-timeout", "20")
    stock = launch_slurm(stock_out, "stock", *flags, path_first=_fake_scontrol(stock_out))
    signal_when(stock, 1, 4, signal.SIGUSR1)
    ours = launch_slurm(ours_out, "ours", path_first=_fake_scontrol(ours_out))
    signal_when(ours, 1, 4, signal.SIGUSR1)  # SLURM's --signal=USR1@90, here reaching rank 1 alone
    stop = stopped_together(finish(ours))
    requeues = _requeues(ours_out)
    assert [(r["args"], r["rank"]) for r in requeues] == [(["requeue", JOB_ID], "0")], requeues
    assert str(ours_out / "ckpt" / f"step_{stop:08d}" / "MANIFEST.json") in requeues[0]["committed"], "after the commit"
    assert ours.rank(0)["hpc"] == [], "Lightning's handler saved nothing"
    # stock: Lightning's handler saves from inside the signal handler on rank 1 alone, in collectives that rank 0
    # never joins; both ranks fail at the process-group timeout, with no checkpoint and no requeue
    stock = finish(stock)
    assert stock.exit_codes == [1, 1] and _requeues(stock_out) == [], stock.output[-4000:]
    assert [r["committed"] for r in stock.ranks] == [[], []] and stock.rank(0)["hpc"] == []
    # rank 1 fails in the save its handler started, paired with whatever rank 0 is in: ranksafe's shared outcome,
    # the backend's error, or a TypeError from bytes of another collective (CI saw each); which one is timing
    assert all(r["error_type"] for r in stock.ranks), stock.ranks
    assert "preemption=True" in stock.output  # RankSafe warned at the start
    print(
        f"SLURM: ranksafe stopped both ranks at step {stop}, committed, then one requeue from rank 0; "
        f"stock Lightning's handler: {stock.rank(1)['error']}"
    )


_SIGNAL_IN_THE_LAST_VALIDATION = """
import os, signal, sys, warnings
import lightning.pytorch as pl
import torch
from ranksafe.lightning import RankSafe

warnings.simplefilter("ignore")

class Model(pl.LightningModule):
    def __init__(self, signal_at_the_end):
        super().__init__()
        self.layer, self.signal_at_the_end = torch.nn.Linear(3, 1), signal_at_the_end
    def training_step(self, batch, i):
        return self.layer(batch[0]).pow(2).mean()
    def validation_step(self, batch, i):
        if self.signal_at_the_end and self.current_epoch == self.trainer.max_epochs - 1 and i == 0:
            os.kill(os.getpid(), signal.SIGTERM)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.1)

rows = torch.utils.data.TensorDataset(torch.randn(24, 3))
for epochs, signal_at_the_end in ((2, True), (4, False)):  # 6 steps an epoch; a new RankSafe and Trainer each
    rank_safe = RankSafe(checkpoint_dir=sys.argv[1], preemption=True, async_save=signal_at_the_end)
    trainer = pl.Trainer(max_epochs=epochs, callbacks=[rank_safe], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(signal_at_the_end), *[torch.utils.data.DataLoader(rows, batch_size=4)] * 2)
    print(trainer.global_step, rank_safe.manager.preempted, flush=True)
    RankSafe(checkpoint_dir=sys.argv[1], preemption=True)  # made and never used: takes no signal from a fit
"""


def test_a_signal_in_the_last_validation_ends_the_fit_as_usual_and_the_next_fit_stops(tmp_path):
    """Before, with async_save: the fit's end (on_fit_end) raised the signal again, and the process ended there,
    SIGTERM its exit code, nothing after fit run. (Without: the signal stayed with that RankSafe, lost to a new one.)"""
    command = [sys.executable, "-c", _SIGNAL_IN_THE_LAST_VALIDATION, str(tmp_path / "ckpt")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    # the first fit ends at step 12; the second resumes there and stops after its second step, preempted
    assert done.stdout.split() == ["12", "False", "14", "True"], (done.stdout, done.stderr[-3000:])
