"""``python -m benchmarks``: every benchmark in one run, one markdown table of ratios against baselines measured
in the same run, with the targets met or missed.

Each script runs in its own Python process (``--worker NAME``, which prints its rows as JSON): the extra RAM
of a method is RSS above what the process held before it, and memory an earlier benchmark freed but the
allocator kept would otherwise be reused silently and hide a later method's allocations.

    python -m benchmarks                       # 100 MiB states, 5 reps
    python -m benchmarks --sizes-mib 100 1024  # the long run
    python -m benchmarks --quick               # 8 MiB, 3 reps: a smoke test of every method

Where CUDA is available, the GPU benchmark (cuda_async) runs too, at the same sizes (``python -m benchmarks.cuda_async``
alone measures 1 and 4 GiB).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys

from .report import CUDA_SCRIPTS, SCRIPTS, table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_worker(name: str, sizes_mib: list[int], reps: int, directory: str) -> list[dict]:
    """One script's rows, measured in a fresh process; its stderr (warnings, a baseline that could not run)
    goes straight to ours."""
    command = [sys.executable, "-m", "benchmarks", "--worker", name, "--reps", str(reps), "--dir", directory]
    command += ["--sizes-mib", *map(str, sizes_mib)]
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=None, help="state sizes (default 100)")
    parser.add_argument("--reps", type=int, default=None, help="timed saves per method and size (default 5)")
    parser.add_argument("--quick", action="store_true", help="8 MiB and 3 reps unless given: a smoke test")
    parser.add_argument("--dir", default=os.getcwd(), help="where to write (default: the current directory)")
    parser.add_argument("--worker", choices=SCRIPTS + CUDA_SCRIPTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = args.sizes_mib or ([8] if args.quick else [100])
    reps = args.reps or (3 if args.quick else 5)
    directory = os.path.abspath(args.dir)
    if args.worker:
        module = importlib.import_module(f"benchmarks.{args.worker}")
        print(json.dumps(module.collect(sizes, reps, directory)))
        return
    import torch  # only for the versions in the heading; the workers do the measuring

    before = os.getloadavg()
    scripts = SCRIPTS + (CUDA_SCRIPTS if torch.cuda.is_available() else ())
    rows = [row for name in scripts for row in run_worker(name, sizes, reps, directory)]
    after = os.getloadavg()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {reps} reps per method and size, writing in {directory}; "
        f"load average {before[0]:.2f} before, {after[0]:.2f} after (1 min)\n"
    )
    print(table(rows))
    print(
        "\nms: wall time of a durable save (sync rows) or time save() blocks the caller (async rows);"
        " ratios divide by the baseline's median at the same size in the same process. extra RAM / size:"
        " highest peak RSS above the process's RSS before the save, over the state's bytes."
    )


if __name__ == "__main__":
    main()
