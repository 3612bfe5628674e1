"""What do asynchronous checkpoints cost a training loop on the GPU? Runs where CUDA is.

A small transformer trains with AdamW on random tokens, in rounds that alternate: ``steps`` steps with no save,
then ``steps`` steps with ``CheckpointManager(async_save=True).save`` every ``every`` steps (model and optimizer
state, written in the background). The overhead is the median round with saves over the median round without,
minus one: the snapshot that blocks the loop, and the background write's share of the CPU that the loop needs to
launch its kernels. Each round ends with the GPU synchronised; the writes left in flight at its end are waited for
outside the timing.

    python -m benchmarks.cuda_steps --every 100 --steps 400 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from ranksafe import CheckpointManager, list_steps


def build(device: str, width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layer = torch.nn.TransformerEncoderLayer(width, nhead=8, dim_feedforward=4 * width, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train(model, optimizer, batch: torch.Tensor, steps: int, first: int, manager, every: int) -> float:
    """Seconds for ``steps`` steps, saving every ``every`` steps through ``manager`` (None: no saves)."""
    synchronize(batch.device)
    start = time.perf_counter()
    for step in range(first, first + steps):
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if manager is not None and (step + 1) % every == 0:
            manager.save(step + 1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    synchronize(batch.device)
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: str, every: int, steps: int, rounds: int, width: int, layers: int) -> dict:
    torch.manual_seed(0)
    model, optimizer = build(device, width, layers)
    batch = torch.randn(32, 128, width, device=device)
    with tempfile.TemporaryDirectory() as root:
        manager = CheckpointManager(root, keep=2, async_save=True)
        try:
            train(model, optimizer, batch, every, 0, manager, every)  # warm-up: kernels, optimizer state, staging
            manager.wait()
            plain, saving = [], []
            first = every
            for _ in range(rounds):
                plain.append(train(model, optimizer, batch, steps, first, None, every))
                first += steps
                saving.append(train(model, optimizer, batch, steps, first, manager, every))
                first += steps
                manager.wait()
            committed = [info.step for info in list_steps(root)]
        finally:
            manager.close()
    state = sum(t.nbytes for t in model.state_dict().values())
    state += sum(t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    return {"plain": plain, "saving": saving, "state_mib": state / (1 << 20), "committed": committed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", type=int, default=100, help="steps between two saves")
    p.add_argument("--steps", type=int, default=400, help="steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds with saves, each after one without")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    r = measure(args.device, args.every, args.steps, args.rounds, args.width, args.layers)
    plain, saving = statistics.median(r["plain"]), statistics.median(r["saving"])
    print(f"{name}; torch {torch.__version__}; state {r['state_mib']:.0f} MiB (model and AdamW)")
    print("| steps per round | save every | ms per step, no saves | ms per step, saving | overhead |")
    print("|---|---|---|---|---|")
    print(
        f"| {args.steps} | {args.every} | {plain / args.steps * 1e3:.2f} | {saving / args.steps * 1e3:.2f} | "
        f"{(saving / plain - 1) * 100:+.1f}% |"
    )
    print("rounds without saves, s: " + " ".join(f"{t:.3f}" for t in r["plain"]))
    print("rounds with saves, s:    " + " ".join(f"{t:.3f}" for t in r["saving"]))


if __name__ == "__main__":
    main()
