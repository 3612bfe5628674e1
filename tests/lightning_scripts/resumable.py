"""A DataLoader that Lightning resumes mid-epoch, for the preemption tests (as torchdata's StatefulDataLoader)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class ResumableLoader(torch.utils.data.DataLoader):
    """Its state is the batches it served in the current epoch; after ``load_state_dict`` the next iteration skips
    them (none when the epoch was over). Lightning saves the state of every loader that has ``state_dict`` and
    ``load_state_dict`` in its checkpoint and restores it when it resumes; a plain DataLoader would start the epoch's
    data again."""

    _served = 0
    _skip = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip, self._served = self._skip, 0, 0
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self._served = i + 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"served": self._served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["served"] if state["served"] < len(self) else 0
