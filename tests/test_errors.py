"""Each ranksafe error is also what the stock call raises for the same cause: an ``except`` clause written for stock
PyTorch keeps working once ranksafe is added. Every test feeds the same input to the stock call and to ranksafe."""

from __future__ import annotations

import errno
import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist

import ranksafe
from tests.ranks import run_ranks


def _stock_error(call) -> BaseException:
    with pytest.raises(Exception) as stock:
        call()
    return stock.value


def _ranksafe_error(call) -> BaseException:
    with pytest.raises(ranksafe.RankSafeError) as ours:
        call()
    return ours.value


class Custom:
    pass


def test_untrusted_checkpoint_is_what_weights_only_loading_raises(tmp_path):
    path = tmp_path / "objects.pt"
    torch.save({"obj": Custom()}, path)
    stock = _stock_error(lambda: torch.load(path, weights_only=True))
    ours = _ranksafe_error(lambda: ranksafe.load(path))
    assert type(stock) is pickle.UnpicklingError
    assert isinstance(ours, ranksafe.UntrustedCheckpoint) and isinstance(ours, type(stock))


@pytest.mark.parametrize(
    "damage",
    [lambda b: b[: len(b) // 2], lambda b: b"not a checkpoint at all" * 4, lambda b: b""],
    ids=["truncated archive", "not a checkpoint", "empty"],
)
def test_corrupt_checkpoint_is_what_torch_load_raises_on_a_damaged_file(tmp_path, damage):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.randn(1000)}, good)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(damage(good.read_bytes()))
    stock = _stock_error(lambda: torch.load(bad, weights_only=False))
    ours = _ranksafe_error(lambda: ranksafe.load(bad, weights_only=False))
    assert type(stock) in (RuntimeError, pickle.UnpicklingError, EOFError), type(stock)  # empty: EOFError
    assert isinstance(ours, ranksafe.CorruptCheckpoint) and isinstance(ours, type(stock))


def _stock_and_ours(rank, root):
    """A save that fails on rank 0 (a file where its directory must go), stock and through ranksafe."""
    blocked = os.path.join(root, "blocked")
    out = {}
    try:  # stock: rank 0 writes and then waits in a barrier; the other rank waits there for the timeout
        if rank == 0:
            torch.save({"w": torch.ones(2)}, os.path.join(blocked, "model.pt"))
        dist.barrier()
        out["stock"] = None
    except Exception as e:
        out["stock"] = [t.__name__ for t in type(e).__mro__]
    if rank == 0:  # never at the barrier: the other rank times out there (3 s) before both go on
        time.sleep(5)
    try:
        ranksafe.save({"w": torch.ones(2)}, os.path.join(blocked, "model.pt"))
        out["ours"] = None
    except ranksafe.RankFailure as e:
        out["ours"] = [t.__name__ for t in type(e).__mro__]
        out["errno"] = e.errno
    return out


def test_a_failure_shared_by_every_rank_is_what_each_rank_raised_in_stock_code(tmp_path):
    (tmp_path / "blocked").write_text("a file where a directory must go")
    values = run_ranks(_stock_and_ours, 2, args=(str(tmp_path),), env={"TEST_PG_TIMEOUT": "3"}, timeout=90).values
    for rank, out in enumerate(values):
        stock, ours = out["stock"][0], set(out["ours"])
        # stock: the writer's torch.save raises RuntimeError (its zip writer's), the other rank times out in the
        # barrier (the backend's RuntimeError); ranksafe raises on both one error that is that and an OSError
        assert stock == "RuntimeError", (rank, out["stock"])
        assert {"RankFailure", stock, "OSError"} <= ours, out["ours"]
        assert out["errno"] == errno.ENOTDIR


def _barrier_missing(rank):
    if rank == 1:
        return None
    with pytest.raises(ranksafe.BarrierTimeout) as ours:
        ranksafe.barrier("missing", timeout=1)
    return isinstance(ours.value, RuntimeError)


def test_barrier_timeout_is_a_runtime_error_like_the_backends_timeout():
    values = run_ranks(_barrier_missing, 2, timeout=60).values
    assert values[0] is True


def test_every_error_ranksafe_raises_pickles_back_as_itself():
    """Worker pools (mp.spawn, ProcessPoolExecutor) pickle what a worker raises. Before: CorruptCheckpoint and
    UntrustedCheckpoint could not be rebuilt (their __init__ takes two arguments), which broke the pool, and a
    CollectiveMismatch came back as a plain RankFailure."""
    failure = ranksafe.errors.Failure(1, "builtins.ValueError", "diverged")
    errors = [
        ranksafe.CorruptCheckpoint("/ck/m.pth", "truncated"),
        ranksafe.EmptyCheckpoint("/ck/m.pth", "the file is empty"),
        ranksafe.UntrustedCheckpoint("/ck/m.pth", "a pickled class"),
        ranksafe.CollectiveMismatch("save", [failure]),
        ranksafe.BarrierTimeout("barrier", [1], 5.0),
        ranksafe.errors.rank_failure("load", [ranksafe.errors.Failure(0, "builtins.FileNotFoundError", "gone")]),
    ]
    for error in errors:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error), (type(back), back)
        assert getattr(back, "path", None) == getattr(error, "path", None)


def test_a_shared_corrupt_or_untrusted_checkpoint_keeps_its_reason():
    """A RankFailure[CorruptCheckpoint] is a CorruptCheckpoint, so code that reads .reason (to tell truncated from
    bit-flipped) must find it on every rank; before, it had .path only and .reason raised AttributeError."""
    errors = (ranksafe.CorruptCheckpoint("/m", "truncated"), ranksafe.UntrustedCheckpoint("/m", "a class"))
    for error in (*errors, ranksafe.EmptyCheckpoint("/m", "the file is empty")):  # the last one an EOFError too
        shared = ranksafe.errors.rank_failure("load", [ranksafe.errors.Failure.from_exception(1, error)])
        assert isinstance(shared, type(error)) and isinstance(shared, ranksafe.RankFailure)
        assert (shared.reason, shared.path) == (error.reason, error.path)
        back = pickle.loads(pickle.dumps(shared))
        assert (type(back), back.reason) == (type(shared), error.reason)


def test_an_error_that_is_no_oserror_keeps_its_type_and_every_rank_reads_which_file_it_was_about(tmp_path):
    """Before: a save of an object pickle refuses raised "cannot pickle 'generator' object" on the writer, and every
    other rank read that in its RankFailure, naming neither the file nor the rank."""
    target = tmp_path / "m.pth"
    with pytest.raises(TypeError, match="cannot pickle") as e:
        ranksafe.atomic_save({"gen": (i for i in range(3))}, target)
    if not hasattr(e.value, "add_note"):
        pytest.skip("notes need Python 3.11")
    assert e.value.__notes__ == [f"cannot save {target} (rank 0)"]
    shared = ranksafe.errors.rank_failure("save", [ranksafe.errors.Failure.from_exception(0, e.value)])
    assert isinstance(shared, TypeError) and f"(cannot save {target} (rank 0))" in str(shared)


class _ConnectorError(OSError):
    """Made as aiohttp's ClientConnectorError is (under gcsfs and adlfs): from a key and the OSError it wraps."""

    def __init__(self, key: str, os_error: OSError) -> None:
        super().__init__(os_error.errno, os_error.strerror)
        self.key = key


def test_an_os_error_made_otherwise_is_still_named_with_its_target_and_rank():
    """Before: rebuilding it as ``type(e)(errno, message)`` raised AttributeError ("'str' object has no attribute
    'errno'") from inside its constructor, and the error of an unreachable host was lost."""
    e = _ConnectorError("host:9", ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed"))
    named = ranksafe.errors.error_naming_target(e, "cannot load", "gs://bucket/model.pt")
    assert isinstance(named, ConnectionRefusedError) and named.errno == errno.ECONNREFUSED
    assert str(named) == "[Errno 111] cannot load gs://bucket/model.pt (rank 0): Connect call failed"
    assert named.path == "gs://bucket/model.pt"
