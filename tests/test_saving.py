"""Collective save, load and prepare_dir on real ranks."""

from __future__ import annotations

import errno
import os
import shutil
import time

import torch
import torch.distributed as dist

import ranksafe
from ranksafe import saving
from tests.ranks import run_ranks

# --- overwrite race: every rank rmtree + mkdir, versus prepare_dir -------------------------------------


def _naive_prepare(path: str, exist_ok: bool) -> None:
    """The pattern found in the field: every rank clears and recreates the run directory."""
    if os.path.exists(path):
        shutil.rmtree(path)
    time.sleep(0.01)  # widen the window between the check and the creation, as a busy NFS does
    os.makedirs(path, exist_ok=exist_ok)


def _race(rank, root, pattern, attempts):
    errors = lost = 0
    for i in range(attempts):
        run_dir = os.path.join(root, "run")
        time.sleep(0.004 * rank)  # ranks arrive a few ms apart, as they do after unequal work
        try:
            if pattern == "ranksafe":
                ranksafe.prepare_dir(run_dir, overwrite=True)
            else:
                _naive_prepare(run_dir, exist_ok=pattern == "naive_exist_ok")
            with open(os.path.join(run_dir, f"rank{rank}.txt"), "w") as f:
                f.write(str(i))
        except (OSError, RuntimeError):
            errors += 1
        dist.barrier()
        if rank == 0:  # every rank's file of this attempt must have survived the others' preparation
            present = os.listdir(run_dir) if os.path.isdir(run_dir) else []
            lost += sum(f"rank{r}.txt" not in present for r in range(dist.get_world_size()))
        dist.barrier()
    return errors, lost


def test_overwrite_race_naive_fails_prepare_dir_never(tmp_path):
    counts = {}
    for pattern in ("naive", "naive_exist_ok", "ranksafe"):
        root = tmp_path / pattern
        root.mkdir()
        values = run_ranks(_race, 4, args=(str(root), pattern, 30), timeout=180).values
        counts[pattern] = (sum(e for e, _ in values), values[0][1])
    print("4 ranks x 30 attempts, (errors, lost files):", counts)
    assert counts["naive"][0] > 0, "the control must show the naive pattern failing"
    assert sum(counts["naive_exist_ok"]) > 0, "exist_ok=True must still lose files or fail"
    assert counts["ranksafe"] == (0, 0)


# --- one writer, true ranks without RANK ------------------------------------------------------------


def _who_writes(rank, path, log):
    before = saving.save_file

    def logged(obj, p, **kw):
        with open(log, "a") as f:
            f.write(f"{rank}\n")
        return before(obj, p, **kw)

    saving.save_file = logged
    ranksafe.save({"w": torch.full((4,), float(rank))}, path)
    loaded = ranksafe.load(path)
    return {
        "env_rank": os.environ.get("RANK"), "rank": ranksafe.rank(), "local": ranksafe.local_rank(),
        "world": ranksafe.world_size(), "main": ranksafe.is_main(), "w": loaded["w"].tolist(),
    }  # fmt: skip


def test_spawned_ranks_without_rank_variable_know_their_rank_and_one_writes(tmp_path):
    log = tmp_path / "writers.log"
    values = run_ranks(_who_writes, 3, args=(str(tmp_path / "ck" / "m.pth"), str(log))).values
    assert [v["env_rank"] for v in values] == [None, None, None]  # like mp.spawn: no launcher variables
    assert [v["rank"] for v in values] == [0, 1, 2]
    assert [v["local"] for v in values] == [0, 1, 2]  # one host: learned from the host-name exchange
    assert [v["main"] for v in values] == [True, False, False]
    assert log.read_text().split() == ["0"]  # exactly one writer
    assert all(v["w"] == [0.0] * 4 for v in values)  # every rank loads the writer's tensors


def test_torchrun_style_environment(tmp_path):
    log = tmp_path / "writers.log"
    values = run_ranks(_who_writes, 2, args=(str(tmp_path / "m.pth"), str(log)), launch_env=True).values
    assert [(v["env_rank"], v["rank"], v["world"]) for v in values] == [("0", 0, 2), ("1", 1, 2)]
    assert log.read_text().split() == ["0"]


def _local_writer_first_thing(rank, base, call):
    from ranksafe import topology

    topology.hostname = lambda: f"node{rank}"  # one rank per host, as two machines under mp.spawn would be
    disk = os.path.join(base, f"node{rank}")  # each host's own disk
    path = os.path.join(disk, "model.pth")
    if call == "save":
        ranksafe.save({"w": torch.ones(2)}, path, writer="local")
    else:
        ranksafe.prepare_dir(disk, writer="local")
    return {
        "local": ranksafe.local_rank(),
        "node": ranksafe.node_rank(),
        "exists": os.path.exists(path if call == "save" else disk),
    }


def test_the_local_writer_of_every_node_writes_when_local_is_the_first_collective(tmp_path):
    """Without launcher variables the nodes are learned from the ranks' host names at the first collective: a save or
    prepare_dir with writer="local" that is that collective must learn them before picking its writers (else the
    second node's local rank 0 counts as local rank 1 and its disk gets nothing, while save returns there)."""
    for call in ("save", "prepare_dir"):
        values = run_ranks(_local_writer_first_thing, 2, args=(str(tmp_path / call), call)).values
        assert [(v["local"], v["node"]) for v in values] == [(0, 0), (0, 1)]
        assert [v["exists"] for v in values] == [True, True], call


def _save_outcomes(rank, base):
    from ranksafe import topology

    topology.hostname = lambda: "node0" if rank < 2 else "node1"  # ranks 0, 1 on one host, rank 2 on another
    node_path = os.path.join(base, f"node{ranksafe.node_rank()}.pth")
    calls = {  # a per-rank name with one writer is the slip; a per-node name with one writer per node is fine
        "main, path per rank": (os.path.join(base, f"preds_{rank}.pth"), "main"),
        "main, one path": (os.path.join(base, "preds.pth"), "main"),
        "local, path per node": (node_path, "local"),
        "local, path per rank": (os.path.join(base, f"local_{rank}.pth"), "local"),
        "all, path per rank": (os.path.join(base, f"all_{rank}.pth"), "all"),
    }
    out = {}
    for case, (path, writer) in calls.items():
        try:
            returned = ranksafe.save({"r": rank}, path, writer=writer)
            out[case] = ("returned", os.path.exists(returned))
        except ValueError as e:
            out[case] = ("ValueError", str(e))
    return out


def test_a_rank_whose_writer_wrote_another_path_gets_an_error_not_a_path_without_a_file(tmp_path):
    """save(obj, f"preds_{rank}.pth") with the default writer="main" wrote rank 0's file only and returned the other
    ranks' paths as if saved there. Now every rank raises, naming the paths; per-node paths with writer="local" and
    per-rank paths with writer="all" stay fine."""
    values = run_ranks(_save_outcomes, 3, args=(str(tmp_path),)).values
    for rank, v in enumerate(values):
        for case in ("main, one path", "local, path per node", "all, path per rank"):
            assert v[case] == ("returned", True), (rank, case, v[case])
        for case, wrong in (("main, path per rank", "preds_1.pth"), ("local, path per rank", "local_1.pth")):
            kind, message = v[case]
            assert kind == "ValueError", (rank, case, v[case])
            assert f"rank 1 has {tmp_path / wrong}" in message and "writer='all'" in message
        assert "rank 2 has" in v["main, path per rank"][1]
        assert "rank 2 has" not in v["local, path per rank"][1]  # rank 2 is its node's writer


# --- failures are loud and shared -------------------------------------------------------------------


def _load_outcome(rank, path, per_rank):
    target = path.format(rank=rank) if per_rank else path
    start = time.monotonic()
    try:
        ranksafe.load(target)
    except ranksafe.RankFailure as e:
        return {
            "types": [t.__name__ for t in type(e).__mro__], "msg": str(e), "ranks": e.ranks,
            "seconds": time.monotonic() - start, "path": getattr(e, "path", None),
        }  # fmt: skip
    return "loaded"


def test_missing_file_raises_on_every_rank_naming_path_and_rank(tmp_path):
    path = str(tmp_path / "nothing.pth")
    values = run_ranks(_load_outcome, 2, args=(path, False)).values
    for v in values:
        assert "FileNotFoundError" in v["types"]
        assert path in v["msg"] and "rank 0" in v["msg"] and "rank 1" in v["msg"]


def test_file_missing_on_one_rank_only_fails_all_ranks(tmp_path):
    # node-local disks: rank 0 has the file, rank 1 does not; rank 0 must not run ahead alone
    ranksafe.atomic_save({"w": torch.ones(2)}, tmp_path / "r0.pth")
    values = run_ranks(_load_outcome, 2, args=(str(tmp_path / "r{rank}.pth"), True)).values
    for v in values:
        assert v != "loaded"
        assert v["ranks"] == [1] and "FileNotFoundError" in v["types"] and "r1.pth" in v["msg"]


def test_corrupt_and_truncated_files_raise_on_every_rank(tmp_path):
    ranksafe.atomic_save({"w": torch.randn(1000)}, tmp_path / "flip.pth")
    data = bytearray((tmp_path / "flip.pth").read_bytes())
    data[len(data) // 2] ^= 0x10
    (tmp_path / "flip.pth").write_bytes(data)
    (tmp_path / "cut.pth").write_bytes(bytes(data[: len(data) // 3]))
    for name in ("flip.pth", "cut.pth"):
        values = run_ranks(_load_outcome, 2, args=(str(tmp_path / name), False)).values
        for v in values:
            assert "CorruptCheckpoint" in v["types"] and name in v["msg"], v
            assert v["path"] == str(tmp_path / name)  # the attribute too, also on ranks that did not fail alone


def _failing_save(rank, path, blocker):
    ranksafe.save({"v": torch.tensor(1.0)}, path)  # committed
    start = time.monotonic()
    try:
        ranksafe.save({"v": torch.tensor(2.0)}, blocker)  # parent is a file: fails on the writer only
    except ranksafe.RankFailure as e:
        outcome = {
            "types": [t.__name__ for t in type(e).__mro__], "msg": str(e), "seconds": time.monotonic() - start,
            "errno": e.errno, "path": e.path,
        }  # fmt: skip
    else:
        outcome = "saved"
    return outcome, float(ranksafe.load(path)["v"])


def test_failed_write_raises_on_every_rank_and_keeps_the_committed_file(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    res = run_ranks(_failing_save, 2, args=(str(tmp_path / "m.pth"), str(tmp_path / "file" / "m.pth"))).values
    for outcome, committed in res:
        assert outcome != "saved"
        assert "rank 0" in outcome["msg"] and "file/m.pth" in outcome["msg"]
        assert f"{tmp_path / 'file'} is a file, not a directory" in outcome["msg"]
        assert outcome["errno"] == errno.ENOTDIR  # the code travels too: `e.errno == ...` works on every rank
        assert outcome["path"] == str(tmp_path / "file" / "m.pth")  # and the file it is about
        assert outcome["seconds"] < 5
        assert committed == 1.0


def _prepare_non_empty(rank, path):
    try:
        ranksafe.prepare_dir(path)
    except FileExistsError as e:
        return str(e)
    return "prepared"


def test_prepare_dir_refuses_a_non_empty_dir_on_every_rank(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.pth").write_text("old results")
    values = run_ranks(_prepare_non_empty, 2, args=(str(tmp_path / "run"),)).values
    assert all("overwrite=True" in v for v in values)
    assert (tmp_path / "run" / "keep.pth").read_text() == "old results"
