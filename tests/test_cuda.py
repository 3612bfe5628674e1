"""The CUDA paths, run where a GPU is: ``pytest -m cuda``. Skipped (never failed) on a machine without one.

Each test mutates the GPU state right after a save returns, and checks that the file holds the values of the save:
the later steps never reach it. The state holds 16 MiB, so that a snapshot that returned before its non-blocking
copies to the host ended would let the writer read its pinned buffers while they fill (caught by the values, unless
the write happens to start late).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import ranksafe
from ranksafe import AsyncSaver, CheckpointManager
from tests.ranks import free_port, run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _gpu_state(seed: int) -> dict:
    """Mixed precision on the GPU, a host tensor beside it, a tied pair and a value that is not a tensor."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    big = torch.randn(4 << 20, device="cuda", generator=g)  # 16 MiB: a copy long enough to be caught unfinished
    return {
        "big": big,
        "tied": big.detach(),
        "bf16": torch.randn(1000, 37, device="cuda", generator=g).bfloat16(),
        "fp16": torch.randn(513, device="cuda", generator=g).half(),
        "ints": torch.arange(10, device="cuda"),
        "host": torch.ones(3),
        "epoch": seed,
    }


def _on_host(state: dict) -> dict:
    return {k: v.to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _mutate(state: dict) -> None:
    """Queued on the GPU after a save returned: must not reach the file."""
    for v in state.values():
        if isinstance(v, torch.Tensor) and v.is_cuda:
            v.add_(1)


def _same(loaded: dict, want: dict) -> list[str]:
    """The keys whose values differ (dtype and shape included)."""
    return [
        k for k, v in want.items()
        if not (torch.equal(loaded[k].cpu(), v) if isinstance(v, torch.Tensor) else loaded[k] == v)
        or (isinstance(v, torch.Tensor) and loaded[k].dtype != v.dtype)
    ]  # fmt: skip


def test_async_saver_files_hold_the_values_at_save_time(tmp_path):
    state = _gpu_state(0)
    saver = AsyncSaver()
    try:
        for step in range(3):  # the second and third reuse the pinned buffers
            want = _on_host(state)
            path = tmp_path / f"s{step}.pt"
            assert saver.save(state, path)
            _mutate(state)
            saver.wait()
            saver.check()
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            assert _same(loaded, want) == [], step
            assert loaded["tied"].data_ptr() == loaded["big"].data_ptr()
        assert saver.staging.allocations == 1
        pinned = sorted(t.is_pinned() for t in saver.staging.buffers)
        assert pinned == [False] + [True] * 5  # every staged copy of a GPU tensor; not the host one
    finally:
        saver.close()


def test_a_checkpoint_manager_from_cuda_commits_the_snapshot_and_loads_to_the_gpu(tmp_path):
    state = _gpu_state(1)
    manager = CheckpointManager(tmp_path / "ckpt", keep=2, async_save=True)
    try:
        want = _on_host(state)
        manager.save(1, state)
        _mutate(state)
        loaded = manager.load(map_location="cuda")  # waits for the commit in flight
        assert _same(loaded, want) == []
        assert loaded["big"].is_cuda and loaded["host"].is_cuda
        sync = CheckpointManager(tmp_path / "sync", keep=1)
        sync.save(2, state)
        assert _same(sync.load(), _on_host(state)) == []
    finally:
        manager.close()


def _nccl_one_rank(rank: int, root: str, port: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    out = {"backend": dist.get_backend()}
    ranksafe.barrier("nccl barrier")
    out["agree"] = ranksafe.agree(3, op="max", name="nccl agree")
    out["broadcast"] = ranksafe.broadcast({"a": 1}, name="nccl broadcast")
    state = _gpu_state(2)
    manager = CheckpointManager(os.path.join(root, "plain"), keep=1, async_save=True)
    want = _on_host(state)
    manager.save(1, state)
    _mutate(state)
    out["plain differs"] = _same(manager.load(), want)
    manager.close()
    damaged = manager.step_dir(1)
    mesh = init_device_mesh("cuda", (1,))
    full = torch.randn(8, 4, device="cuda")
    sharded = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 3}
    manager = CheckpointManager(os.path.join(root, "sharded"), keep=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.save(3, sharded)
        into = {"w": distribute_tensor(torch.zeros(8, 4, device="cuda"), mesh, [Shard(0)]), "step": 0}
        manager.load(into=into)
    out["sharded equal"] = torch.equal(into["w"].full_tensor(), full) and into["step"] == 3
    out["sharded device"] = into["w"].to_local().device.type
    with open(os.path.join(damaged, "state.pt"), "r+b") as f:  # a flipped byte: refused, not loaded
        f.seek(os.path.getsize(f.name) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        CheckpointManager(os.path.join(root, "plain"), keep=1).load()
    except ranksafe.RankSafeError as e:
        out["damaged"] = type(e).__name__
    dist.destroy_process_group()
    return out


def test_collectives_and_checkpoints_under_an_nccl_process_group(tmp_path):
    """One GPU hosts one NCCL rank: a world of one, where ranksafe's collectives take their one-process path, and the
    manager, DCP with a DTensor on the GPU, and a damaged step's error run under an NCCL process group."""
    (out,) = run_ranks(_nccl_one_rank, 1, args=(str(tmp_path), free_port()), init=False, timeout=180).values
    assert out["backend"] == "nccl" and out["agree"] == 3 and out["broadcast"] == {"a": 1}
    assert out["plain differs"] == []
    assert out["sharded equal"] and out["sharded device"] == "cuda"
    assert out["damaged"] == "CorruptCheckpoint", out


def _gloo_ranks_on_one_gpu(rank: int, root: str) -> dict:
    state = _gpu_state(10 + rank)
    manager = CheckpointManager(root, keep=2, async_save=True)
    out = {}
    for step in (1, 2):
        want = _on_host(state)
        manager.save(step, state)
        _mutate(state)
        manager.wait()
        manager.check()
        out[step] = want
    loaded = manager.load(map_location="cpu")
    manager.close()
    return {"differs": _same(loaded, out[2])}


def test_two_gloo_ranks_save_cuda_state_asynchronously(tmp_path):
    ranks = run_ranks(_gloo_ranks_on_one_gpu, 2, args=(str(tmp_path / "ckpt"),), timeout=180)
    first, second = ranks.values
    assert first["differs"] == []  # rank 0 wrote its own state, as it was when save() returned
    assert second["differs"] != []  # rank 1 loads what rank 0 saved: one writer
    assert ranksafe.list_steps(tmp_path / "ckpt")[-1].step == 2


def test_lightning_fit_on_cuda_with_async_saves_resumes(tmp_path, monkeypatch):
    pl = pytest.importorskip("lightning.pytorch")
    from ranksafe.lightning import RankSafe
    from tests.test_lightning_async import Model

    monkeypatch.chdir(tmp_path)
    trained_on: set[str] = set()

    class Device(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            trained_on.add(pl_module.device.type)

    def fit(epochs: int, **options) -> tuple[pl.Trainer, Model]:
        trainer = pl.Trainer(
            accelerator="gpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False,
            callbacks=[Device(), RankSafe(checkpoint_dir=tmp_path / "ckpt", keep=1, **options)],
        )  # fmt: skip
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
        model = Model(step_time=0)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
        return trainer, model

    _, model = fit(2, async_save=True)  # the model is back on the host after fit
    assert trained_on == {"cuda"}
    saved = torch.load(tmp_path / "ckpt" / "step_00000008" / "state.pt", map_location="cpu", weights_only=False)
    assert torch.equal(saved["state_dict"]["layer.weight"], model.layer.weight.detach().cpu())
    resumed, _ = fit(3, resume=True)
    assert resumed.ckpt_path.endswith(os.path.join("step_00000008", "state.pt")) and resumed.global_step == 12


def _full_weights(trainer) -> dict:
    """The model's weights as whole tensors on the host, whatever the strategy shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(trainer.strategy.model, options=options)
    return {k: v.detach().cpu().clone() for k, v in weights.items()}


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_lightning_fsdp_strategy_on_cuda_saves_steps_and_resumes_them(tmp_path, monkeypatch, state_dict_type):
    """Lightning's FSDPStrategy (FSDP1) needs a GPU. Its checkpoint is saved as a step, and ``resume=True`` restores
    the weights and the loops from it, through the strategy's own ``load_checkpoint`` (its ``load_model_state_dict``
    does nothing)."""
    pl = pytest.importorskip("lightning.pytorch")
    import torch.distributed as dist
    from lightning.pytorch.strategies import FSDPStrategy

    from ranksafe.lightning import RankSafe
    from tests.test_lightning_async import Model

    monkeypatch.chdir(tmp_path)

    class AdamModel(Model):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    class Weights(pl.Callback):
        start: dict | None = None
        end: dict | None = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = _full_weights(trainer)

        def on_train_end(self, trainer, pl_module) -> None:
            self.end = _full_weights(trainer)

    def fit(epochs: int, **options) -> tuple[pl.Trainer, Weights]:
        weights = Weights()
        trainer = pl.Trainer(
            accelerator="gpu", devices=1, strategy=FSDPStrategy(state_dict_type=state_dict_type), max_epochs=epochs,
            logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
            callbacks=[weights, RankSafe(checkpoint_dir=tmp_path / "ckpt", keep=1, **options)],
        )  # fmt: skip
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
        trainer.fit(AdamModel(step_time=0), torch.utils.data.DataLoader(data, batch_size=4))
        return trainer, weights

    try:
        first, trained = fit(2)
        assert first.global_step == 8
        (step,) = ranksafe.list_steps(tmp_path / "ckpt")
        assert step.step == 8 and step.status == "committed"
        # one GPU: FSDP shards nothing (NO_SHARD) and gives full tensors also for "sharded", saved as one file
        assert (tmp_path / "ckpt" / "step_00000008" / "state.pt").exists()
        resumed, restored = fit(3, resume=True)
        assert resumed.global_step == 12
        assert trained.end.keys() == restored.start.keys()
        assert all(torch.equal(trained.end[k], restored.start[k]) for k in trained.end)
        assert not all(torch.equal(restored.start[k], restored.end[k]) for k in restored.end)  # it trained on
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fastai_fit_on_cuda_with_async_saves_resumes(tmp_path):
    pytest.importorskip("fastai")
    import pandas as pd
    from fastai.tabular.all import Learner, MSELossFlat, Normalize, TabularDataLoaders

    from ranksafe.fastai import RankSafe

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=g)
    df = pd.DataFrame(x.numpy(), columns=list("abc"))
    df["y"] = x.sum(1).numpy()

    class Lin(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(3, 1)

        def forward(self, x_cat, x_cont):
            return self.l(x_cont)

    def learner(**options) -> Learner:
        dls = TabularDataLoaders.from_df(
            df, tmp_path, y_names="y", cont_names=list("abc"), procs=[Normalize], bs=8,
            valid_idx=list(range(48, 64)), device="cuda",
        )  # fmt: skip
        return Learner(dls, Lin(), loss_func=MSELossFlat(), path=tmp_path, cbs=RankSafe("ckpt", keep=1, **options))

    learn = learner(async_save=True)
    with learn.no_bar(), learn.no_logging():
        learn.fit(2, 1e-2)
    assert next(learn.model.parameters()).is_cuda
    weights = learn.model.l.weight.detach().cpu()
    steps = ranksafe.list_steps(tmp_path / "ckpt")
    assert [s.status for s in steps] == ["committed"]
    again = learner(resume=True)
    with again.no_bar(), again.no_logging():
        again.fit(2, 1e-2)  # resumed after the last epoch: nothing left to train
    assert torch.equal(again.model.l.weight.detach().cpu(), weights)
