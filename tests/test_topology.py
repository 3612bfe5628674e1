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


def _mpi_launched(rank, root, launcher):
    import os

    import torch

    from ranksafe import topology

    if launcher == "Open MPI, one node":  # its NODE_RANK numbers the processes of a node, not the nodes
        os.environ.update(OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_NODE_RANK=str(rank))
    else:  # MPICH, two nodes of one rank: a local rank, and no node index
        os.environ.update(MPI_LOCALRANKID="0")
        topology.hostname = lambda: f"node{rank}"  # the host names tell the nodes apart, as on a cluster
        root = os.path.join(root, f"disk{rank}")  # each node its own disk
    manager = ranksafe.CheckpointManager(root)  # storage="auto": the probe needs the nodes
    manager.save(1, {"w": torch.zeros(2)})
    return topology.node_rank(), topology.local_rank(), manager.placement.writer, manager.latest()


@pytest.mark.parametrize("launcher", ["Open MPI, one node", "MPICH, two nodes"])
def test_under_mpi_launchers_the_nodes_are_learned_and_checkpoints_save(tmp_path, launcher):
    """Before: Open MPI's OMPI_COMM_WORLD_NODE_RANK was read as the node index (ValueError: node(s) [1] have no local
    rank 0), and with MPICH's local rank and no node variable every rank was taken for node 0 (the probe then failed:
    "a rank of node 0 does not see the probe file")."""
    values = run_ranks(_mpi_launched, 2, args=(str(tmp_path), launcher), timeout=60).values
    if launcher == "Open MPI, one node":
        assert values == [(0, 0, True, 1), (0, 1, False, 1)]
    else:
        assert values == [(0, 0, True, 1), (1, 0, True, 1)]
