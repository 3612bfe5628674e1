"""``RankSafe(checkpoint_dir=...)`` under Lightning's ModelParallelStrategy (FSDP2 on CPU, gloo, 2 ranks): each epoch's
step holds sharded weights and optimizer states through DCP, committed by its manifest; a resume restores them
exactly, with RankSafe or with stock Lightning, whose sharded layout the step shares.

Lightning's FSDPStrategy (FSDP1) refuses CPU accelerators: only ModelParallelStrategy runs here.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_lightning_ddp import finish, start

SCRIPT = Path(__file__).parent / "lightning_scripts" / "model_parallel.py"
FILES = [".metadata", "MANIFEST.json", "__0_0.distcp", "__1_0.distcp", "meta.pt"]


def _report(out: Path, *flags: str) -> dict:
    run = finish(start(out, *flags, script=SCRIPT))
    assert not run.hung and run.proc.returncode == 0, run.output[-4000:]
    return json.loads((out / "rank0.json").read_text())


def test_model_parallel_steps_commit_sharded_state_and_resume_it_exactly(tmp_path):
    first = _report(tmp_path, "--epochs", "2", "--async-save")
    assert first["steps"] == [[4, "committed", FILES], [8, "committed", FILES]]
    resumed = _report(tmp_path, "--epochs", "3", "--resume")
    assert resumed["ckpt_path"] == str(tmp_path / "managed" / "step_00000008")
    assert resumed["seen"]["start 8"] == first["seen"]["end 8"]  # every weight and optimizer state, gathered
    assert [s[0] for s in resumed["steps"]] == [8, 12]  # keep=2
    stock = _report(tmp_path / "stock", "--epochs", "4", "--stock-from", str(tmp_path / "managed" / "step_00000012"))
    assert stock["seen"]["start 12"] == resumed["seen"]["end 12"]


def test_model_parallel_full_checkpoints_resume_into_the_strategys_model_and_optimizer(tmp_path):
    """``save_distributed_checkpoint=False``: the steps hold one full ``state.pt``. The strategy loads the model's and
    the optimizers' states inside its own ``load_checkpoint`` (its ``load_model_state_dict`` does nothing), so a
    resume from a step must load them there too."""
    first = _report(tmp_path, "--epochs", "2", "--full")
    full = ["MANIFEST.json", "state.pt"]
    assert first["steps"] == [[4, "committed", full], [8, "committed", full]]
    resumed = _report(tmp_path, "--epochs", "3", "--full", "--resume")
    assert resumed["ckpt_path"] == str(tmp_path / "managed" / "step_00000008" / "state.pt")
    assert resumed["seen"]["start 8"] == first["seen"]["end 8"]  # every weight and optimizer state, gathered


def test_the_sharded_metadata_file_has_lightnings_name():
    import lightning
    from lightning.fabric.utilities import load

    from ranksafe.lightning import compat

    where = f"Lightning {lightning.__version__}: lightning.fabric.utilities.load._METADATA_FILENAME"
    assert getattr(load, "_METADATA_FILENAME", None) == compat.SHARDED_METADATA, f"{where} changed or is gone"
