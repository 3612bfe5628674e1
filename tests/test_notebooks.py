"""The tutorials in ``nbs/`` run top to bottom, each as one test; their asserts are the checks.

Each notebook runs once per test run: when ``RANKSAFE_EXECUTED_NOTEBOOKS`` names a folder, the
executed notebook (outputs included) is written there, and the docs build renders those outputs
instead of running every tutorial a second time (see ``docs/_ext/executed_notebooks.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

NBS = Path(__file__).resolve().parent.parent / "nbs"
NOTEBOOKS = sorted(NBS.glob("*.ipynb"))
CELL_TIMEOUT_S = 240  # below the test timeout (300 s): a hung cell fails with its source shown


def test_the_tutorials_are_found() -> None:
    assert len(NOTEBOOKS) >= 6, f"expected the tutorials in {NBS}, found {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3")
    try:
        client.execute(cwd=str(NBS))
    except (CellExecutionError, CellTimeoutError) as exc:
        pytest.fail(f"{path.name}: {exc}", pytrace=False)
    out = os.environ.get("RANKSAFE_EXECUTED_NOTEBOOKS")
    if out:
        nbformat.write(nb, Path(out) / path.name)
