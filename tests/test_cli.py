"""The README's main job: `ranksafe demo` runs real processes and reports what happened."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_runs_and_shows_naive_errors_and_none_for_ranksafe():
    out = subprocess.run(
        [sys.executable, "-m", "ranksafe.cli", "demo", "--ranks", "3", "--rounds", "5"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"ranksafe \(prepare_dir.*: 0 errors in 15 rank-rounds", out.stdout)
    assert "failure raised on 3/3 ranks" in out.stdout
