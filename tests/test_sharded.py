"""Sharded state: the checks ranksafe runs on the files of a step that every rank wrote its part of."""

from __future__ import annotations

import os

import torch

import ranksafe
from ranksafe import commit
from ranksafe.checkpoint import CheckpointManager


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
