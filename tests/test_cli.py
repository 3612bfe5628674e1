"""The README's main job: `ranksafe demo` runs real processes and reports what happened."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest


def test_demo_runs_and_shows_naive_errors_and_none_for_ranksafe():
    out = subprocess.run(
        [sys.executable, "-m", "ranksafe.cli", "demo", "--ranks", "3", "--rounds", "5"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"ranksafe \(prepare_dir.*: 0 errors in 15 rank-rounds", out.stdout)
    assert "failure raised on 3/3 ranks" in out.stdout
    assert out.stdout.count("DIR/blocker is a file, not a directory") == 3  # the cause, whole, on every rank
    assert "round   5/5 [####################]" in out.stdout  # the progress display, one line per round


def _cli(capsys, *args) -> tuple[int, str]:
    from ranksafe.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_verify_files_and_step_directories(tmp_path, capsys):
    import torch

    import ranksafe

    good = ranksafe.atomic_save({"w": torch.ones(1000)}, tmp_path / "good.pth")
    torch.save({"w": torch.ones(1000)}, tmp_path / "stock.pth")
    data = bytearray((tmp_path / "good.pth").read_bytes())
    data[len(data) // 2] ^= 4
    (tmp_path / "flipped.pth").write_bytes(data)
    (tmp_path / "cut.pth").write_bytes((tmp_path / "stock.pth").read_bytes()[:-30])
    code, out = _cli(capsys, "verify", good)
    assert code == 0 and out.startswith(f"OK {good}: ") and out.endswith("KiB, crc32 verified\n")
    code, out = _cli(capsys, "verify", str(tmp_path / "stock.pth"))
    assert code == 0 and "no ranksafe footer" in out
    (tmp_path / "preds.csv").write_text("x,y\n1,2\n")  # torch.load fails on it with IndexError
    for bad in ("flipped.pth", "cut.pth", "missing.pth", "preds.csv"):
        code, out = _cli(capsys, "verify", str(tmp_path / bad))
        assert code == 1 and out.startswith("BAD") and bad in out, out
    assert "not a torch checkpoint" in out

    manager = ranksafe.CheckpointManager(tmp_path / "run", keep=5)
    for step in (1, 2):
        manager.save(step, {"w": torch.full((100,), float(step))})
    step2 = manager.step_dir(2)
    code, out = _cli(capsys, "verify", step2)
    assert code == 0 and "step 2" in out and "checksums verified" in out
    code, out = _cli(capsys, "verify", str(tmp_path / "run"))  # the root, not a step: say so, not "no manifest"
    assert code == 1 and "a checkpoint root, not a step" in out and "ranksafe ls" in out, out
    state = next(p for p in os.listdir(step2) if p.endswith(".pt"))
    with open(os.path.join(step2, state), "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    code, out = _cli(capsys, "verify", step2)
    assert code == 1 and state in out and "checksum" in out

    code, out = _cli(capsys, "ls", str(tmp_path / "run"))  # sizes only: the flipped byte is not seen
    assert code == 0 and "corrupt" not in out, out
    code, out = _cli(capsys, "ls", str(tmp_path / "run"), "--deep")  # a corrupt step fails a script that checks
    lines = out.splitlines()
    assert code == 1 and "committed" in lines[1] and "corrupt" in lines[2] and "checksum" in lines[3], out

    # a crash after the manifest and before the rename leaves a sound-looking directory that is no step: was "OK"
    partial = tmp_path / "run" / ".step_00000001.ranksafe-partial"
    shutil.copytree(manager.step_dir(1), partial)
    code, out = _cli(capsys, "verify", str(partial))
    assert code == 1 and out.startswith(f"BAD {partial}: not committed: a save in progress"), out
    # a directory without a manifest: was "corrupt checkpoint .../MANIFEST.json: no manifest", where ls says incomplete
    for directory in (tmp_path / "run" / "step_00000007", tmp_path / "plain"):
        directory.mkdir()
        code, out = _cli(capsys, "verify", str(directory))
        assert code == 1 and out.startswith(f"BAD {directory}: no MANIFEST.json: not a committed step"), out
    code, out = _cli(capsys, "ls", str(tmp_path / "nothing"))  # was "not a directory"
    assert code == 1 and out.startswith(f"BAD {tmp_path / 'nothing'}: does not exist"), out


def test_doctor_under_torchrun(tmp_path):
    from tests.ranks import free_port

    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
         "-m", "ranksafe", "doctor", str(tmp_path), "--megabytes", "8"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 process(es) on 1 node(s)" in out.stdout
    assert f"{tmp_path}: shared" in out.stdout and "writers: ranks [0]" in out.stdout
    assert re.search(r"rank 0: \d+ MiB/s", out.stdout)
    assert os.listdir(tmp_path) == []  # the probes cleaned up after themselves


def test_demo_refuses_fewer_than_two_ranks(capsys):
    with pytest.raises(SystemExit) as e:
        _cli(capsys, "demo", "--ranks", "1")
    assert e.value.code == 2 and "--ranks must be at least 2" in capsys.readouterr().err


def test_doctor_refuses_a_probe_of_no_bytes(tmp_path, capsys):
    """Before: --megabytes -1 ended in torch's traceback ("zeros: Dimension size must be non-negative")."""
    for megabytes in ("0", "-1"):
        with pytest.raises(SystemExit) as e:
            _cli(capsys, "doctor", str(tmp_path), "--megabytes", megabytes)
        assert e.value.code == 2 and "--megabytes must be at least 1" in capsys.readouterr().err


def test_doctor_creates_root_or_reports_the_file_in_its_way(tmp_path, capsys):
    code, out = _cli(capsys, "doctor", str(tmp_path / "new" / "root"), "--megabytes", "1")
    assert code == 0 and re.search(r"rank 0: \d+ MiB/s", out) and os.listdir(tmp_path / "new" / "root") == []
    assert "one process: nothing to compare" in out  # no "every rank sees the same files" from one process
    (tmp_path / "file").write_text("in the way")
    code, out = _cli(capsys, "doctor", str(tmp_path / "file" / "root"))
    assert (code, out) == (1, f"BAD {tmp_path / 'file' / 'root'}: {tmp_path / 'file'} is a file, not a directory\n")


def test_doctor_of_a_url_measures_the_remote_store_and_writes_nothing_locally(tmp_path, monkeypatch, capsys):
    import fsspec

    monkeypatch.chdir(tmp_path)  # a URL taken for a path would make the folder "memory:" here
    code, out = _cli(capsys, "doctor", "memory://doctor/run", "--megabytes", "1")
    assert code == 0, out
    assert "memory://doctor/run: shared" in out and "remote storage: every rank reaches the same objects" in out
    assert re.search(r"rank 0: \d+ MiB/s", out)
    assert os.listdir(tmp_path) == [] and fsspec.filesystem("memory").ls("/doctor/run") == []
    code, out = _cli(capsys, "doctor", "nosuchscheme://bucket/run")
    assert code == 1 and "(rank 0): no file system for nosuchscheme://" in out
    assert out.startswith("BAD nosuchscheme://bucket/run: ") and out.count("\n") == 1
    assert os.listdir(tmp_path) == []


def test_doctor_under_torchrun_fails_on_every_rank_with_one_line(tmp_path):
    from tests.ranks import free_port

    (tmp_path / "file").write_text("in the way")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
         "-m", "ranksafe", "doctor", str(tmp_path / "file" / "root"), "--megabytes", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    bad = [line for line in (out.stdout + out.stderr).splitlines() if "BAD " in line]
    assert len(bad) == 1 and "is a file, not a directory" in bad[0], out.stdout + out.stderr[-3000:]
    ranks_output = out.stderr.split("torch/distributed/elastic")[0]  # what the ranks printed, before torchrun's report
    assert "Traceback" not in out.stdout + ranks_output


def test_doctor_under_torchrun_refuses_a_url_that_each_process_holds_apart(tmp_path):
    from tests.ranks import free_port

    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
         "-m", "ranksafe", "doctor", "memory://doctor/run", "--megabytes", "1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode != 0  # memory:// lives in one process: rank 1 does not see what rank 0 wrote
    bad = [line for line in (out.stdout + out.stderr).splitlines() if "BAD " in line]
    assert len(bad) == 1 and "does not see what rank 0 wrote there" in bad[0], out.stdout + out.stderr[-3000:]
    assert "verdict" not in out.stdout and os.listdir(tmp_path) == []
