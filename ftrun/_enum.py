"""``StrEnum``: the base of ftrun's documented state Enums (Python 3.10 has no enum.StrEnum)."""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """A ``str`` Enum that is its value wherever a string goes: ``str()``, f-strings, JSON
    and dict keys (it hashes as its value), so serialised states stay the plain strings."""

    def __str__(self) -> str:
        return str(self.value)

    __hash__ = str.__hash__
