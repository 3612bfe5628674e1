"""``python -m benchmarks --quick`` runs every benchmark end to end and prints one markdown table with a row for
every method and every baseline, numbers that parse, and a verdict for every target. No assertion on speed:
the numbers are whatever this machine gives; only their shape and their arithmetic are checked."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from benchmarks.report import BENCHMARKS, CUDA_SCRIPTS, HEADER, LABELS, TARGETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _table(stdout: str) -> list[dict[str, str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert tuple(header) == HEADER
    assert set(lines[1].strip("|").split("|")) == {"---"}
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True)) for line in lines[2:]]


def test_quick_run_prints_every_method_with_parseable_numbers(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--reps", "1", "--dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = _table(done.stdout)
    seen = {(row["benchmark"], row["method"]) for row in rows}
    expected = {
        (BENCHMARKS[script], label)
        for (script, _), label in LABELS.items()
        if script not in CUDA_SCRIPTS or torch.cuda.is_available()
    }
    assert seen == expected, done.stderr[-4000:]
    assert len(rows) == len(expected)  # one size, so one row per method
    for row in rows:
        low, median, high = (float(row[c]) for c in ("min ms", "median ms", "max ms"))
        assert 0 < low <= median <= high, row
        ratio, worst = float(row["median / baseline"]), float(row["max / baseline"])
        assert 0 < ratio <= worst, row
        assert float(row["size MiB"]) >= 8
        if row["extra RAM / size"] != "n/a":
            float(row["extra RAM / size"])
        if row["method"] == row["baseline"]:
            assert row["median / baseline"] == "1.00", row
    verdicts = [row["met"] for row in rows if row["target"]]
    assert len(verdicts) == len([key for key in TARGETS if key[0] not in CUDA_SCRIPTS or torch.cuda.is_available()])
    assert all(v == "met" or v.startswith("missed: ") for v in verdicts), verdicts
    assert not os.listdir(tmp_path)  # every script cleaned up what it wrote


def test_the_training_step_benchmark_times_rounds_with_and_without_saves() -> None:
    """``benchmarks/cuda_steps.py`` on the CPU with a tiny model: one round of each kind, and the saves of the round
    with saves committed (the last two kept); the timing is not checked."""
    from benchmarks.cuda_steps import measure

    result = measure("cpu", every=2, steps=4, rounds=1, width=16, layers=1)
    assert len(result["plain"]) == len(result["saving"]) == 1 and min(result["plain"] + result["saving"]) > 0
    assert result["committed"] == [8, 10]  # warm-up saves step 2; the round with saves runs steps 7 to 10
    assert result["state_mib"] > 0


def test_scale_prints_every_operation_at_every_world_size(tmp_path) -> None:
    """``benchmarks/scale.py`` with 2 and 4 processes and few repetitions: a row per world size and operation,
    numbers that parse, gloo's barrier as the 1.00 of each world size, and nothing left behind."""
    from benchmarks.scale import HEADER, OPERATIONS

    done = subprocess.run(
        [sys.executable, "benchmarks/scale.py", "--worlds", "2", "4", "--reps", "3", "--dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("|")]
    header = tuple(cell.strip() for cell in lines[0].strip("|").split("|"))
    assert header == HEADER
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[2:]]
    assert [(r["ranks"], r["operation"]) for r in rows] == [(w, op) for w in ("2", "4") for op in OPERATIONS]
    for row in rows:
        median, p90, ratio = float(row["median ms"]), float(row["p90 ms"]), float(row["median / gloo barrier"])
        assert 0 < median <= p90 and ratio > 0, row
        if row["operation"] == "gloo barrier":
            assert row["median / gloo barrier"] == "1.00"
    assert ("oversubscribed" in done.stdout) == ((os.cpu_count() or 1) < 4)
    assert not os.listdir(tmp_path)
