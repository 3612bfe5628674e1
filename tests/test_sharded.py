"""Sharded state (FSDP2 on CPU, gloo) through torch.distributed.checkpoint inside the manager's step commit.

Three runs chained over one checkpoint root, each a real job: 4 ranks on 2 simulated nodes save (sync and async)
and damage a copy; 2 ranks reshard from 4, save again, and lose their writer mid-save; 1 rank resumes from the
last committed step into an unsharded model. Controls beside ranksafe: plain ``dcp.load`` of a flipped and of a
truncated shard, and of the directory a killed save leaves.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import warnings
import zlib

import pytest
import torch

import ranksafe
from ranksafe import cli, commit
from ranksafe.checkpoint import CheckpointManager
from ranksafe.shards import read_shards, write_shards
from tests.ranks import run_ranks
from tests.test_storage import as_node

_DCP_NOISE = "ignore:torch.distributed is disabled"  # dcp.save/load without a process group say so


def _model(world: int, seed: int):
    """A small transformer, fully sharded over ``world`` ranks (unsharded when 0), after one training step."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors need batch_first
        model = nn.Transformer(d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64)
    if world:
        mesh = init_device_mesh("cpu", (world,))
        for layer in [*model.encoder.layers, *model.decoder.layers]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, seed)
    return model, opt


def _train(model, opt, seed: int) -> None:
    torch.manual_seed(100 + seed)
    x = torch.randn(5, 2, 32)
    model(x, x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt, epoch: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "epoch": epoch}


def _tensors(obj, key: str = ""):
    """``(key path, tensor)`` for every tensor in nested dicts."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{key}.{k}")
    elif isinstance(obj, torch.Tensor):
        yield key, obj


def _full(state) -> dict:
    """Every tensor of ``state`` whole (a DTensor gathered), by key path: what must survive any resharding."""
    from torch.distributed.tensor import DTensor

    return {k: (t.full_tensor() if isinstance(t, DTensor) else t.detach()).clone() for k, t in _tensors(state)}


def _scrambled(state) -> dict:
    """``state`` with every tensor overwritten in place: a load that leaves one alone shows in the comparison."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for _, t in _tensors(state):
            (t.to_local() if isinstance(t, DTensor) else t).fill_(-1)
    return {**state, "epoch": 0}


def _differing(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys() and len(a) > 100, (len(a), len(b))  # the model's weights and AdamW's two moments
    return [k for k in a if not torch.equal(a[k], b[k])]


def _flip_inside_a_tensor(step_dir: str, name: str) -> None:
    """Flip one byte in the middle of the largest tensor DCP stored in ``name`` (its data, not a zip header)."""
    import torch.distributed.checkpoint as dcp

    items = dcp.FileSystemReader(step_dir).read_metadata().storage_data.values()
    biggest = max((i for i in items if i.relative_path == name), key=lambda i: i.length)
    with open(os.path.join(step_dir, name), "r+b") as f:
        f.seek(biggest.offset + biggest.length // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def _attempt(call) -> str:
    try:
        call()
    except BaseException as e:  # dcp.CheckpointException is a BaseException
        return f"{type(e).__name__}: {e}"
    return "done"


@contextlib.contextmanager
def _hashing():
    """The names of the files this rank reads back to hash (for a manifest, or to verify one) inside the block."""
    hashed, crc_file = [], commit._crc_file
    commit._crc_file = lambda place: (hashed.append(os.path.basename(place)), crc_file(place))[1]
    try:
        yield hashed
    finally:
        commit._crc_file = crc_file


def _four_ranks(rank, base):
    import torch.distributed.checkpoint as dcp

    local = as_node(rank, 2, base)  # two nodes, each with its own disk at this path
    root = os.path.join(base, "shared")
    model, opt = _model(4, seed=0)
    out = {}
    state = _state(model, opt, epoch=1)
    out["local warmup"] = _attempt(lambda: CheckpointManager(local).warmup(state))
    out["local save"] = _attempt(lambda: CheckpointManager(local).save(1, state))

    manager = CheckpointManager(root, keep=None)
    with _hashing() as hashed:
        manager.save(1, state)
    out["hashed at commit"] = hashed  # the writer knows every rank's files from DCP: it reads none back
    step1 = _full(state)
    _train(model, opt, seed=1)
    background = CheckpointManager(root, keep=None, async_save=True)
    state = _state(model, opt, epoch=2)
    out["step 2"] = _full(state)
    background.save(2, state)
    with torch.no_grad():  # the next optimizer step changes the weights: the snapshot holds the saved ones
        next(model.parameters()).to_local().add_(1.0)
    background.close()

    # stock DCP reads a ranksafe step
    fresh = _scrambled(_state(*_model(4, seed=7), epoch=0))  # each load below overwrites it in place
    dcp.load(fresh, checkpoint_id=manager.step_dir(2))
    out["stock load differs"] = _differing(_full(fresh), out["step 2"])
    out["stock epoch"] = fresh["epoch"]

    # the ranks verify the step together: each hashes its share of the files
    fresh = _scrambled(fresh)
    with _hashing() as hashed:
        manager.load(into=fresh)
    out["hashed"] = hashed
    out["loaded"] = (manager.loaded_step, fresh["epoch"], _differing(_full(fresh), out["step 2"]))

    # a flipped byte inside a tensor of one shard: stock DCP loads it, ranksafe names the file on every rank
    if rank == 0:
        _flip_inside_a_tensor(manager.step_dir(1), "__1_0.distcp")
        copy = shutil.copytree(manager.step_dir(2), os.path.join(base, "copy"))
        os.truncate(os.path.join(copy, "__2_0.distcp"), os.path.getsize(os.path.join(copy, "__2_0.distcp")) - 100)
    ranksafe.barrier("damaged")
    fresh = _scrambled(fresh)
    dcp.load(fresh, checkpoint_id=manager.step_dir(1))
    out["stock load of the flip differs"] = _differing(_full(fresh), step1)
    out["ranksafe load of the flip"] = _attempt(lambda: manager.load(1, into=fresh))
    out["stock load of the truncation"] = _attempt(lambda: dcp.load(fresh, checkpoint_id=os.path.join(base, "copy")))
    out["files"] = sorted(os.listdir(manager.step_dir(2)))
    return out


class _App:
    """A ``Stateful`` holding a model and its optimizer, as DCP users write them."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        return _state(self.model, self.opt, epoch=-1)

    def load_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


class _KillWhenPickled:
    """Pickled (by DCP, for the rank that writes it) on ``victim``, this kills the process: a crash mid-save."""

    def __init__(self, victim: int):
        self.victim = victim

    def __reduce__(self):
        if ranksafe.rank() == self.victim:
            os.kill(os.getpid(), signal.SIGKILL)
        return (int, (0,))


class _FailsWhenPickled:
    """Pickled on ``victim`` (by DCP, or by a snapshot's deep copy too with ``on_copy``), this fails as a full disk
    would: a write that fails on one rank only."""

    def __init__(self, victim: int, on_copy: bool = False):
        self.victim, self.on_copy = victim, on_copy

    def _fail(self) -> None:
        if ranksafe.rank() == self.victim:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def __deepcopy__(self, memo):
        if self.on_copy:
            self._fail()
        return _FailsWhenPickled(self.victim, self.on_copy)

    def __reduce__(self):
        self._fail()
        return (int, (0,))


def _failure(call) -> tuple:
    try:
        call()
    except ranksafe.RankFailure as e:
        return type(e).__name__, e.ranks, e.errno if isinstance(e, OSError) else None, str(e)
    return ("no error",)


def _two_ranks(rank, root, step2):
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = _model(2, seed=3)
    manager = CheckpointManager(root, keep=None)
    into = _scrambled(_state(model, opt, epoch=0))
    # into= on one rank only: both meet a CollectiveMismatch at once (was: rank 0 went into DCP's collectives, rank 1
    # into a plain load's, and both waited out the timeout); without into= anywhere, a message that says to pass it
    one_side = _attempt(lambda: manager.load(into=into if rank == 0 else None))
    without = _attempt(lambda: manager.load())
    manager.load(into=into)  # the latest step, saved by 4 ranks
    set_state_dict(model, opt, model_state_dict=into["model"], optim_state_dict=into["optim"])
    out = {
        "step": manager.loaded_step,
        "epoch": into["epoch"],
        "differs": _differing(_full(_state(model, opt, 2)), step2),
        "into= on rank 0 only": one_side,
        "no into=": without,
    }
    _train(model, opt, seed=4)
    manager.save(3, {"app": _App(model, opt)})
    out["step 3"] = _full(_state(model, opt, epoch=-1))
    # a write that fails on rank 1: the same error on both ranks, nothing committed
    out["sync failure"] = _failure(
        lambda: manager.save(10, {"app": _App(model, opt), f"r{rank}": _FailsWhenPickled(1)})
    )
    background = CheckpointManager(root, keep=None, async_save=True)
    bad = {"app": _App(model, opt), f"r{rank}": _FailsWhenPickled(1, on_copy=True)}
    out["snapshot failure"] = _failure(lambda: background.save(11, bad))
    background.save(12, {"app": _App(model, opt), f"r{rank}": _FailsWhenPickled(1)})
    out["background failure"] = _failure(background.close)
    out["after failures"] = (background.latest(), sorted(os.listdir(root)))
    ranksafe.barrier("listed")  # else rank 0 may stage step 4 before rank 1 lists the root
    out["step 4"] = _attempt(lambda: manager.save(4, {"app": _App(model, opt), f"r{rank}": _KillWhenPickled(0)}))
    return out


def _one_rank(rank, root, step3):
    import torch.distributed.checkpoint as dcp

    before = sorted(os.listdir(root))
    model, opt = _model(0, seed=5)  # not sharded at all
    manager = CheckpointManager(root, keep=2)
    out = {"before": before, "latest": manager.latest()}
    _scrambled(_state(model, opt, 0))
    manager.load(into={"app": _App(model, opt)})
    out["differs"] = _differing(_full(_state(model, opt, -1)), step3)
    torn = os.path.join(root, ".step_00000004.ranksafe-partial")  # what a plain dcp.save would have left at step_4
    out["torn files"] = sorted(os.listdir(torn))
    out["stock load of the torn step"] = _attempt(lambda: dcp.load(_state(model, opt, 0), checkpoint_id=torn))
    manager.save(5, _state(model, opt, epoch=5))  # not sharded: one writer, state.pt
    out["after"] = sorted(os.listdir(root))
    out["into a plain step"] = _attempt(lambda: manager.load(5, into=_state(model, opt, 0)))
    return out


def test_fsdp2_saves_reshard_4_2_1_and_damage_or_a_killed_writer_never_loads(tmp_path, capsys):
    base = str(tmp_path)
    root = os.path.join(base, "shared")
    four = run_ranks(_four_ranks, 4, args=(base,), timeout=240).values
    for rank, v in enumerate(four):
        # node-local disks: refused on every rank, nothing saved (by the save's first exchange: one shared error)
        for name, kind in (("local warmup", "ValueError"), ("local save", "RankFailure[ValueError]")):
            assert f"(rank {rank}): sharded state needs a directory every rank shares" in v[name], v[name]
            assert v[name].startswith(f"{kind}: ") and "this one is local" in v[name], v[name]
        assert v["files"] == [".metadata", "MANIFEST.json", *(f"__{r}_0.distcp" for r in range(4))]
        assert v["stock load differs"] == [] and v["stock epoch"] == 2  # a ranksafe step is a plain DCP checkpoint
        assert v["loaded"] == (2, 2, [])
        # the flip: stock DCP loads wrong values without a word; ranksafe fails every rank, naming the shard
        assert len(v["stock load of the flip differs"]) == 1
        said = v["ranksafe load of the flip"]
        assert said.startswith("RankFailure[CorruptCheckpoint]: ") and "step_00000001/__1_0.distcp" in said, said
        assert "checksum mismatch" in said
        # the truncation: stock DCP fails, without naming the file
        said = v["stock load of the truncation"]
        assert said.startswith("CheckpointException") and "failed finding central directory" in said, said[:300]
        assert "__2_0.distcp" not in said
    assert [v["hashed at commit"] for v in four] == [[]] * 4
    hashed = [v["hashed"] for v in four]
    assert sorted(name for h in hashed for name in h) == [
        ".metadata",
        *(f"__{r}_0.distcp" for r in range(4)),
    ]  # once each
    assert all(len(h) in (1, 2) for h in hashed), hashed  # split: no rank read every shard
    assert cli.main(["verify", os.path.join(root, "step_00000002")]) == 0
    assert cli.main(["verify", os.path.join(base, "copy")]) == 1
    assert "__2_0.distcp: size is" in capsys.readouterr().err

    two = run_ranks(_two_ranks, 2, args=(root, four[0]["step 2"]), env={"RANKSAFE_TIMEOUT": "10"}, timeout=240)
    assert two[0].exitcode == -signal.SIGKILL, two[0].error  # rank 0 died writing step 4
    survivor = two[1].value
    assert (survivor["step"], survivor["epoch"], survivor["differs"]) == (2, 2, [])  # 4 ranks -> 2
    assert survivor["step 4"] != "done" and not two[1].hung
    assert survivor["into= on rank 0 only"].startswith("CollectiveMismatch: "), survivor["into= on rank 0 only"]
    assert "verify, sharded, into=" in survivor["into= on rank 0 only"]
    assert survivor["no into="].startswith("RankFailure[ValueError]: ") and "load it with into=" in survivor["no into="]
    for name in ("sync failure", "snapshot failure", "background failure"):
        kind, ranks, code, said = survivor[name]
        assert (kind, ranks, code) == ("RankFailure[OSError]", [1], errno.ENOSPC), survivor[name]
        assert "No space left on device (injected)" in said, said
    assert survivor["after failures"] == (3, ["step_00000001", "step_00000002", "step_00000003"])

    one = run_ranks(_one_rank, 1, args=(root, survivor["step 3"]), timeout=120).values[0]
    assert ".step_00000004.ranksafe-partial" in one["before"] and "step_00000004" not in one["before"]
    assert one["latest"] == 3 and one["differs"] == []  # 4 -> 2 -> 1, optimizer state included
    assert ".metadata" not in one["torn files"] and "MANIFEST.json" not in one["torn files"]
    assert one["stock load of the torn step"].startswith(("CheckpointException", "FileNotFoundError")), one
    assert one["after"] == ["step_00000003", "step_00000005"]  # keep=2, and the torn step's debris is gone
    assert one["into a plain step"].startswith("ValueError: ") and "holds no sharded state" in one["into a plain step"]


# -- one process ----------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings(_DCP_NOISE)
def test_the_shard_writer_knows_every_file_it_wrote_with_its_size_and_crc(tmp_path):
    state = {"w": torch.arange(1000.0), "b": torch.ones(3), "epoch": 4}
    entries = write_shards(state, str(tmp_path), "test")
    on_disk = {}
    for name in os.listdir(tmp_path):
        data = (tmp_path / name).read_bytes()
        on_disk[name] = (len(data), zlib.crc32(data))
    assert entries == on_disk and ".metadata" in on_disk and len(on_disk) == 2


class _Unsafe:
    """A value weights-only loading refuses."""


@pytest.mark.filterwarnings(_DCP_NOISE)
def test_a_sharded_load_refuses_pickled_objects_unless_trusted(tmp_path):
    write_shards({"w": torch.ones(2), "obj": _Unsafe()}, str(tmp_path), "test")
    into = {"w": torch.zeros(2), "obj": None}
    with pytest.raises(ranksafe.errors.UntrustedCheckpoint, match=r"weights_only loading refuses \(obj: .*_Unsafe"):
        read_shards(into, str(tmp_path), "test")  # in one process, the error itself
    assert isinstance(read_shards(into, str(tmp_path), "test", weights_only=False)["obj"], _Unsafe)
    assert torch.equal(into["w"], torch.ones(2))


class _RunsCode:
    """A pickle that leaves a mark when it is loaded, then gives back the real metadata."""

    def __init__(self, mark: str, real: bytes):
        self.mark, self.real = mark, real

    def __reduce__(self):
        code = f"open({self.mark!r}, 'w').close() or __import__('pickle').loads({self.real!r})"
        return (eval, (code,))


@pytest.mark.filterwarnings(_DCP_NOISE)
def test_a_sharded_load_refuses_an_index_that_would_run_code_unless_trusted(tmp_path):
    """Before: DCP reads .metadata with pickle.load, so a checkpoint from elsewhere ran its code on a weights-only load
    (the load then succeeded)."""
    import pickle

    write_shards({"w": torch.ones(2)}, str(tmp_path), "test")
    index, mark = tmp_path / ".metadata", tmp_path.parent / "ran"
    index.write_bytes(pickle.dumps(_RunsCode(str(mark), index.read_bytes())))
    into = {"w": torch.zeros(2)}
    with pytest.raises(ranksafe.errors.UntrustedCheckpoint, match=r"\.metadata holds objects .*builtins\.eval"):
        read_shards(into, str(tmp_path), "test")
    assert not mark.exists() and torch.equal(into["w"], torch.zeros(2))
    read_shards(into, str(tmp_path), "test", weights_only=False)  # trusted: what DCP's own load does
    assert mark.exists() and torch.equal(into["w"], torch.ones(2))


def test_every_file_of_the_shards_is_on_disk_when_dcp_syncs_it(tmp_path, monkeypatch):
    """Before: DCP fsynced .metadata while its pickle was still in our stream's buffer (0 bytes on disk), and the commit
    syncs only the directory: a power loss could leave a committed step with an empty index."""
    synced = []
    fsync = os.fsync

    def recording(fd):
        synced.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), os.fstat(fd).st_size))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    write_shards({"w": torch.arange(1000.0), "epoch": 4}, str(tmp_path), "test")
    final = {name: (tmp_path / name).stat().st_size for name in os.listdir(tmp_path)}
    assert {name.removesuffix(".tmp"): size for name, size in synced if name.startswith((".metadata", "__"))} == final


def _files_named_as_dcp_names_its_own(rank, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    state = {"w": DTensor.from_local(torch.full((2,), float(rank)), init_device_mesh("cpu", (2,)), [Shard(0)])}
    manager = CheckpointManager(root, keep=None)
    out = {"extra file": _attempt(lambda: manager.save(1, state, extra_files={"__0_0.distcp": "oops"}))}

    def side_files():
        with manager.saving(2, shards=state) as tx:
            tx.save(b"mine", f"__{rank}_0.distcp")

    out["side files"] = _attempt(side_files)

    def state_file():  # a load without into= would take it for the state
        with manager.saving(2, shards=state) as tx:
            if rank == 1:
                tx.save(b"mine", "state.pt")

    out["state file"] = _attempt(state_file)
    manager.save(3, state, extra_files={"notes.txt": "fine"})
    out["committed"] = sorted(os.listdir(root))
    return out


@pytest.mark.filterwarnings(_DCP_NOISE)
def test_a_file_of_a_sharded_step_named_as_dcp_names_its_own_is_refused_on_every_rank(tmp_path):
    """Before: extra_files={"__0_0.distcp": ...} replaced rank 0's shard, the manifest took the replacement, and the
    step committed: `ranksafe verify` said OK and its load failed on every rank with an UnpicklingError."""
    values = run_ranks(_files_named_as_dcp_names_its_own, 2, args=(str(tmp_path),), timeout=120).values
    for v in values:
        assert v["extra file"].startswith("ValueError: checkpoint 1: __0_0.distcp: torch.distributed.checkpoint"), v
        assert v["side files"].startswith("ValueError: checkpoint 2: __0_0.distcp, __1_0.distcp: "), v
        assert v["state file"].startswith("ValueError: checkpoint 2: a file named state.pt beside sharded state"), v
        assert v["committed"] == ["step_00000003"], v


def _a_shard_too_large_for_rank_1(rank, root):
    """Rank 1 may write files of 20 kB at most (``RLIMIT_FSIZE``, which holds for root; the same errno path as a full
    disk): its shard of step 2 is larger. Synchronous and background saves; the step before stays loadable."""
    import resource

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for mode in ("sync", "async"):
        manager = CheckpointManager(os.path.join(root, mode), keep=None, async_save=mode == "async", timeout=30)
        manager.save(1, {"w": distribute_tensor(torch.ones(10, 10), mesh, [Shard(0)])})
        manager.check()
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
        try:
            manager.save(2, {"w": distribute_tensor(torch.ones(100, 1000), mesh, [Shard(0)])})
            manager.wait()
            manager.check()
        except ranksafe.RankFailure as e:
            out[mode] = (isinstance(e, OSError), e.errno, str(e))
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        out[mode + " latest"] = manager.latest()
        manager.close()
    return out


@pytest.mark.filterwarnings(_DCP_NOISE)
def test_a_shard_that_cannot_be_written_is_an_os_error_naming_its_file_and_rank_on_every_rank(tmp_path):
    """Before: RankFailure[RuntimeError] "[enforce fail at inline_container.cc] unexpected pos 704 vs 598" on every
    rank, what torch's zip writer makes of the failed write: no errno (``except OSError`` missed it), no file."""
    values = run_ranks(_a_shard_too_large_for_rank_1, 2, args=(str(tmp_path),), timeout=120).values
    for v in values:
        for mode in ("sync", "async"):
            is_os_error, code, message = v[mode]
            assert is_os_error and code == errno.EFBIG, v
            assert "rank 1: OSError" in message and "step_00000002.ranksafe-partial/__1_0.distcp (rank 1)" in message
            assert v[mode + " latest"] == 1, v


def _sharded_objects_given_to_one_writer(rank, root):
    model, opt = _model(2, seed=6)
    manager = CheckpointManager(os.path.join(root, "steps"), keep=None)
    return {
        "save a model": _attempt(lambda: ranksafe.save({"model": model}, os.path.join(root, "model.pt"))),
        "save an optimizer": _attempt(lambda: ranksafe.save({"opt": opt}, os.path.join(root, "opt.pt"))),
        "a step holding one": _attempt(lambda: manager.save(1, {"x": [opt]})),
        "files": sorted(os.listdir(root)),
    }


@pytest.mark.filterwarnings(_DCP_NOISE)
def test_a_module_or_optimizer_holding_shards_is_refused_by_a_single_writer_on_every_rank(tmp_path):
    """Before: only dicts, lists and tuples were looked into: ranksafe.save({"opt": opt}) and a step holding an FSDP2
    optimizer object wrote rank 0's shards only (parameters of half their shape), and returned on every rank."""
    values = run_ranks(_sharded_objects_given_to_one_writer, 2, args=(str(tmp_path),), timeout=120).values
    for v in values:
        for case in ("save a model", "save an optimizer", "a step holding one"):
            assert "ValueError" in v[case] and "the state holds sharded tensors" in v[case], (case, v[case])
        assert "opt.param_groups[0]['params'][0]" in v["save an optimizer"], v["save an optimizer"]  # named
        assert v["files"] == ["steps"] and os.listdir(tmp_path / "steps") == [], v


def test_ranks_verifying_a_step_together_check_each_file_once(tmp_path):
    manager = CheckpointManager(tmp_path)
    step = manager.save(1, {"w": torch.ones(4)}, extra_files={f"f{i}.txt": str(i) for i in range(5)})
    names = sorted(commit.read_manifest(step)["files"])
    for name in names:
        with open(os.path.join(step, name), "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 1]))
        for count in (1, 2, 3, 4):
            failing = []
            for index in range(count):
                try:
                    commit.verify_step(step, share=(index, count))
                except ranksafe.CorruptCheckpoint as e:
                    assert e.path.endswith(name)
                    failing.append(index)
            assert len(failing) == 1, (name, count, failing)
        with open(os.path.join(step, name), "r+b") as f:
            f.write(byte)
    assert commit.verify_step(step)["step"] == 1


_IMPORTS = """
import sys, torch, ranksafe, ranksafe.fastai
heavy = {"torch.distributed.checkpoint", "torch.distributed.tensor"}
ranksafe.save({"w": torch.ones(2)}, sys.argv[1])
ranksafe.AsyncSaver().staging.take({"w": torch.ones(2)})
print("loaded:", sorted(heavy & set(sys.modules)))
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor, Shard
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
t = DTensor.from_local(torch.ones(2), DeviceMesh("cpu", [0]), [Shard(0)])
print("staged:", type(ranksafe.AsyncSaver().staging.take({"t": t})["t"]).__name__)
print("found:", ranksafe.sharded.for_dcp({"t": t}) is not None)
"""


def test_importing_ranksafe_leaves_dcp_and_dtensor_for_the_jobs_that_use_them(tmp_path):
    """``torch.distributed.checkpoint`` and ``DTensor`` cost most of a second at import, in every process of a job:
    ranksafe imports DCP where a step holds sharded state, and finds DTensors without importing their module (none
    exists before it is imported), also when it is imported after ranksafe."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS, str(tmp_path / "m.pt")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["loaded: []", "staged: DTensor", "found: True"], done.stdout
