"""The check that a package reaches upstream private names only through its ``compat.py`` (each integration has
one): an AST walk, so a rename upstream fails in the compat tests, naming the one place to mend."""

from __future__ import annotations

import ast
from pathlib import Path


def private_reads(tree: ast.AST, own: set[str]) -> list[str]:
    """Attributes starting with one underscore read from anything but ``self``, other than the functions in ``own``;
    and private names imported."""
    found = []
    for node in ast.walk(tree):
        private = isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        if private and ast.unparse(node.value) != "self" and node.attr not in own:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and any(a.name.startswith("_") for a in node.names):
            found.append(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
    return found


def private_reads_outside_compat(package: Path) -> dict[str, list[str]]:
    """:func:`private_reads` of every module of ``package`` but ``compat.py``, by file name, where there are any.
    The package's own functions (read as ``module._helper``) are not upstream names."""
    trees = {path.name: ast.parse(path.read_text()) for path in sorted(package.glob("*.py"))}
    own = {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    found = {name: private_reads(tree, own) for name, tree in trees.items() if name != "compat.py"}
    return {name: reads for name, reads in found.items() if reads}
