"""Real ``Trainer(accelerator="cpu", strategy="ddp", devices=2)`` runs: failures, kills, resume, top-k.

Each run is tests/lightning_scripts/ddp_run.py started as a fresh script (Lightning's "ddp" launcher re-runs
it for rank 1) in its own session, with a hard deadline after which the whole session is killed. Runs are few
and each checks several claims: a Lightning DDP start costs ~10 s on two cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ranksafe
from tests.ranks import LAUNCH_VARS

SCRIPT = Path(__file__).parent / "lightning_scripts" / "ddp_run.py"
DEADLINE = 150  # seconds for one run; a hang is killed and fails the test instead of blocking CI


@dataclass
class Run:
    out: Path
    proc: subprocess.Popen
    output: str = ""
    hung: bool = False

    @property
    def ckpt_dir(self) -> Path:
        return self.out / "ckpts"

    def rank(self, r: int) -> dict:
        path = self.out / f"rank{r}.json"
        assert path.exists(), f"rank {r} reported nothing (hung={self.hung}); output:\n{self.output[-4000:]}"
        return json.loads(path.read_text())

    def fault_time(self) -> float:
        return json.loads((self.out / "fault.json").read_text())["t"]


def start(out: Path, *flags: str, script: Path = SCRIPT, ranksafe_timeout: float = 30) -> Run:
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}  # else Lightning would launch nothing
    env["RANKSAFE_TIMEOUT"] = str(ranksafe_timeout)
    cmd = [sys.executable, str(script), "--out", str(out), *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    return Run(out, proc)


def finish(run: Run, timeout: float = DEADLINE) -> Run:
    """Wait for the run (rank 1 holds the output pipe too, so this waits for both ranks), then kill leftovers."""
    if run.proc.returncode is not None:  # finished before
        return run
    try:
        run.output = run.proc.communicate(timeout=timeout)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        run.hung = True
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.proc.pid, signal.SIGKILL)
        if run.hung:
            run.output = run.proc.communicate()[0].decode(errors="replace")
    return run


@pytest.fixture(scope="module")
def stock_controls(tmp_path_factory):
    """Stock Lightning with rank 0's first write failing, started early: they spend most of their time waiting."""
    base = tmp_path_factory.mktemp("stock")
    # 20 s: long enough for a loaded machine to start both ranks (the timeout bounds the connect too)
    common = ("--stock", "--fail-save", "1", "--pg-timeout", "20")
    runs = {
        "stay": start(base / "stay", *common, "--after-fail", "stay"),
        "exit": start(base / "exit", *common, "--after-fail", "exit"),
    }
    yield runs
    for run in runs.values():
        finish(run)


@pytest.mark.parametrize("after_fail", ["stay", "exit"])
def test_write_failure_on_rank0_raises_on_every_rank_within_5s(tmp_path, after_fail, stock_controls):
    run = finish(start(tmp_path, "--fail-save", "1", "--after-fail", after_fail))
    assert not run.hung
    t_fault = run.fault_time()
    ranks = [run.rank(0), run.rank(1)]
    for r, result in enumerate(ranks):
        assert result["error_type"] and "RankFailure" in result["error_type"], (r, result)
        assert "OSError" in result["error_type"], "every rank can catch the writer's error type"
        assert "failed on rank 0" in result["error"] and "No space left on device (injected)" in result["error"]
        assert result["t_raised"] - t_fault < 5, (r, result["t_raised"] - t_fault)
    # the monitored value was agreed before the save: every rank names the same checkpoint
    assert ranks[0]["best_model_path"] == ranks[1]["best_model_path"]
    assert not list(run.ckpt_dir.glob("*.ckpt")) and not list(run.ckpt_dir.glob(".*"))
    # what RankSafe wrapped pickles wherever stock Lightning's objects do, and is gone after the failure
    stock = finish(stock_controls[after_fail])
    for r, result in enumerate(ranks):
        ours_and_stock = [(result["pickled"][k], stock.rank(r)["pickled"].get(k, "ok")) for k in result["pickled"]]
        assert all(ours == "ok" for ours, theirs in ours_and_stock if theirs == "ok"), (r, result["pickled"])
        for name in ("ModelCheckpoint", "EarlyStopping", "RankSafe", "checkpoint_io"):
            assert result["pickled"][name] == "ok", (r, name, result["pickled"][name])
        assert result["attributes"] == stock.rank(r)["attributes"], r


def test_stock_lightning_control_hangs_or_loses_the_cause(stock_controls):
    stay, died = (finish(stock_controls[k]) for k in ("stay", "exit"))
    for run in (stay, died):  # the controls must have reached their injected fault to show anything
        assert (run.out / "fault.json").exists(), f"stock control failed before its fault:\n{run.output[-3000:]}"
    # rank 0 alive after its failed write: rank 1 waits in the barrier until the process-group timeout (20 s)
    waited = stay.rank(1)["t_raised"] - stay.fault_time()
    assert waited >= 19, waited
    assert "Timed out" in stay.rank(1)["error"]
    # rank 0 exits: rank 1 gets a connection error from gloo or the store ("Connection closed by peer", or a
    # socket timeout when it next reaches for the store), with nothing about the cause
    lost = died.rank(1)
    assert lost["error"] and "RankFailure" not in lost["error_type"]
    assert "No space left" not in lost["error"] and "rank 0" not in lost["error"], lost["error"]
    # unsynced metric: each rank names a different "best" file; rank 1's can never exist
    assert died.rank(0)["best_model_path"] != lost["best_model_path"]


def test_a_save_on_exception_of_a_rank_that_failed_alone_ends_every_rank_before_the_process_group_timeout(tmp_path):
    """ModelCheckpoint(save_on_exception=True) saves from the failing rank's exception handler, then waits in a barrier
    for ranks still held in DDP's allreduce, which only that rank's exit ends: stock Lightning hangs there until the
    process group's timeout (30 minutes by default; 18 s here). Before, ranksafe removed its wrappers before that save,
    and hung the same way; now the save waits at most EXCEPTION_SAVE_WAIT (5 s here), also where RANKSAFE_TIMEOUT is
    longer (60 s here). Before, the read of the monitored value that comes first waited RANKSAFE_TIMEOUT."""
    flags = ("--epochs", "3", "--fail-step", "3", "--save-on-exception", "--pg-timeout", "18")
    runs = {
        "stock": start(tmp_path / "stock", "--stock", *flags),
        "ours": start(tmp_path / "ours", *flags, "--exception-save-wait", "5", ranksafe_timeout=60),
    }
    runs = {name: finish(run) for name, run in runs.items()}
    ended = {}
    for name, run in runs.items():
        assert not run.hung, f"{name} hung:\n{run.output[-3000:]}"
        ended[name] = [run.rank(r)["t_raised"] - run.fault_time() for r in (0, 1)]
        assert all(run.rank(r)["error"] for r in (0, 1)), name
    assert max(ended["ours"]) < 5 + 7, ended
    assert min(ended["stock"]) > 15, ended  # the process group's timeout, not the failure, ended them
    assert "waiting for rank(s) 0" in runs["ours"].rank(1)["error"], runs["ours"].rank(1)["error"]


def test_sigkill_mid_save_keeps_previous_checkpoint_then_resume_from_last(tmp_path):
    # Saves go: epoch0 top-k, last, epoch1 top-k, last, epoch2 top-k <- the writer is SIGKILLed inside this one
    killed = finish(start(tmp_path, "--epochs", "4", "--kill-save", "5"))
    assert not killed.hung
    assert killed.proc.returncode == -signal.SIGKILL
    survivor = killed.rank(1)
    assert "RankFailure" in survivor["error_type"] and "lost the rendezvous store" in survivor["error"]
    assert survivor["t_raised"] - killed.fault_time() < 5
    debris = list(killed.ckpt_dir.glob(f".*{ranksafe.files.TMP_SUFFIX}"))
    assert len(debris) == 1 and "epoch=2" in debris[0].name, debris  # killed mid-write: its temporary remains
    assert not list(killed.ckpt_dir.glob("epoch=2*"))  # ... and never became a checkpoint
    last = killed.ckpt_dir / "last.ckpt"
    assert ranksafe.verify_file(last) is True
    assert torch.load(last, weights_only=True)["global_step"] == 4  # the previous save, intact
    assert "monitored metric 'val_score' differs across ranks" in killed.output

    resumed = finish(start(tmp_path, "--epochs", "4", "--resume"))
    assert not resumed.hung and resumed.proc.returncode == 0, resumed.output[-4000:]
    r0, r1 = resumed.rank(0), resumed.rank(1)
    for result in (r0, r1):
        assert result["error"] is None
        assert result["ckpt_path"] == str(last) and result["start_step"] == 4 and result["global_step"] == 8
        for name in ("ModelCheckpoint", "EarlyStopping", "RankSafe", "checkpoint_io"):  # pickled during fit
            assert result["pickled"][name] == "ok", (name, result["pickled"][name])
        # nothing of RankSafe's is left on the strategy, the connector or the callbacks after fit
        wrapped = {"save_checkpoint", "remove_checkpoint", "load_checkpoint", "resume_start", "_link_checkpoint"}
        wrapped |= {"_monitor_candidates", "_validate_condition_metric", "_evaluate_stopping_criteria"}
        wrapped |= {"on_train_epoch_end", "file_exists"}
        assert not wrapped & {name for names in result["attributes"].values() for name in names}
    # agreed metric: identical best path, top-k and EarlyStopping state on both ranks, and the files exist
    assert (r0["best_model_path"], r0["best_k"], r0["es_best"]) == (r1["best_model_path"], r1["best_k"], r1["es_best"])
    assert r0["es_best"] == pytest.approx(7.25)  # mean of the ranks' 7.0 and 7.5
    names = sorted(p.name for p in resumed.ckpt_dir.iterdir())
    assert names == ["epoch=2-val_score=8.25.ckpt", "epoch=3-val_score=7.25.ckpt", "last.ckpt"]  # k=2, + last
    assert [Path(p).name for p in r0["best_k"]] == names[:2]
    for name in names:
        assert ranksafe.verify_file(resumed.ckpt_dir / name) is True
    manual = tmp_path / "manual.ckpt"  # trainer.save_checkpoint from user code, on every rank
    assert ranksafe.verify_file(manual) is True and torch.load(manual, weights_only=True)["global_step"] == 8


METRICS_SCRIPT = Path(__file__).parent / "lightning_scripts" / "metrics_run.py"


def test_metrics_logged_apart_stop_every_rank_alike_and_name_one_file(tmp_path):
    """EarlyStopping(strict=False) watches a metric logged on rank 0 alone, and ModelCheckpoint's file name holds a
    metric each rank logged its own value of. Before: rank 1, without the metric, skipped the stop decision that rank 0
    reduced; rank 0 waited there until ranksafe's timeout, then both failed (rank 1 with gloo's "Connection closed by
    peer"), and rank 1's best_model_path named a file of its own that no rank wrote. Stock Lightning (the control)
    fails the same way at its process group's timeout."""
    stock = start(tmp_path / "stock", "--stock", script=METRICS_SCRIPT)
    ours = finish(start(tmp_path / "ours", script=METRICS_SCRIPT, ranksafe_timeout=25))
    assert not ours.hung and ours.proc.returncode == 0, ours.output[-4000:]
    r0, r1 = ours.rank(0), ours.rank(1)
    for result in (r0, r1):
        assert result["error"] is None, result
        assert (result["stopped_epoch"], result["es_best"], result["wait"]) == (1, 10.0, 1)  # score fell at epoch 1
        assert [Path(p).name for p in result["best_k"]] == ["epoch=0-acc=0.55.ckpt", "epoch=1-acc=0.55.ckpt"]
        assert Path(result["best_model_path"]).name == "epoch=1-acc=0.55.ckpt"  # the mean of 0.5 and 0.6
    assert sorted(p.name for p in (ours.out / "ckpts").iterdir()) == ["epoch=0-acc=0.55.ckpt", "epoch=1-acc=0.55.ckpt"]
    assert "score" in r0["metrics"] and "score" not in r1["metrics"]  # the agreed value did not stay on rank 1
    assert "monitored metric 'score' was not logged on every rank" in ours.output
    assert "monitored metric 'acc' differs across ranks" in ours.output

    stock = finish(stock)
    s0, s1 = stock.rank(0), stock.rank(1)
    assert s0["error"] and s1["error"], (s0, s1)  # rank 0 waited in the reduction rank 1 skipped
    assert abs(s0["t"] - s1["t"]) < 10 and "Timed out" in s0["error"] + s1["error"]
    assert Path(s1["best_model_path"]).name == "epoch=0-acc=0.60.ckpt"  # rank 1's own name: no rank wrote it
    assert not (stock.out / "ckpts" / "epoch=0-acc=0.60.ckpt").exists()
