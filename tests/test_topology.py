"""Topology from launcher variables, and the process group taking precedence over them."""

from __future__ import annotations

import pytest

import ranksafe
from tests.ranks import LAUNCH_VARS, run_ranks


@pytest.fixture
def clean_env(monkeypatch):
    for var in (*LAUNCH_VARS, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_one_process_without_launcher(clean_env):
    assert (ranksafe.rank(), ranksafe.world_size(), ranksafe.local_rank(), ranksafe.node_rank()) == (0, 1, 0, 0)
    assert ranksafe.is_main() and ranksafe.is_local_main()


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_RANK": "2"}, (5, 8, 1, 2)),  # torchrun
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1"}, (3, 4, 1, 1)),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, (2, 6, 0, 0)),
    ],
)
def test_launcher_variables(clean_env, env, expected):
    for k, v in env.items():
        clean_env.setenv(k, v)
    assert (ranksafe.rank(), ranksafe.world_size(), ranksafe.local_rank(), ranksafe.node_rank()) == expected
    assert ranksafe.is_main() is (expected[0] == 0)
    assert ranksafe.is_local_main() is (expected[2] == 0)


def _wrong_env(rank):
    import os

    os.environ["RANK"] = "0"  # what `accelerate` or a careless launcher script leaves in every process
    os.environ["WORLD_SIZE"] = "1"
    return ranksafe.rank(), ranksafe.world_size(), ranksafe.is_main()


def test_process_group_beats_a_wrong_rank_variable():
    assert run_ranks(_wrong_env, 2).values == [(0, 2, True), (1, 2, False)]
