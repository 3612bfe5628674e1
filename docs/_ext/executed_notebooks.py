"""mkdocs hook: render the tutorials from notebooks the test run has already executed.

``bash dev.sh test`` runs each notebook once, in ``tests/test_notebooks.py``, which writes the executed
copies to the folder named by ``RANKSAFE_EXECUTED_NOTEBOOKS``. With that variable set, this hook points
each tutorial page at its executed copy and tells mkdocs-jupyter not to execute those copies, so the
docs build shows the outputs the tests produced instead of running every tutorial a second time. A
notebook with no copy there (a partial run, ``pytest -k ...``) is executed by mkdocs-jupyter as usual,
as is every notebook without the variable (a plain ``mkdocs build`` or ``mkdocs serve``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import Files

log = logging.getLogger("mkdocs.hooks.executed_notebooks")
_ENV = "RANKSAFE_EXECUTED_NOTEBOOKS"


def _executed_dir() -> Path | None:
    value = os.environ.get(_ENV)
    return Path(value).resolve() if value else None


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    executed = _executed_dir()
    if executed is not None:
        jupyter = config.plugins["mkdocs-jupyter"].config
        jupyter["execute_ignore"] = [*jupyter["execute_ignore"], str(executed / "*.ipynb")]
    return config


@event_priority(-100)  # after mkdocs-jupyter wraps the notebook files: the wrapper computes its own path
def on_files(files: Files, config: MkDocsConfig) -> Files:
    executed = _executed_dir()
    if executed is None:
        return files
    for file in files:
        if file.src_uri.endswith(".ipynb"):
            copy = executed / Path(file.src_uri).name
            if copy.is_file():
                file.abs_src_path = str(copy)
            else:
                log.info("%s has no executed copy in %s: mkdocs-jupyter executes it", file.src_uri, executed)
    return files
