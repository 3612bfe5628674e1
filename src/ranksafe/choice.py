"""The base of ranksafe's modes and outcomes: Enums whose members are their strings.

A member equals, hashes, formats and serialises (JSON, the store's pickles) as its value, so a user may pass
``storage="shared"`` or ``Storage.SHARED`` alike, and code that compares an outcome with a string keeps working.
A value outside the Enum raises ``ValueError`` naming the values it takes.
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """One of a fixed set of strings, as a type (``enum.StrEnum`` from Python 3.11 on, which 3.10 lacks)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> Choice:
        takes = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{cls.__name__} takes {takes}, not {value!r}")
