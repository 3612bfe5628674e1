"""Griffe extension for the API reference: render Sphinx roles in docstrings as inline code.

ranksafe's docstrings use Sphinx roles (``:class:`RankFailure```, ``:func:`~ranksafe.save```), which
mkdocstrings would print literally. Each role becomes a code span holding its target (the last dotted part
for ``~``-prefixed targets, as Sphinx shows them).
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRoles(Extension):
    """Rewrite the roles of every docstring once the object tree is complete."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
