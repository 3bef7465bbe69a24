"""Where a process's wall time goes: named phases accumulated per interval (an RL step, a scrape window).

    timer = PhaseTimer(("reward", "score", "update"))
    with timer.phase("reward"):
        ...
    split = timer.take()   # {"reward": s, "score": s, "update": s, "other": s}; the next interval starts now

Every instant between two `take`s is charged to exactly one name: the innermost open phase, or `other`
when none is open. A phase opened inside another pauses the outer one (its time is the inner one's
alone), so nesting is allowed and the parts never overlap. The clock is integer nanoseconds, so the
parts of an interval add up to its length exactly (`take_ns`); `take` gives them in seconds.

A timer belongs to the thread that made it: a phase opened from another thread, or phases closed out of
order, raise `PhaseError` (time on two threads at once has no single owner and would not sum).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

OTHER = "other"  # the time no phase was open: the remainder that makes the parts sum to the interval
NS_PER_S = 1_000_000_000


class PhaseError(RuntimeError):
    """A phase used in a way that would make the split ambiguous (another thread, out-of-order close)."""


class PhaseTimer:
    """Accumulates wall time per named phase over an interval that `take` closes."""

    def __init__(self, phases: Iterable[str] = (), clock: Callable[[], int] = time.monotonic_ns) -> None:
        names = tuple(phases)
        if OTHER in names:
            raise ValueError(f"{OTHER!r} is the remainder, not a phase of its own")
        self.phases = names  # the names `phase` takes, each reported in every split (0 when not entered)
        self._clock = clock
        self._owner = threading.get_ident()
        self._open: list[str] = []
        self._ns: dict[str, int] = {}
        self._start = self._mark = clock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the block's time to `name` (less any phase opened inside it)."""
        if threading.get_ident() != self._owner:
            raise PhaseError(f"phase {name!r} opened from another thread than the timer's")
        if name not in self.phases:
            raise ValueError(f"phase {name!r} is not one of this timer's {self.phases}")
        self._charge()
        self._open.append(name)
        depth = len(self._open)
        try:
            yield
        finally:
            if len(self._open) != depth or self._open[-1] != name:
                raise PhaseError(f"phase {name!r} closed while {self._open[depth:]} inside it are still open")
            self._charge()
            self._open.pop()

    def timed(self, name: str, call: Callable) -> Callable:
        """`call`, each of its calls charged to `name`."""

        def run(*args, **kwargs):
            with self.phase(name):
                return call(*args, **kwargs)

        return run

    def _charge(self) -> None:
        now = self._clock()
        if self._open:
            top = self._open[-1]
            self._ns[top] = self._ns.get(top, 0) + now - self._mark
        self._mark = now

    def take_ns(self) -> dict[str, int]:
        """Close the interval: nanoseconds per phase and `other`, summing to its length exactly; a new one starts.

        Phases still open are charged up to now and go on into the next interval.
        """
        self._charge()
        now = self._mark
        parts = {name: 0 for name in self.phases}
        for name, ns in self._ns.items():
            parts[name] = parts.get(name, 0) + ns
        parts[OTHER] = (now - self._start) - sum(parts.values())
        self._ns = {}
        self._start = now
        return parts

    def take(self) -> dict[str, float]:
        """`take_ns` in seconds."""
        return {name: ns / NS_PER_S for name, ns in self.take_ns().items()}
