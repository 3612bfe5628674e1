"""Collectives on real ranks: agreement, shared failures, timeouts that name the missing ranks."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time

import pytest

import ranksafe
from ranksafe import collectives
from ranksafe import exchange as protocol
from ranksafe.notice import StepNotice
from tests.ranks import run_ranks


def _agree_all_ops(rank):
    value = [3.0, 1.0, 2.0][rank]
    flag = rank == 1
    out = {op: ranksafe.agree(value, op) for op in ("max", "min", "sum", "mean", "main")}
    out["all"] = ranksafe.agree(flag, "all")
    out["any"] = ranksafe.agree(flag, "any")
    out["nan_max"] = ranksafe.agree(math.nan if rank == 2 else float(rank), "max")
    out["bcast"] = ranksafe.broadcast({"from": rank}, src=1)
    out["gather"] = ranksafe.all_gather(rank * 10)
    return out


def test_agree_gives_every_rank_the_same_answer_from_different_values():
    values = run_ranks(_agree_all_ops, 3).values
    for v in values:
        assert (v["max"], v["min"], v["sum"], v["mean"], v["main"]) == (3.0, 1.0, 6.0, 2.0, 3.0)
        assert (v["all"], v["any"]) == (False, True)
        assert math.isnan(v["nan_max"])  # a NaN anywhere wins everywhere, whatever its position
        assert v["bcast"] == {"from": 1}
        assert v["gather"] == [0, 10, 20]


def _rank1_raises(rank):
    start = time.monotonic()
    try:
        with ranksafe.together("step"):
            if rank == 1:
                raise ValueError("bad batch on rank 1")
    except ranksafe.RankFailure as e:
        cause = type(e.__cause__).__name__ if e.__cause__ else None
        return {
            "ranks": e.ranks, "isvalue": isinstance(e, ValueError), "msg": str(e), "cause": cause,
            "seconds": time.monotonic() - start,
        }  # fmt: skip
    return "no error"


def test_together_raises_on_every_rank_within_seconds():
    values = run_ranks(_rank1_raises, 3).values
    for rank, v in enumerate(values):
        assert v != "no error", f"rank {rank} did not raise"
        assert v["ranks"] == [1]
        assert v["isvalue"], "a built-in error type is preserved on every rank"
        assert "bad batch on rank 1" in v["msg"]
        assert v["seconds"] < 5
    assert values[1]["cause"] == "ValueError"  # the failing rank chains its original exception
    assert values[0]["cause"] is None


def _count_exchanges(rank):
    ranksafe.barrier("warm")
    before = protocol._session.seq
    with ranksafe.together("quiet"):
        pass
    return protocol._session.seq - before


def test_together_costs_one_exchange_when_nothing_fails():
    assert run_ranks(_count_exchanges, 2).values == [1, 1]


def _late_rank(rank, missing):
    start = time.monotonic()
    if rank == missing:
        time.sleep(4)  # past the others' 2 s timeout, with room for their start
        return "slept"
    try:
        ranksafe.barrier("sync", timeout=2)
    except ranksafe.BarrierTimeout as e:
        return {"missing": e.missing, "seconds": time.monotonic() - start, "msg": str(e)}
    return "passed"


def test_barrier_timeout_names_the_missing_rank():
    for missing in (1, 0):  # a missing worker, and a missing main (which collects the arrivals)
        res = run_ranks(_late_rank, 3, args=(missing,))
        for r in range(3):
            if r == missing:
                continue
            v = res[r].value
            assert isinstance(v, dict), f"rank {r}: {res[r].error or v}"
            assert v["missing"] == [missing]
            assert v["seconds"] < 2 + 2
            assert f"rank(s) {missing}" in v["msg"]
            assert v["msg"].startswith("barrier:sync")  # named after the caller's barrier, even as the first one


def _dies(rank):
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        ranksafe.barrier("after crash", timeout=3)
    except ranksafe.BarrierTimeout as e:
        return e.missing, time.monotonic() - start
    return "passed"


def test_a_dead_rank_becomes_a_timeout_naming_it():
    res = run_ranks(_dies, 2)
    assert res[1].exitcode == 3
    missing, seconds = res[0].value
    assert missing == [1] and seconds < 5


def _diverged(rank):
    try:
        if rank == 0:
            ranksafe.barrier("save")
        else:
            ranksafe.agree(True, name="is new best")
    except ranksafe.CollectiveMismatch as e:
        return str(e)
    return "no error"


def test_ranks_in_different_collectives_get_a_mismatch_not_a_hang():
    res = run_ranks(_diverged, 2, timeout=60)
    for msg in res.values:
        assert "barrier:save" in msg and "is new best" in msg


def _main_first(rank, fail_on_main, path):
    ran = False
    try:
        with ranksafe.main_first("prep"):
            ran = True
            if rank == 0:
                time.sleep(0.5)
                if fail_on_main:
                    raise OSError("download failed")
            with open(path, "a") as f:
                f.write(f"{rank}\n")
    except ranksafe.RankFailure as e:
        return {"ran": ran, "error": str(e)}
    return {"ran": ran, "error": None}


def test_main_first_runs_main_before_the_others(tmp_path):
    log = tmp_path / "order"
    values = run_ranks(_main_first, 3, args=(False, str(log))).values
    assert all(v == {"ran": True, "error": None} for v in values)
    assert log.read_text().split()[0] == "0"  # main wrote first although it slept


def test_main_first_failure_on_main_stops_the_others(tmp_path):
    values = run_ranks(_main_first, 3, args=(True, str(tmp_path / "order"))).values
    assert values[0]["ran"] and not values[1]["ran"] and not values[2]["ran"]
    for v in values:
        assert "rank 0" in v["error"] and "download failed" in v["error"]


def test_single_process_collectives_are_local(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert ranksafe.agree(2.5, "max") == 2.5
    assert ranksafe.broadcast("x") == "x"
    ranksafe.barrier()
    try:
        with ranksafe.together("one"):
            raise KeyError("k")
    except KeyError as e:  # one process: the original error, unchanged
        assert e.args == ("k",)
    else:
        raise AssertionError("together swallowed the error")


def test_launcher_without_process_group_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    try:
        ranksafe.barrier()
    except RuntimeError as e:
        assert "init_process_group" in str(e)
    else:
        raise AssertionError("barrier passed without a process group")


def _fails_alone(rank, guarded):
    start = time.monotonic()
    try:
        if rank == 1:
            if guarded:
                with ranksafe.abort_on_error():
                    raise OSError(28, "No space left on device (writing the CSV log)")
            raise OSError(28, "No space left on device (writing the CSV log)")
        ranksafe.barrier("next epoch", timeout=8)  # rank 0 goes on to the next collective
    except (ranksafe.RankFailure, OSError) as e:
        return {"type": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - start}
    return "no error"


def test_abort_reaches_waiting_ranks_at_once_instead_of_the_timeout():
    unguarded = run_ranks(_fails_alone, 2, args=(False,)).values
    guarded = run_ranks(_fails_alone, 2, args=(True,)).values
    print("rank 0 without abort:", unguarded[0], "\nrank 0 with abort:", guarded[0])
    assert unguarded[0]["type"] == "BarrierTimeout" and unguarded[0]["seconds"] >= 8  # the control waits it out
    assert guarded[0]["type"] == "RankFailure[OSError]" and guarded[0]["seconds"] < 5  # the 2 s grace, not 8 s
    assert "rank 1" in guarded[0]["msg"] and "No space left" in guarded[0]["msg"]
    assert guarded[1]["type"] == "OSError"  # the failing rank keeps its own error


def _outcome(call) -> str:
    try:
        call()
    except ranksafe.RankFailure as e:
        return f"RankFailure: {e.failures[0]}"
    return "ok"


def _after_aborts(rank):
    """Both ranks abort (the same error on every rank, as a Lightning on_exception on all of them), then meet."""
    out = []
    ranksafe.barrier("warm")
    collectives.abort(ValueError("the same error on every rank"))
    time.sleep(0.5 if rank == 0 else 0)  # rank 0 arrives late (writing a file inside together()), within the grace
    out.append(_outcome(lambda: ranksafe.barrier("in time")))
    time.sleep(3 if rank == 0 else 0)  # every rank took part above, so the aborts no longer stand: no grace now
    out.append(_outcome(lambda: ranksafe.barrier("after the aborts were withdrawn")))
    collectives.abort(ValueError("rank failed again"))
    time.sleep(3 if rank == 0 else 0)  # past the grace: the exchange gives up on rank 0, on both ranks
    out.append(_outcome(lambda: ranksafe.barrier("too late")))
    return out


def test_after_an_abort_every_rank_leaves_an_exchange_with_the_same_outcome():
    values = run_ranks(_after_aborts, 2, timeout=90).values
    print(values)
    assert values[0] == values[1]  # no rank went on while the other raised: that split the ranks
    assert values[0][:2] == ["ok", "ok"]
    assert values[0][2].startswith("RankFailure: rank ") and "rank failed again" in values[0][2]


def _withdrawn_while_waiting(rank):
    """Rank 1 waits in an exchange and its abort grace ends in the moment between rank 0 withdrawing the abort
    (every rank has posted) and rank 0 writing the result, a moment widened here by a slow result write."""
    decide = protocol._decide

    def slow_decide(*args):
        time.sleep(2.0)  # the abort is withdrawn; rank 1's grace ends meanwhile
        return decide(*args)

    ranksafe.barrier("warm")
    if rank == 0:
        collectives.abort(ValueError("rank 0 failed, caught it and goes on"))
        time.sleep(1.0)  # rank 1 waits below; its 2 s grace runs
        protocol._decide = slow_decide
    else:
        time.sleep(0.2)  # rank 0's abort is posted: rank 1's wait below notices it at once
    out = [_outcome(lambda: ranksafe.barrier("every rank arrives"))]
    protocol._decide = decide
    out.append(_outcome(lambda: ranksafe.barrier("next")))
    return out


def test_an_abort_withdrawn_while_a_rank_gives_up_does_not_fail_a_complete_exchange():
    values = run_ranks(_withdrawn_while_waiting, 2, timeout=60).values
    print(values)
    # before: rank 1 decided an abort naming no rank, and both ranks raised a RankFailure without failures
    assert values[0] == values[1] == ["ok", "ok"]


class _SlowReads:
    """A store whose checks and gets of keys containing ``part`` wait first: the time between a rank's check of a
    key and its get, in which another rank withdraws what the key held."""

    def __init__(self, store, part: str, check_delay: float = 0.0, get_delay: float = 0.0):
        self._store, self._part, self._check_delay, self._get_delay = store, part, check_delay, get_delay

    def check(self, keys):
        if any(self._part in k for k in keys):
            time.sleep(self._check_delay)
        return self._store.check(keys)

    def get(self, key):
        if self._part in key:
            time.sleep(self._get_delay)
        return self._store.get(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _abort_withdrawn_while_read(rank):
    ranksafe.barrier("warm")
    if rank == 1:  # fails, catches its error and goes on; reads aborts slowly from here
        collectives.abort(OSError(28, "disk full (rank 1 caught it and goes on)"))
        protocol._session.store = _SlowReads(protocol._session.store, "/abort/", get_delay=1.0)
    else:
        time.sleep(2.5)  # rank 0 arrives after rank 1's grace: rank 1 reads the aborts, rank 0 withdraws them
    start = time.monotonic()
    out = _outcome(lambda: ranksafe.barrier("every rank arrives"))
    return out, time.monotonic() - start


def test_an_abort_withdrawn_while_another_rank_reads_it_leaves_no_rank_waiting_for_the_store():
    """Before: rank 0 deleted the stale abort between rank 1's check of its key and the get, and a get of a missing
    key waits for the store's timeout (the process group's, 30 minutes by default; 8 s here). Rank 0 went on, and
    rank 1 raised "lost the rendezvous store" after it."""
    values = run_ranks(_abort_withdrawn_while_read, 2, timeout=60, env={"TEST_PG_TIMEOUT": "8"}).values
    assert [v[0] for v in values] == ["ok", "ok"], values
    assert values[1][1] < 6, values  # rank 1 waited for rank 0's arrival (2.5 s) and its reads, not the store


def _fails_catches_and_goes_on(rank, path):
    """Rank 1 fails alone, catches its error and goes on to an emergency save; rank 0 waits for the next epoch."""
    out = []
    ranksafe.barrier("warm")
    start = time.monotonic()
    try:
        with ranksafe.abort_on_error():
            if rank == 1:
                raise OSError(28, "No space left on device (injected on rank 1)")
            ranksafe.barrier("next epoch")
    except (ranksafe.RankFailure, OSError) as e:
        out.append((type(e).__name__, str(e)[:300], round(time.monotonic() - start, 1)))
    start = time.monotonic()
    try:
        ranksafe.save({"w": 1}, path)  # the emergency save both ranks make on the way out
        out.append("saved")
    except ranksafe.RankFailure as e:
        out.append((type(e).__name__, str(e)[:300], round(time.monotonic() - start, 1)))
    return out


def test_a_rank_that_fails_alone_and_goes_on_is_reported_and_later_collectives_do_not_hang(tmp_path):
    """Before: rank 1's save met rank 0's barrier: CollectiveMismatch on both, the abort withdrawn (every rank had
    posted), and rank 0's own save then waited for rank 1, a step ahead, for the whole timeout. Then: rank 1's save
    ended rank 0's barrier with rank 1's error, and rank 0's save failed after the grace, rank 1 being gone from it.
    Now rank 1's save is its next collective, and rank 0's: both save."""
    r0, r1 = run_ranks(
        _fails_catches_and_goes_on, 2, args=(str(tmp_path / "m.pth"),), env={"RANKSAFE_TIMEOUT": "20"}, timeout=90
    ).values
    print(r0, r1, sep="\n")
    assert r1[0][0] == "OSError"  # the failing rank keeps its own error
    kind, msg, _ = r0[0]  # rank 0's barrier: the cause, not a mismatch
    assert kind == "RankFailure[OSError]" and "rank 1" in msg and "No space left" in msg
    assert r0[1] == r1[1] == "saved"


def _fails_inside_together(rank, scenario):
    """Rank 1 fails inside a shared block while rank 0 is still inside it, in a barrier; then both meet again.

    ``inner``: an ``OSError``; ``interrupt``: a KeyboardInterrupt; ``slow``: rank 1 takes 3 s to leave the block
    after its abort (posted by abort_on_error); ``killed``: rank 1 is killed right after the block (SIGKILL)."""
    ranksafe.barrier("warm")
    start = time.monotonic()
    out = {}
    try:
        with ranksafe.together("epoch", timeout=20):
            if rank == 1:
                try:
                    with ranksafe.abort_on_error():  # posts the failure on its way out
                        raise KeyboardInterrupt if scenario == "interrupt" else OSError(28, "No space left on device")
                finally:
                    time.sleep(3 if scenario == "slow" else 0)  # a clean-up, after the abort, before the block ends
            ranksafe.barrier("inside the epoch", timeout=20)
    except BaseException as e:
        cause = e.__cause__
        out = {"type": type(e).__name__, "msg": str(e)[:300], "cause": type(cause).__name__ if cause else None}
    out["seconds"] = time.monotonic() - start
    if rank == 1 and scenario == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    out["after"] = _outcome(lambda: ranksafe.barrier("after the epoch", timeout=20))
    out["after seconds"] = time.monotonic() - start
    return out


@pytest.mark.parametrize("scenario", ["inner", "interrupt", "slow", "killed"])
def test_a_failure_inside_together_reaches_a_rank_still_in_the_block_and_leaves_the_ranks_in_step(scenario):
    """Before: rank 1's outcome of the block met rank 0's barrier inside it: CollectiveMismatch on both ranks, the
    disk-full error on neither. With the error shared, rank 0 still ran the block's outcome exchange, which met rank
    1's next barrier (CollectiveMismatch again, the ranks out of step); so did a rank 1 slow to leave the block, given
    up on after the grace. A rank 1 killed after the block is named after the grace, not waited for."""
    ranks = run_ranks(_fails_inside_together, 2, args=(scenario,), timeout=60)
    r0, r1 = ranks[0].value, ranks[1].value
    print(r0, r1, sep="\n")
    interrupt = scenario == "interrupt"
    shared = "RankFailure" if interrupt else "RankFailure[OSError]"  # KeyboardInterrupt mixes with no RankFailure
    error = "KeyboardInterrupt" if interrupt else "OSError: [Errno 28] No space left"
    assert r0["type"] == shared and f"rank 1: {error}" in r0["msg"] and r0["cause"] is None, r0
    slow = 3 if scenario == "slow" else 0
    assert r0["seconds"] < slow + 3, r0
    if scenario == "killed":
        assert ranks[1].exitcode == -signal.SIGKILL, ranks[1]
        assert r0["after"] == f"RankFailure: rank 1: {error} on device" and r0["after seconds"] < 5, r0
        return
    if interrupt:  # no Exception: the failing rank gets its own, as in a single process
        assert r1["type"] == "KeyboardInterrupt", r1
    else:  # the shared error, its own chained
        assert r1["type"] == shared and f"rank 1: {error}" in r1["msg"] and r1["cause"] == "OSError", r1
    assert r1["seconds"] < slow + 3, r1
    assert r0["after"] == r1["after"] == "ok", (r0, r1)  # in step again


def _one_gone_one_failed(rank):
    """Rank 2 aborts and is killed; rank 1 fails inside the block; rank 0 waits in a barrier inside it."""
    ranksafe.barrier("warm")
    if rank == 2:
        ranksafe.abort(ValueError("rank 2 gave up"))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        with ranksafe.together("epoch", timeout=20):
            if rank == 1:
                raise OSError(28, "No space left on device")
            ranksafe.barrier("inside the epoch", timeout=20)
    except ranksafe.RankFailure as e:
        return sorted((f.rank, f.type_name) for f in e.failures)


def test_a_verdict_given_up_on_a_gone_rank_names_the_ranks_that_failed_beside_it():
    """Before: rank 0 gave up on rank 2 after the grace and named rank 2 alone: rank 1's disk-full error, posted
    since the exchange before, was not in the verdict its block ended with."""
    ranks = run_ranks(_one_gone_one_failed, 3, timeout=60)
    assert ranks[2].exitcode == -signal.SIGKILL
    both = [(1, "builtins.OSError"), (2, "builtins.ValueError")]
    assert ranks[0].value == ranks[1].value == both, (ranks[0], ranks[1])


def _main_fails_alone(rank):
    ranksafe.barrier("warm")
    start = time.monotonic()
    try:
        with ranksafe.abort_on_error():
            if rank == 0:  # then this process exits, and with it the store it hosts (mp.spawn, tcp://)
                raise OSError(28, "No space left on device (the CSV log on rank 0)")
            ranksafe.barrier("next epoch", timeout=20)
    except (ranksafe.RankFailure, OSError) as e:
        return {"type": type(e).__name__, "msg": str(e)[:300], "seconds": time.monotonic() - start}
    return "no error"


def test_the_failure_of_a_rank_0_that_hosts_the_store_reaches_the_others_before_it_exits():
    """Before: rank 0 exited at once, and rank 1 raised "lost the rendezvous store", naming itself and no cause."""
    r0, r1 = run_ranks(_main_fails_alone, 2, timeout=60).values
    print(r0, r1, sep="\n")
    assert r0["type"] == "OSError"
    assert r1["type"] == "RankFailure[OSError]" and "rank 0" in r1["msg"] and "No space left" in r1["msg"], r1
    assert r1["seconds"] < 10


def _main_alone(rank, path):
    ranksafe.barrier("warm")
    if rank == 1:
        return "finished"  # the script ends: the save below is rank 0's alone, as `if rank == 0: learn.export()`
    start = time.monotonic()
    try:
        ranksafe.save({"w": 1}, path)
    except ranksafe.RankFailure as e:
        return {"type": type(e).__name__, "msg": str(e)[:300], "seconds": time.monotonic() - start}
    return "saved"


def test_a_collective_that_only_one_rank_reaches_fails_soon_after_the_other_exits(tmp_path):
    """Before: rank 0 waited in its save for rank 1, which had ended, for the whole timeout (30 minutes by
    default); now the exiting rank says it is gone, and the save gives up after the grace, naming it."""
    r0, r1 = run_ranks(_main_alone, 2, args=(str(tmp_path / "m.pth"),), env={"RANKSAFE_TIMEOUT": "30"}).values
    assert r1 == "finished"
    assert r0["type"] == "RankFailure" and "rank 1" in r0["msg"] and "ended" in r0["msg"], r0
    assert r0["seconds"] < 10


def _fails_then_in_step_with_a_late_rank(rank):
    """Rank 1 fails alone, catches its error and goes on; then both go on in step, and rank 0 reaches the next
    barrier 3 s after rank 1 (it validates longer)."""
    ranksafe.barrier("warm")
    with contextlib.suppress(OSError), ranksafe.abort_on_error():  # rank 0's RankFailure[OSError], rank 1's own
        if rank == 1:
            raise OSError(28, "No space left on device (injected on rank 1)")
        ranksafe.barrier("next epoch")
    if rank == 0:
        time.sleep(3)
    start = time.monotonic()
    ranksafe.barrier("epoch 2")  # rank 1, present and waiting, is not gone: no failure for its old error
    return time.monotonic() - start


def test_after_the_ranks_fell_out_of_step_and_back_a_late_rank_is_waited_for():
    """Before: the abort that stood for rank 1 failed the next barrier after the 2 s grace, though rank 1 was
    there and only rank 0 was late."""
    waited = run_ranks(_fails_then_in_step_with_a_late_rank, 2, env={"RANKSAFE_TIMEOUT": "20"}, timeout=60).values
    assert waited[0] < 1 and 2.5 < waited[1] < 10


def _fails_alone_and_goes_on_then_agrees(rank, tmp):
    """Rank ``failing`` fails alone in a block where the others wait in a barrier, catches its error, and every rank
    goes on to agree on a value per epoch: first (``late`` False) or after the others gave up on it."""
    marker = os.path.join(tmp, "gave-up")
    out = {}
    ranksafe.barrier("warm", timeout=20)
    for failing, late in [(1, False), (1, True), (0, False), (0, True)]:
        try:
            with ranksafe.abort_on_error():
                if rank == failing:
                    raise ValueError(f"boom on rank {rank}")
                ranksafe.barrier("epoch end", timeout=20)
        except Exception as e:
            caught = type(e).__name__
        if rank != failing:
            open(marker, "w").close()  # it raised: the exchange it was in is over
        elif late:
            while not os.path.exists(marker):
                time.sleep(0.05)
        agreed = []
        for epoch in range(3):
            try:
                agreed.append(ranksafe.agree(epoch * 10 + rank, op="max", timeout=20))
            except ranksafe.RankFailure as e:
                agreed.append(type(e).__name__)
        ranksafe.barrier("scenario end", timeout=20)
        if rank == 0 and os.path.exists(marker):
            os.remove(marker)
        ranksafe.barrier("marker removed", timeout=20)
        out[(failing, late)] = (caught, agreed)
    return out


def test_a_rank_that_failed_alone_and_goes_on_takes_part_in_the_same_collectives_as_the_others(tmp_path):
    """Before: the exchange that ended the others' barrier was also the failed rank's next collective (an ``agree``
    of epoch 0), which raised its error again there, and each later ``agree`` of that rank paired with the next one
    of the others, with no error: the others took epoch 1's value for epoch 0's (11 where every rank agreed on 1)."""
    values = run_ranks(
        _fails_alone_and_goes_on_then_agrees, 2, args=(str(tmp_path),), env={"RANKSAFE_TIMEOUT": "20"}, timeout=120
    ).values
    print(values)
    for failing, late in values[0]:
        for rank in (0, 1):
            caught, agreed = values[rank][(failing, late)]
            assert caught == ("ValueError" if rank == failing else "RankFailure[ValueError]"), (failing, late, rank)
            assert agreed == [1, 11, 21], (failing, late, rank, agreed)


def _every_rank_fails(rank, fail):
    ranksafe.barrier("warm")
    if fail:  # a Ctrl-C, or Lightning's on_exception, on every rank
        collectives.abort(KeyboardInterrupt())
    return "done"


def test_rank_0_does_not_wait_at_exit_for_ranks_that_failed_too():
    """Before: a rank 0 that had aborted waited 5 s at exit for the next exchange, which no failed rank enters."""
    clean = run_ranks(_every_rank_fails, 2, args=(False,), timeout=60)
    failed = run_ranks(_every_rank_fails, 2, args=(True,), timeout=60)
    assert clean.values == failed.values == ["done", "done"]
    print(f"clean {clean.elapsed:.1f} s, every rank failed {failed.elapsed:.1f} s")
    assert failed.elapsed - clean.elapsed < 2.5


def _tensors_and_bad_src(rank):
    import numpy as np
    import torch

    out = {
        "main tensor": ranksafe.agree(torch.tensor([0.25, 0.75]) if rank == 0 else None, "main"),
        "main one-element": ranksafe.agree(torch.tensor([5.0]) if rank == 0 else None, "main"),
        "max 0-d": ranksafe.agree(torch.tensor(float(rank)), "max"),
        "sum numpy": ranksafe.agree(np.float32(rank + 0.5), "sum"),
    }
    try:
        ranksafe.agree(torch.tensor([1.0, 2.0]), "max")
    except ranksafe.RankFailure as e:
        out["max of two elements"] = type(e).__name__
    for src in (-1, 2):
        try:
            out[f"src {src}"] = ranksafe.broadcast("x", src=src)
        except ValueError as e:
            out[f"src {src}"] = str(e)
    return out


def test_agree_main_passes_any_object_and_broadcast_refuses_a_rank_that_does_not_exist():
    """agree(tensor, "main") called .item() on any value that had it: a tensor of two raised on rank 0 alone (the
    other ranks waited for it) and a tensor of one came back as a float. broadcast(src=-1) gave None everywhere."""
    values = run_ranks(_tensors_and_bad_src, 2).values
    for v in values:
        assert v["main tensor"].tolist() == [0.25, 0.75] and v["main one-element"].tolist() == [5.0]
        assert v["max 0-d"] == 1.0 and v["sum numpy"] == 2.0
        assert v["max of two elements"] == "RankFailure[RuntimeError]"  # one error everywhere, not a hang
        assert (
            v["src -1"]
            == v["src 2"].replace("src=2", "src=-1")
            == "broadcast: src=-1 is not a rank of this group (0 to 1)"
        )


def _mixed_types(rank):
    try:
        ranksafe.agree("a string" if rank == 0 else 1.0, "max")
    except ranksafe.RankFailure as e:
        return type(e).__name__, e.ranks
    return "no error"


def test_a_reduction_that_cannot_combine_the_values_is_one_error_on_every_rank():
    assert run_ranks(_mixed_types, 2).values == [("RankFailure[TypeError]", [0])] * 2


def _unpicklable(rank):
    import threading

    out = []
    for call in (
        lambda: ranksafe.broadcast(threading.Lock() if rank == 1 else None, src=1),  # a value rank 1 cannot post
        lambda: protocol.exchange("reduced", rank, lambda _: threading.Lock()),  # an outcome rank 0 cannot post
        lambda: ranksafe.barrier("still in step"),
    ):
        start = time.monotonic()
        try:
            call()
            out.append("ok")
        except ranksafe.RankFailure as e:
            out.append((type(e).__name__, e.ranks, time.monotonic() - start < 5))
    return out


def test_a_value_or_outcome_that_cannot_be_pickled_is_one_error_on_every_rank_at_once():
    """Before: the rank that could not pickle raised TypeError alone, before posting; the others waited the whole
    timeout (20 s here) and named it as missing, and the ranks stayed one exchange apart."""
    values = run_ranks(_unpicklable, 2, env={"RANKSAFE_TIMEOUT": "20"}, timeout=120).values
    assert values == [[("RankFailure[TypeError]", [1], True), ("RankFailure[TypeError]", [0], True), "ok"]] * 2


def test_exchange_outcome_in_a_single_process_returns_the_reduction_or_raises_the_error_itself(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert collectives.exchange_outcome("values", 3, None, sum) == 3
    error = FileNotFoundError(2, "gone", "/x")
    with pytest.raises(FileNotFoundError) as raised:
        collectives.exchange_outcome("values", 3, error, sum)
    assert raised.value is error


def _posts_and_fails(rank):
    """Rank 1 posts a value and a failure; rank 0 a value only."""
    error = OSError(28, "No space left on device", f"/ckpt/r{rank}") if rank == 1 else None
    try:
        collectives.exchange_outcome("written", rank * 10, error, list)
    except ranksafe.RankFailure as e:
        return type(e).__name__, e.ranks, getattr(e, "errno", None), type(e.__cause__).__name__
    return "no error"


def test_exchange_outcome_raises_one_rank_failure_on_every_rank_with_the_cause_on_the_failing_one():
    values = run_ranks(_posts_and_fails, 2).values
    assert values == [("RankFailure[OSError]", [1], 28, "NoneType"), ("RankFailure[OSError]", [1], 28, "OSError")]


# -- exit -----------------------------------------------------------------------------------------------------


def _others_alone(rank):
    ranksafe.barrier("warm")
    if rank == 0:
        return "finished"  # the script ends on rank 0, which hosts the store (mp.spawn, tcp://)
    start = time.monotonic()
    try:
        ranksafe.barrier("a collective rank 0 never reaches")
    except ranksafe.RankFailure as e:
        return {"type": type(e).__name__, "msg": str(e)[:300], "seconds": time.monotonic() - start}
    return "passed"


def test_a_collective_that_rank_0_never_reaches_fails_naming_rank_0_after_it_ended():
    """Before: rank 0 left at once, with the store, and rank 1 raised "lost the rendezvous store", naming itself
    and no cause. Now rank 0 posts that it ended, then stays until rank 1 has heard of it and left."""
    r0, r1 = run_ranks(_others_alone, 2, env={"RANKSAFE_TIMEOUT": "30"}, timeout=60).values
    assert r0 == "finished"
    assert r1["type"] == "RankFailure" and "rank 0" in r1["msg"] and "ended" in r1["msg"], r1
    assert r1["seconds"] < 10


def _outlives_rank_0(rank, probe):
    if not probe:
        collectives._store_answers = lambda store: True  # the naive exit: post the marker to whatever store there is
    ranksafe.barrier("warm")
    if rank == 1:
        time.sleep(4)  # misses the next barrier; rank 0 gives up on it and ends, taking the store along
        return "late"
    with contextlib.suppress(ranksafe.BarrierTimeout):
        ranksafe.barrier("without rank 1", timeout=1)
    return "done"


def test_a_rank_that_exits_after_the_store_is_gone_makes_no_request_to_it(capfd):
    """A request to a TCP store whose host has exited makes c10d print a C++ trace that Python cannot catch; the
    exit marker is posted only after one plain connect found the store there."""
    traces = {}
    for probe in (False, True):
        capfd.readouterr()
        assert run_ranks(_outlives_rank_0, 2, args=(probe,), timeout=60).values == ["done", "late"]
        traces[probe] = capfd.readouterr().err.count("Exception raised from")
    print("C++ traces at exit: without the probe", traces[False], "with it", traces[True])
    assert traces[False] > 0 and traces[True] == 0


# -- step notices and the per-step check -----------------------------------------------------------------------


def test_a_step_notice_in_a_single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    notice = StepNotice("stop")
    assert notice.poll() is None
    assert notice.post("first").payload == "first"
    assert notice.post("second").payload == "first"  # written once
    due = notice.poll()
    assert (due.at, due.payload) == (2, "first") and notice.count == 2
    assert notice.poll() is None  # acted on
    notice.post("third")
    notice.withdraw()
    assert notice.poll() is None


def _both_post_then_late(rank):
    ranksafe.barrier("warm")
    notice = StepNotice("test")
    notice.poll()
    standing = notice.post(f"rank {rank}")  # both post at boundary 1: one notice, the first written
    ranksafe.barrier("posted")
    due = notice.poll()
    # rank 1 polls 3 boundaries more than rank 0 before a notice is there: it reads one that is past
    if rank == 1:
        for _ in range(3):
            assert notice.poll() is None
    ranksafe.barrier("rank 1 ran ahead")
    if rank == 0:
        notice.poll()
        notice.post("to the rank ahead")  # due at rank 0's boundary 4; rank 1 is at its 5th
    ranksafe.barrier("posted again")
    late = notice.poll()
    return standing.payload, (due.at, due.payload), notice.count, (late.at, late.payload)


def test_a_notice_is_written_once_and_a_rank_past_its_boundary_gets_it_at_once():
    r0, r1 = run_ranks(_both_post_then_late, 2).values
    assert r0[0] == r1[0] and r0[0] in ("rank 0", "rank 1")
    assert r0[1] == r1[1] == (2, r0[0])
    assert (r0[2], r0[3]) == (4, (4, "to the rank ahead"))  # due now
    assert (r1[2], r1[3]) == (6, (4, "to the rank ahead"))  # past: at once, not never


def _training(rank, root, naive):
    """Ten data-parallel steps (one all-reduce each); rank 1's background save at step 3 fails. The failing rank
    stays in its exception handling for a while (a framework's teardown, an emergency save)."""
    import torch
    import torch.distributed as dist

    if rank == 1:
        open(os.path.join(root, "r1"), "w").close()  # a file where rank 1's checkpoint directory should be
    saver = ranksafe.AsyncSaver(writer="all")
    ranksafe.barrier("warm")
    step, last = 0, time.monotonic()
    try:
        for step in range(1, 11):
            dist.all_reduce(torch.ones(1))
            last = time.monotonic()
            if naive and saver.failed:
                raise saver.error  # this rank alone, at once
            if not naive:
                saver.poll()
            if step == 3:
                saver.save({"w": torch.ones(4)}, os.path.join(root, f"r{rank}", "w.pt"))
                saver.wait()
    except Exception as e:
        out = {"step": step, "type": type(e).__name__, "blocked": round(time.monotonic() - last, 1)}
        if rank == 1:
            time.sleep(4)
        return out
    return {"step": step, "type": None}


def test_a_background_failure_is_raised_on_every_rank_at_the_same_step(tmp_path):
    """The naive check raises on the failing rank alone, and the other rank blocks in the next all-reduce, where
    no ranksafe collective can reach it, until the backend gives up; the per-step check raises on both at the
    same step."""
    env = {"TEST_PG_TIMEOUT": "6"}
    for kind in ("naive", "poll"):
        os.makedirs(tmp_path / kind)
    naive = run_ranks(_training, 2, args=(str(tmp_path / "naive"), True), env=env, timeout=90)
    ours = run_ranks(_training, 2, args=(str(tmp_path / "poll"), False), env=env, timeout=90).values
    print("naive:", [r.value or r.error for r in naive.results], "\nper-step check:", ours)
    assert naive[1].value["step"] == 4  # rank 1 noticed its failure after step 4 and raised
    assert naive[0].value["step"] == 5 and naive[0].value["blocked"] >= 3.5  # rank 0 waited in step 5's all-reduce
    assert not naive[0].value["type"].startswith("RankFailure")  # then got the backend's error, naming no cause
    for v in ours:  # rank 1 posted after step 4; both raised after step 5, at once
        assert v["step"] == 5 and v["type"].startswith("RankFailure") and v["blocked"] < 2, v


def _steps_cost(rank, steps):
    ranksafe.barrier("warm")
    saver = ranksafe.AsyncSaver(writer="all")
    saver.poll()  # the first use of the notice: no store request but its read
    counting = _CountingStore(protocol._session.store)
    protocol._session.store = counting
    try:
        if rank == 0:
            time.sleep(2)  # rank 1 polls meanwhile: nothing waits for rank 0
        start = time.monotonic()
        for _ in range(steps):
            saver.poll()
        poll = counting.requests, time.monotonic() - start
        counting.requests = 0
        for _ in range(steps):
            saver.check()
        check = counting.requests
    finally:
        protocol._session.store = counting.store
    return poll, check


class _CountingStore:
    """A store that counts the requests made through it."""

    def __init__(self, store):
        self.store, self.requests = store, 0

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.requests += 1
            return attr(*args, **kwargs)

        return counted


def test_the_per_step_check_costs_one_store_request_and_waits_for_no_rank():
    steps = 50
    values = run_ranks(_steps_cost, 2, args=(steps,)).values
    print("(poll requests, seconds), check requests:", values)
    for (requests, _), check in values:
        assert requests == steps  # one read per step
        assert check >= 3 * steps  # the full check: post, poll for the outcome, read it
    assert values[1][0][1] < 1.5  # rank 1's polls ran while rank 0 slept 2 s


def _posted_then_checked(rank, root, slow_reads=False):
    if rank == 1:
        open(os.path.join(root, "r1"), "w").close()
    saver = ranksafe.AsyncSaver(writer="all")
    ranksafe.barrier("warm")
    saver.poll()
    saver.save({"w": 1}, os.path.join(root, f"r{rank}", "w.pt"))
    saver.wait()
    if slow_reads and rank == 0:
        # rank 1 has posted its notice before the check (0.5 s), and withdraws it (1 s: its own check() reports the
        # failure instead) before the get (2.5 s)
        protocol._session.store = _SlowReads(protocol._session.store, "notice/", check_delay=0.5, get_delay=2.0)
    saver.poll()  # rank 1 posts its failure, due at the next poll
    if slow_reads and rank == 1:
        time.sleep(1)
    out = []
    try:
        saver.check()  # but the full check comes first: it reports the failure
    except ranksafe.RankFailure as e:
        out.append(e.ranks)
    saver.poll()  # reported once: the notice was withdrawn
    saver.close()
    return out


@pytest.mark.parametrize("slow_reads", [False, True], ids=["", "withdrawn-while-read"])
def test_the_full_check_reports_a_posted_failure_once(tmp_path, slow_reads):
    assert run_ranks(_posted_then_checked, 2, args=(str(tmp_path), slow_reads)).values == [[[1]], [[1]]]


def test_the_per_step_check_in_a_single_process_raises_the_error_itself_at_once(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "file").write_text("in the way")
    saver = ranksafe.AsyncSaver()
    saver.poll()  # nothing failed
    saver.save({"w": 1}, tmp_path / "file" / "w.pt")
    saver.wait()
    with pytest.raises(OSError) as raised:  # no other rank to keep in step: no step's delay
        saver.poll()
    assert not isinstance(raised.value, ranksafe.RankFailure)
    saver.check()  # reported once
    saver.close()


def _timeouts_that_cannot_work(rank):
    out = []
    for call in (ranksafe.barrier, lambda: ranksafe.barrier(timeout=-5), lambda: ranksafe.agree(1, timeout=0)):
        try:
            call()
            out.append("returned")
        except ValueError as e:
            out.append(str(e))
    return out


def test_a_timeout_that_cannot_work_is_refused_naming_it(tmp_path):
    """A zero or negative timeout reported every rank missing at once ("timed out after -5s waiting for rank(s) 0"),
    a RANKSAFE_TIMEOUT that is no number a bare float() error."""
    from ranksafe.lightning import RankSafe

    for bad in (-5, 0, "abc", math.inf, True):
        for make in (RankSafe, lambda timeout: ranksafe.CheckpointManager(tmp_path, timeout=timeout)):
            with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds or None, not "):
                make(timeout=bad)
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            ranksafe.barrier(timeout=bad)  # one process too: not only once the job is scaled up
    import numpy as np

    assert ranksafe.CheckpointManager(tmp_path, timeout=np.float32(5)).timeout == 5.0  # any real number
    for said in run_ranks(_timeouts_that_cannot_work, 2, env={"RANKSAFE_TIMEOUT": "abc"}).values:
        assert said == [
            "RANKSAFE_TIMEOUT must be a positive number of seconds, not 'abc'",
            "timeout must be a positive number of seconds or None, not -5",
            "timeout must be a positive number of seconds or None, not 0",
        ]


def _failures_inside_together(rank, base):
    blocker = os.path.join(base, "a-file")
    if rank == 0:
        open(blocker, "w").close()
    ranksafe.barrier("setup")
    seen = {}
    try:
        with ranksafe.together("evaluation"):
            ranksafe.save({"w": 1}, os.path.join(blocker, "m.pth"))  # fails on rank 0, shared by the save
    except Exception as e:
        seen["nested"] = (isinstance(e, NotADirectoryError), getattr(e, "errno", None), type(e).__name__)
    try:
        with ranksafe.together("interrupted"):
            if rank == 0:
                raise KeyboardInterrupt
    except Exception as e:
        seen["interrupt"] = f"Exception: {type(e).__name__} {e.ranks}"
    except KeyboardInterrupt:
        seen["interrupt"] = "KeyboardInterrupt"
    return seen


def test_a_failure_already_shared_keeps_its_type_and_ctrl_c_stays_what_it_is(tmp_path):
    """Before: a save failing inside together came out of it as a plain RankFailure (no longer a NotADirectoryError,
    errno lost), and a Ctrl-C on rank 0 became a RankFailure there too, caught by `except Exception`."""
    r0, r1 = run_ranks(_failures_inside_together, 2, args=(str(tmp_path),)).values
    for seen in (r0, r1):
        assert seen["nested"] == (True, 20, "RankFailure[NotADirectoryError]"), seen
    assert r0["interrupt"] == "KeyboardInterrupt"
    assert r1["interrupt"] == "Exception: RankFailure [0]"  # the others: a failure on rank 0, named


_LAUNCHER = """

if __name__ == "__main__":
    os.environ["RANKSAFE_TIMEOUT"] = "30"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(port, sys.argv[1]), nprocs=2, start_method=sys.argv[2])
"""


def _launch_two_ranks(tmp_path, ranks_code: str, start_method: str, out) -> None:
    """Run ``ranks_code`` (which defines ``rank_main(rank, port, out)``) on 2 ranks that torch.multiprocessing starts
    with ``start_method``, as a script of its own: a launcher that forks must not fork the test process."""
    script = tmp_path / "ranks.py"
    script.write_text(ranks_code + _LAUNCHER)
    done = subprocess.run(
        [sys.executable, str(script), str(out), start_method], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]


_FORKED_RANKS = """
import os, socket, sys, time
import torch.multiprocessing as mp
if {in_parent}:
    import ranksafe  # as under Lightning's ddp_fork: imported before the ranks are forked


def rank_main(rank, port, out):
    import torch.distributed as dist
    import ranksafe
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
    ranksafe.barrier("warm")
    if rank == 1:
        return  # rank 1's script ends here (a forked rank ends with os._exit, which skips atexit)
    start = time.monotonic()
    try:
        ranksafe.barrier("only rank 0 reaches this")
        got = "ok"
    except ranksafe.RankFailure as e:
        got = str(e)
    with open(out, "w") as f:
        f.write(f"{{time.monotonic() - start:.1f}} {{got}}")

"""


@pytest.mark.parametrize("in_parent", [False, True], ids=["imported-in-the-rank", "imported-before-the-fork"])
def test_a_rank_that_ends_in_a_forked_launcher_is_named_at_once_not_waited_for(tmp_path, in_parent):
    """Ranks forked by multiprocessing end with os._exit, which skipped the exit hook that says a rank is gone: rank 0
    waited the whole timeout (30 s here, 30 minutes by default) for a rank that had ended, and then blamed nobody."""
    out = tmp_path / "rank0.txt"
    _launch_two_ranks(tmp_path, _FORKED_RANKS.format(in_parent=in_parent), "fork", out)
    seconds, got = out.read_text().split(" ", 1)
    assert "rank 1: Exited: the process ended without reaching this collective" in got, got
    assert float(seconds) < 10, got


_WORKER_ENDS = """
import os, socket, sys, time
import torch
import torch.multiprocessing as mp


def from_a_worker(batch):
    import ranksafe

    ranksafe.barrier("from a worker")
    return batch


def rank_main(rank, port, out):
    import torch.distributed as dist
    import ranksafe
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ranksafe.barrier("warm")
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4, num_workers=1, multiprocessing_context="fork")
    assert [len(batch) for batch in loader] == [4, 4]  # its worker, forked from this rank, ends with the epoch
    del loader
    in_worker = torch.utils.data.DataLoader(
        [0], num_workers=1, multiprocessing_context="fork",
        collate_fn=from_a_worker,
    )
    try:
        list(in_worker)
        refused = "no error"
    except RuntimeError as e:
        refused = str(e)
    if rank == 1:
        time.sleep(3)  # longer than the grace: rank 0 waits in the barrier below meanwhile
    start = time.monotonic()
    try:
        ranksafe.barrier("epoch end")
        got = "ok"
    except ranksafe.RankFailure as e:
        got = str(e)
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{time.monotonic() - start:.1f}|{got}|{refused}")

"""


def test_a_process_forked_from_a_rank_neither_speaks_for_it_at_exit_nor_runs_its_collectives(tmp_path):
    """Before: a DataLoader worker inherited its rank's session, and at its exit posted "Exited" for the rank, which
    was alive: rank 0's next barrier failed after the grace, naming rank 1. A collective in a worker now raises at once
    instead of talking to the store over the rank's connection."""
    _launch_two_ranks(tmp_path, _WORKER_ENDS, "spawn", tmp_path / "rank")
    seconds, got, refused = zip(*((tmp_path / f"rank.{r}").read_text().split("|") for r in range(2)), strict=True)
    assert got == ("ok", "ok"), got
    assert float(seconds[0]) > 2.5, seconds  # rank 0 waited for rank 1: no failure was decided meanwhile
    assert all("ranksafe's collectives run in the ranks: this process was forked from rank" in r for r in refused)
