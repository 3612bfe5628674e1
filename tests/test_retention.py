"""Retention that keeps what matters: the newest steps, every ``keep_period``-th, and the best few by a metric,
also when a writer is killed mid-save."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ranksafe
from ranksafe.retention import Retention
from tests.ranks import run_ranks


def test_the_rules_one_by_one():
    steps = list(range(1, 13))
    loss = {s: abs(s - 4) + 0.5 for s in steps} | {7: math.nan}  # best: 4, then 3 and 5
    doomed = Retention(keep=2, keep_period=6, best_metric="loss", keep_best=2).doomed(steps, 12, {1}, loss.get)
    # kept: 1 (being loaded), 4 and 5 (best; 5 is newer than 3, as good), 6 (period), 11 and 12 (newest); NaN never best
    assert sorted(set(steps) - set(doomed)) == [1, 4, 5, 6, 11, 12]
    assert Retention(keep=None, keep_best=1, best_metric="loss").doomed(steps, 12, (), loss.get) == []
    assert Retention(best_mode="max", best_metric="loss", keep_best=1).best(steps, loss.get) == [12]
    with pytest.raises(ValueError, match="keep_best needs best_metric"):
        Retention(keep_best=1)
    with pytest.raises(ValueError, match=re.escape("BestMode takes 'min', 'max', not 'lowest'")):
        Retention(best_mode="lowest")  # type: ignore[arg-type]


def _val_loss(step: int) -> float:
    return abs(step - 4) + 0.5


_KILLED = textwrap.dedent(
    """
    import os, signal, sys, torch, ranksafe
    from ranksafe import checkpoint_file
    mgr = ranksafe.CheckpointManager(sys.argv[1], keep=2, keep_period=5, best_metric="val_loss", keep_best=1)
    write = checkpoint_file.ChecksummingWriter.write

    def killed_half_way(self, data):  # the writer dies while it writes step 13's state
        write(self, data)
        if self.length > 1 << 20:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_file.ChecksummingWriter.write = killed_half_way
    mgr.save(13, {"w": torch.zeros(1 << 20)}, metrics={"val_loss": 0.0})  # it would have been the best
    """
)


def test_the_contracts_positional_arguments_mean_what_it_says(tmp_path):
    # CheckpointManager(root, keep, storage, async_save, ...) and .save(step, state, metrics): a dict passed third
    # is the step's metrics, which rank it for retention, never a side file
    mgr = ranksafe.CheckpointManager(tmp_path, 1, "shared", False, None, None, None, "loss", "min", 1)
    for step, loss in [(1, 0.5), (2, 0.9), (3, 0.8)]:
        mgr.save(step, {"w": torch.ones(1)}, {"loss": loss})
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000003"]  # the best and the newest
    assert sorted(os.listdir(tmp_path / "step_00000001")) == ["MANIFEST.json", "state.pt"]
    assert ranksafe.verify_step(tmp_path / "step_00000001")["metrics"] == {"loss": 0.5}
    with pytest.raises(TypeError):  # the rest is keyword-only: no positional prefix or timeout taken for another
        ranksafe.CheckpointManager(tmp_path, 1, "shared", False, None, None, None, None, "min", 0, False, "step_")


def test_the_best_newest_and_period_steps_survive_a_writer_killed_mid_save(tmp_path):
    root = tmp_path / "ckpt"
    mgr = ranksafe.CheckpointManager(root, keep=2, keep_period=5, best_metric="val_loss", keep_best=1)
    for step in range(1, 13):
        mgr.save(step, {"w": torch.full((2,), float(step))}, metrics={"val_loss": _val_loss(step)})
    survivors = [5, 10, 11, 12, 4]
    assert sorted(mgr._dirs.committed()) == sorted(survivors)
    killed = subprocess.run([sys.executable, "-c", _KILLED, str(root)], timeout=120)
    assert killed.returncode == -signal.SIGKILL
    again = ranksafe.CheckpointManager(root, keep=2, keep_period=5, best_metric="val_loss", keep_best=1)
    assert again.latest() == 12, "the killed save is not committed"
    assert sorted(s.step for s in ranksafe.list_steps(root) if s.status == "committed") == sorted(survivors)
    again.save(14, {"w": torch.zeros(2)}, metrics={"val_loss": 9.0})  # the metrics of earlier steps: from manifests
    assert sorted(os.listdir(root)) == [f"step_{s:08d}" for s in (4, 5, 10, 12, 14)]
    assert ranksafe.verify_step(root / "step_00000004")["metrics"] == {"val_loss": 0.5}


def _metrics_differ(rank, root):
    mgr = ranksafe.CheckpointManager(root, keep=1, best_metric="val_loss", keep_best=1)
    for step in (1, 2, 3):  # rank 0 finds step 2 best, rank 1 step 3: rank 0's metrics decide for every node
        mgr.save(step, {"w": torch.ones(1)}, metrics={"val_loss": [[9, 1, 5], [9, 5, 1]][rank][step - 1]})
    try:  # a metric that is no number, on rank 1 only: every rank fails at once, none waits for the others
        mgr.save(4, {"w": torch.ones(1)}, metrics={"val_loss": [0.5, None][rank]})
        failed = None
    except Exception as e:
        failed = f"{type(e).__name__}: {e}"
    return sorted(s.step for s in ranksafe.list_steps(root) if s.status == "committed"), failed


def test_every_rank_records_rank_0s_metrics(tmp_path):
    values = run_ranks(_metrics_differ, 2, args=(str(tmp_path),), timeout=90).values
    assert [steps for steps, _ in values] == [[2, 3], [2, 3]]  # and no step 4
    for _, failed in values:
        assert failed and "rank 1" in failed and "NoneType" in failed, failed
    assert ranksafe.verify_step(tmp_path / "step_00000003")["metrics"] == {"val_loss": 5.0}


def test_a_manifest_that_cannot_be_read_now_deletes_nothing_and_the_next_save_ranks_it(tmp_path, monkeypatch):
    """Before: an I/O error reading an earlier run's manifest counted as "no metric", for the rest of the process, so
    retention deleted the best step. Now that save deletes nothing, with a warning, and a later one ranks the steps."""
    root = tmp_path / "ckpt"
    first = ranksafe.CheckpointManager(root, keep=1, best_metric="loss", keep_best=1)
    for step, loss in ((1, 0.1), (2, 0.9)):
        first.save(step, {"w": torch.zeros(1)}, metrics={"loss": loss})
    assert [s.step for s in ranksafe.list_steps(root)] == [1, 2]
    read, failures = ranksafe.retention.read_manifest, []

    def flaky(place):
        if not failures:
            failures.append(place)
            raise OSError(5, "Input/output error (injected)", str(place))
        return read(place)

    monkeypatch.setattr(ranksafe.retention, "read_manifest", flaky)
    again = ranksafe.CheckpointManager(root, keep=1, best_metric="loss", keep_best=1)  # metrics come from manifests
    with pytest.warns(UserWarning, match="retention waits for a later save: .*Input/output error"):
        again.save(3, {"w": torch.zeros(1)}, metrics={"loss": 0.5})
    assert len(failures) == 1 and [s.step for s in ranksafe.list_steps(root)] == [1, 2, 3]
    again.save(4, {"w": torch.zeros(1)}, metrics={"loss": 0.7})
    assert [s.step for s in ranksafe.list_steps(root)] == [1, 4], "the best step and the newest"


def test_a_deletion_that_fails_after_the_commit_says_the_new_step_is_committed(tmp_path, monkeypatch):
    """Before: the save raised the deletion's error alone, and read as a failed save of a step that was committed."""
    root = tmp_path / "ckpt"
    mgr = ranksafe.CheckpointManager(root, keep=1)
    mgr.save(1, {"w": torch.zeros(1)})

    def refuse(self):
        raise PermissionError(13, "Permission denied (injected)", str(self.final))

    monkeypatch.setattr(ranksafe.commit.AtomicDir, "delete", refuse)
    with pytest.raises(PermissionError) as raised:
        mgr.save(2, {"w": torch.ones(1)})
    assert "step 2 is committed; retention could not delete step 1" in raised.value.__notes__[0]
    assert mgr.latest() == 2 and mgr.load()["w"].item() == 1.0
