"""Drawing prompts from several sources, mixed by a ratio each, in a deterministic, resumable order.

Each draw picks a source with probability ratio / sum of ratios, then that source's next row in an
epoch order (a fresh shuffle of its rows every pass, seeded by (seed, source, epoch)), so every row
of a source is drawn once per epoch whatever the mix. The state is plain data for checkpoints.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Source(Generic[T]):
    """One source of the mix: its name, its items, its ratio."""

    name: str
    items: Sequence[T]
    ratio: float = 1.0


class Mix(Generic[T]):
    """An endless stream of (source index, item) from sources mixed by ratio."""

    def __init__(self, sources: Sequence[Source[T]], seed: int = 0, shuffle: bool = True) -> None:
        if not sources:
            raise ValueError("a mix needs at least one source")
        for s in sources:
            if not s.items:
                raise ValueError(f"source {s.name!r} has no items")
            if not s.ratio > 0:
                raise ValueError(f"source {s.name!r}: ratio must be above 0, got {s.ratio}")
        self.sources = list(sources)
        self.seed = seed
        self.shuffle = shuffle
        self._weights = [s.ratio for s in self.sources]
        self.rng = random.Random(seed)
        self._epoch = [0] * len(self.sources)
        self._offset = [0] * len(self.sources)
        self._orders = [self._order(i, 0) for i in range(len(self.sources))]

    def _order(self, source: int, epoch: int) -> list[int]:
        order = list(range(len(self.sources[source].items)))
        if self.shuffle:
            random.Random(f"{self.seed}/{source}/{epoch}").shuffle(order)
        return order

    def next(self) -> tuple[int, T]:
        """The next (source index, item)."""
        i = 0 if len(self.sources) == 1 else self.rng.choices(range(len(self.sources)), self._weights)[0]
        if self._offset[i] == len(self._orders[i]):
            self._epoch[i] += 1
            self._offset[i] = 0
            self._orders[i] = self._order(i, self._epoch[i])
        item = self.sources[i].items[self._orders[i][self._offset[i]]]
        self._offset[i] += 1
        return i, item

    def state(self) -> dict:
        """Where the stream stands: the source choice RNG and each source's epoch and offset."""
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "epoch": list(self._epoch), "offset": list(self._offset)}

    def restore(self, state: dict) -> None:
        """Continue from `state()` (of a mix over the same sources)."""
        if len(state["epoch"]) != len(self.sources):
            raise ValueError(f"the saved mix had {len(state['epoch'])} sources, this one has {len(self.sources)}")
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self._epoch = [int(e) for e in state["epoch"]]
        self._offset = [min(int(o), len(s.items)) for o, s in zip(state["offset"], self.sources, strict=True)]
        self._orders = [self._order(i, e) for i, e in enumerate(self._epoch)]
