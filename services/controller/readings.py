"""The values passed between the Prometheus source, the decision logic and the status page."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BinReading:
    """What Prometheus showed for one bin (None: absent or stale)."""

    p5_exact: float | None = None
    tokens_exact: float = 0.0
    p5_histogram: float | None = None
    tokens_window: float = 0.0
    probe_budget: int | None = None
    probe_p5: float | None = None
    probe_tokens: float = 0.0


@dataclass(frozen=True)
class DraftReading:
    """What Prometheus showed of one bin's speculative decoding over the window (lossless mode).

    `alpha` is the mean of sum_x min(p, q) over the drafted positions: the acceptance probability
    of one draft. `accepted` over `cycles` is the mean accepted length. The ratio of `draft_seconds` (over
    k) to `verify_seconds` is what a draft step costs relative to the verify, as the engines measured it.
    """

    alpha: float
    drafts: float
    accepted: float = 0.0
    cycles: float = 0.0
    # Timed cycles (decodes alone) and their seconds: of the k draft steps, and of the rest (the verify).
    timed_cycles: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


@dataclass(frozen=True)
class Snapshot:
    """One read of the trainer's metrics: the oldest schedule version behind them, and readings per bin.

    `trainer_steps` counts the steps the trainer recorded: a reading is new when it changed (None
    from a trainer without the counter: a reading is new when its values changed).
    """

    trainer_version: int | None  # in lossless mode: the oldest version the generators run
    bins: dict[int, BinReading] | dict[int, DraftReading]
    trainer_steps: int | None = None


@dataclass(frozen=True)
class Decision:
    """One bin's budget change and why."""

    bin: int
    old: int
    new: int
    reason: str  # raise | lower | refine | retry | repair
    p5: float | None
    detail: str


@dataclass
class BinStatus:
    """A bin as the last tick saw it."""

    bin: int
    budget: int
    state: str = "no_data"  # no_data | waiting | few_tokens | fresh | confirming | at_max
    p5: float | None = None  # the reading that decided (exact or histogram)
    estimate: float | None = None  # running mean of readings at this budget
    readings: int = 0  # distinct fresh readings since this budget was set
    noise: float | None = None  # learned scatter (RMS) of one reading around its budget's mean
    p5_exact: float | None = None
    p5_histogram: float | None = None
    tokens: float = 0.0
    source: str | None = None
    since_version: int = 0
    predicted_cheapest: int | None = None  # lossless mode: the budget predicted to pay most
    predicted_gain: float | None = None  # lossless mode: tokens per cost over dense's at the current budget


@dataclass(frozen=True)
class Proposal:
    """The outcome of one tick: budgets to publish (equal to the current ones when nothing changes)."""

    budgets: tuple[int, ...]
    decisions: list[Decision]
    bins: list[BinStatus]

    @property
    def changed(self) -> bool:
        """True when any budget moved."""
        return bool(self.decisions)
