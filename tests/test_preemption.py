"""Preemption: a stop signal, received by one rank or by all at different moments, becomes one committed checkpoint
of one step on every rank and a normal exit; the next launch resumes there. Real signals, real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ranksafe
from ranksafe.preemption import Signals
from ranksafe.schedule import SaveSchedule
from tests.ranks import LAUNCH_VARS, free_port, run_ranks, signal_when_at_step

TOTAL = 60  # steps of the schedule
EVERY = 20  # periodic saves


def test_signals_are_recorded_chained_and_put_back():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        signals = Signals((signal.SIGUSR1, signal.SIGTERM))
        signals.install()
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, handled between two bytecodes of this thread
        os.kill(os.getpid(), signal.SIGTERM)  # the default action would end the process: only recorded
        time.sleep(0.01)
        assert signals.received == signal.SIGUSR1 and seen == [signal.SIGUSR1]
        signals.uninstall()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert seen == [signal.SIGUSR1, signal.SIGUSR1] and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, previous)


_HANDLERS_OF_TWO = """
import os, signal, sys, time
from ranksafe.preemption import Signals
first, second = Signals([signal.SIGTERM]), Signals([signal.SIGTERM])
first.install(); second.install()
for s in {order}:
    s.uninstall()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(1)
print("alive")
"""


@pytest.mark.parametrize("order", ["first, second", "second, first"])
def test_two_recorders_uninstalled_in_any_order_leave_the_default_action(order):
    """Two managers with preemption, closed in either order: SIGTERM ends the process again, as before them."""
    code = _HANDLERS_OF_TWO.format(order=f"({order})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr)


def test_a_signal_that_cannot_be_handled_is_refused_and_an_install_that_fails_installs_none(monkeypatch):
    """Before: SIGKILL was taken, and every install raised a bare OSError (EINVAL), at a fit's start."""
    with pytest.raises(ValueError, match="SIGKILL cannot be handled by a process"):
        Signals((signal.SIGUSR2, signal.SIGKILL))
    signals = Signals((signal.SIGUSR2, signal.SIGUSR1))
    real = signal.signal

    def refusing_usr1(signum, handler):
        if signum == signal.SIGUSR1 and callable(handler):
            raise OSError(22, "Invalid argument")
        return real(signum, handler)

    monkeypatch.setattr(signal, "signal", refusing_usr1)
    with pytest.raises(OSError):
        signals.install()
    monkeypatch.undo()
    assert not signals.installed and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


_DROPPED_MANAGER = """
import gc, os, signal, sys, time
import ranksafe
manager = ranksafe.CheckpointManager(sys.argv[1], preemption=True)
del manager  # never closed: the README's loop does not close, and a loop that raises skips it
gc.collect()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(1)
print("alive")
"""


def test_a_manager_nobody_closed_stops_handling_signals_once_it_is_gone(tmp_path):
    """The signal module held the manager's handler, and with it the recorder: SIGTERM was recorded, and ignored, for
    the rest of the process."""
    done = subprocess.run([sys.executable, "-c", _DROPPED_MANAGER, str(tmp_path)], capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr[-2000:])


_SIGNAL_IN_CLOSE = """
import os, signal, sys, threading, time
import torch, ranksafe

class SlowToPickle:  # the background commit pickles it: close() waits for it a while
    def __reduce__(self):
        time.sleep(1.0)
        return (SlowToPickle, ())

root, stopped = sys.argv[1], sys.argv[2] == "stopped"
manager = ranksafe.CheckpointManager(root, preemption=True, async_save=True)
if stopped:  # SLURM's warning signal came first, and the loop stopped at an agreed step
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.01)
    assert manager.reached_preemption(3) or manager.reached_preemption(4)
manager.save(4, {"w": torch.ones(4), "slow": SlowToPickle()})
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()  # the time limit's SIGTERM, during close()
manager.close()
print("closed", flush=True)
"""


_SIGNAL_BEFORE_CLOSE = """
import os, signal, sys
import ranksafe

seen = []
signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
manager = ranksafe.CheckpointManager(sys.argv[1], preemption=True)
os.kill(os.getpid(), signal.SIGTERM)  # after the last step boundary: no stop answers it
manager.close()
print("handler calls", len(seen), flush=True)
"""


def test_a_handler_installed_before_the_manager_gets_an_unanswered_signal_once(tmp_path):
    """Before: close() raised the signal again after the handler had had it when it came: called twice."""
    done = subprocess.run([sys.executable, "-c", _SIGNAL_BEFORE_CLOSE, str(tmp_path)], capture_output=True, timeout=60)
    assert done.returncode == 0 and done.stdout == b"handler calls 1\n", (done.stdout, done.stderr[-2000:])


@pytest.mark.parametrize("stopped", [True, False])
def test_a_sigterm_while_close_waits_for_the_commit_lets_it_commit(tmp_path, stopped):
    """close() put the default handlers back before it waited for the background commit: a SIGTERM then ended the
    process and the step, agreed as the stop, never committed. Now the commit comes first. A signal that no agreed
    stop answered is raised again after it (the process ends, as SIGTERM asks); after a stop it was answered."""
    mode = "stopped" if stopped else "running"
    command = [sys.executable, "-c", _SIGNAL_IN_CLOSE, str(tmp_path), mode]
    done = subprocess.run(command, capture_output=True, timeout=60)
    assert [(s.step, s.status.value) for s in ranksafe.list_steps(tmp_path)] == [(4, "committed")], done.stderr[-2000:]
    if stopped:
        assert done.returncode == 0 and b"closed" in done.stdout, done.stderr[-2000:]
    else:
        assert done.returncode == -signal.SIGTERM and b"closed" not in done.stdout, done.stderr[-2000:]


def test_a_step_rule_save_restarts_the_seconds_interval():
    now = [0.0]
    schedule = SaveSchedule(save_interval_steps=10, save_interval_seconds=10, clock=lambda: now[0])
    saved = []
    for step in range(21):
        now[0] = float(step)  # the interval ends at the step the step rule saves: one save there, not two
        if schedule.should_save(step):
            schedule.saved()
            saved.append(step)
    assert saved == [0, 10, 20]


def test_a_single_process_schedule():
    now = [0.0]
    schedule = SaveSchedule(save_interval_steps=5, save_interval_seconds=10, preemption=True, clock=lambda: now[0])
    schedule.install()
    try:
        assert [s for s in range(12) if schedule.should_save(s)] == [0, 5, 10]
        now[0] = 11.0
        assert [schedule.should_save(s) for s in (12, 13, 14)] == [False, True, False]  # posted at 12, due at 13
        schedule.saved()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert [schedule.reached_preemption(s) for s in (16, 17)] == [False, True]
        assert schedule.should_save(17) and schedule.preempted
        assert schedule.should_save(17) and schedule.reached_preemption(17)  # asked twice: one answer
    finally:
        schedule.uninstall()


# --- real ranks, a DDP model, signals from outside --------------------------------------------------------------


def _train(rank, root, signal_at, async_save):
    """Train TOTAL steps of a DDP model, saving every EVERY steps and at preemption; resume from the latest."""
    Path(root, f"pid-{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mgr = ranksafe.CheckpointManager(
        Path(root, "ckpt"), keep=2, save_interval_steps=EVERY, preemption=True, async_save=async_save
    )
    start = 0
    if (latest := mgr.latest()) is not None:
        state = mgr.load()
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = latest + 1
    trained = []
    step = start
    for step in range(start, TOTAL):
        loss = model(torch.full((8, 4), float(step))).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        trained.append(step)
        Path(root, f"step-{rank}").write_text(str(step))
        if step == signal_at.get(rank):  # this rank's own signal, at its own moment
            os.kill(os.getpid(), signal.SIGUSR1 if rank % 2 else signal.SIGTERM)
        time.sleep(0.02)  # a step takes time: the outside signal lands mid-run
        if mgr.should_save(step) or step == TOTAL - 1:  # asked at every step, by every rank
            mgr.save(step, {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step})
        if mgr.preempted:
            break
    mgr.close()
    return {"trained": trained, "stopped": step, "preempted": mgr.preempted, "latest": mgr.latest()}


def _stopped_together_and_committed(values: list[dict]) -> int:
    stopped = {v["stopped"] for v in values}
    assert len(stopped) == 1, f"every rank must stop at the same step: {values}"
    step = stopped.pop()
    print(f"{len(values)} ranks stopped at step {step}")
    for v in values:
        assert v["preempted"] and v["latest"] == step, v
    return step


def test_a_signal_to_one_rank_stops_every_rank_at_one_committed_step_and_a_relaunch_finishes(tmp_path):
    sender = signal_when_at_step(tmp_path, 1, 25, signal.SIGTERM)
    first = run_ranks(_train, 2, args=(str(tmp_path), {}, False), timeout=120).values
    sender.join(1)
    stop = _stopped_together_and_committed(first)
    assert EVERY < stop < TOTAL - 1
    second = run_ranks(_train, 2, args=(str(tmp_path), {}, False), timeout=120).values
    for before, after in zip(first, second, strict=True):
        assert not after["preempted"] and after["latest"] == TOTAL - 1
        assert before["trained"] + after["trained"] == list(range(TOTAL)), "every step trained exactly once"


def test_four_ranks_signalled_at_different_moments_during_background_saves_stop_together(tmp_path):
    signal_at = {0: 31, 1: 27, 2: 34, 3: 29}  # each rank its own signal; rank 1's comes first
    values = run_ranks(_train, 4, args=(str(tmp_path), signal_at, True), timeout=180).values
    stop = _stopped_together_and_committed(values)
    assert 27 < stop <= 31, stop  # the first boundary every rank reaches after rank 1's signal
    assert ranksafe.CheckpointManager(tmp_path / "ckpt").load()["step"] == stop


def _stock(rank, root):
    """The control: the same loop without ranksafe's handler; SIGTERM ends the rank where it stands."""
    Path(root, f"pid-{rank}").write_text(str(os.getpid()))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(TOTAL):
        model(torch.full((8, 4), float(step))).sum().backward()
        opt.step()
        opt.zero_grad()
        Path(root, f"step-{rank}").write_text(str(step))
        time.sleep(0.02)
        if step % EVERY == 0 and rank == 0:
            torch.save({"step": step}, Path(root, "stock.pt"))
        dist.barrier()
    return step


def test_stock_control_loses_the_steps_since_the_last_periodic_save(tmp_path):
    sender = signal_when_at_step(tmp_path, 1, 25, signal.SIGTERM)
    ranks = run_ranks(_stock, 2, args=(str(tmp_path),), env={"TEST_PG_TIMEOUT": "5"}, timeout=60)
    sender.join(1)
    assert ranks[1].exitcode == -signal.SIGTERM and not ranks[0].ok  # killed; the other fails in the all-reduce
    saved = torch.load(tmp_path / "stock.pt")["step"]
    reached = int((tmp_path / "step-1").read_text())
    print(f"stock: killed at step {reached}, the last checkpoint holds step {saved}: {reached - saved} steps lost")
    assert reached - saved >= 5


_TORCHRUN_SCRIPT = """
import json, os, sys
sys.path.insert(0, sys.argv[2])
import torch.distributed as dist
dist.init_process_group("gloo")
from tests.test_preemption import _train
out = _train(dist.get_rank(), sys.argv[1], {}, False)
with open(os.path.join(sys.argv[1], f"out-{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
"""


def test_under_torchrun_a_signalled_worker_and_its_peer_exit_normally_at_one_committed_step(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    script = tmp_path / "train.py"
    script.write_text(_TORCHRUN_SCRIPT)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        str(script), str(tmp_path), str(Path(__file__).parent.parent),
    ]  # fmt: skip
    sender = signal_when_at_step(tmp_path, 0, 25, signal.SIGTERM)
    done = subprocess.run(cmd, env=env, timeout=180, capture_output=True, text=True)
    sender.join(1)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import json

    values = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(2)]
    _stopped_together_and_committed(values)


@pytest.mark.parametrize("seconds", [0.3])
def test_a_seconds_interval_is_decided_by_rank_0s_clock_whatever_the_others_read(tmp_path, seconds):
    values = run_ranks(_timed, 2, args=(seconds,), timeout=90).values
    naive = [v["naive"] for v in values]
    ours = [v["ours"] for v in values]
    disagreements = sum(a != b for a, b in zip(*naive, strict=True))
    print(f"steps where the ranks' own clocks disagreed: {disagreements}; ranksafe's decisions: {ours[0]}")
    assert disagreements > 0, "the control must show the skewed clock splitting the ranks"
    assert ours[0] == ours[1] and any(ours[0])


def _timed(rank, seconds):
    skew = 1000.0 if rank == 1 else 0.0  # rank 1's clock runs far ahead (another node, another time)
    clock = lambda: time.monotonic() + skew * (time.monotonic() > 0)  # noqa: E731
    schedule = SaveSchedule(save_interval_seconds=seconds, clock=clock, name="timed")
    start = clock()
    naive, ours, last = [], [], start
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    for step in range(40):
        model(torch.ones(1, 2)).sum().backward()  # the all-reduce that keeps the ranks a step apart at most
        time.sleep(0.02)
        now = clock()
        naive.append(now - last >= seconds if rank == 0 else now - start + skew >= seconds)
        if naive[-1]:
            last = now
        ours.append(schedule.should_save(step))
        if ours[-1]:
            schedule.saved()
    return {"naive": naive, "ours": ours}
