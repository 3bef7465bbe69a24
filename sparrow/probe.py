"""Probe requests: a share of new sequences decoded at lower budgets than the schedule's.

The controller learns each bin's p5-vs-budget curve from what it observes; under a schedule that
holds, it only ever sees the current budget. A probe asks generators to run a small `share` of new
sequences at other budgets in some bins (the rest of the batch keeps the schedule), and the trainer
exports the tail statistic of those sequences separately (`PROBE_*` in `sparrow.metrics_contract`).

The wire form is the JSON object under `PROBE_KEY`: `{"schedule_version", "share", "budgets",
"expires_at"}`, `budgets[i]` null (or 0 on gRPC) keeping the schedule's budget of bin `i`. A probe
applies only to the schedule version it names and only until `expires_at` (Unix seconds).

`ProbePlan` is a probe resolved against its schedule: the budget of every bin, which need not be
non-decreasing (a probed bin may go below the one before it), under the schedule's bins, pages and
sink/local blocks.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparrow.budget import in_pages, whole_pages
from sparrow.schedule import INT32_MAX, INT64_MAX, Schedule, per_bin

if TYPE_CHECKING:
    import torch


class ProbeError(ValueError):
    """A malformed probe request or one that does not fit its schedule; one line naming the problem."""


@dataclass(frozen=True)
class Probe:
    """A probe request as the controller writes it."""

    schedule_version: int
    share: float
    budgets: tuple[int | None, ...]
    expires_at: float

    def __post_init__(self) -> None:
        # The bounds are the wire's (int64 versions, int32 budgets), as for schedules: a generator must be
        # able to report and apply what it is asked to run.
        if not _is_int(self.schedule_version) or not 0 <= self.schedule_version <= INT64_MAX:
            raise ProbeError(f"schedule_version must be an integer in [0, {INT64_MAX}], got {self.schedule_version!r}")
        if not isinstance(self.share, (int, float)) or isinstance(self.share, bool) or not 0 < self.share <= 1:
            raise ProbeError(f"share must be a number in (0, 1], got {self.share!r}")
        if not self.budgets:
            raise ProbeError("a probe needs a budget (or null) for every bin")
        for i, b in enumerate(self.budgets):
            if b is not None and (not _is_int(b) or not 0 < b <= INT32_MAX):
                raise ProbeError(f"probe budget of bin {i} must be an integer in [1, {INT32_MAX}] or null, got {b!r}")
        if not isinstance(self.expires_at, (int, float)) or isinstance(self.expires_at, bool):
            raise ProbeError(f"expires_at must be a number (Unix seconds), got {self.expires_at!r}")
        if not math.isfinite(self.expires_at):
            raise ProbeError("expires_at must be finite")

    def expired(self, now: float | None = None) -> bool:
        """True once `expires_at` has passed."""
        return (time.time() if now is None else now) >= self.expires_at

    def plan(self, schedule: Schedule | None) -> ProbePlan | None:
        """The probe resolved against `schedule`; None when it does not apply to it (another version,
        no schedule) or changes no budget. Raises ProbeError when it names budgets the schedule's
        layout cannot run (bin count, page alignment, below sink + local)."""
        if schedule is None or schedule.version != self.schedule_version:
            return None
        if len(self.budgets) != schedule.num_bins:
            raise ProbeError(
                f"the probe has {len(self.budgets)} bins, schedule v{schedule.version} {schedule.num_bins}"
            )
        floor = (schedule.sink_blocks + schedule.local_blocks) * schedule.page_size
        for i, b in enumerate(self.budgets):
            if b is None:
                continue
            if not whole_pages(b, schedule.page_size):
                raise ProbeError(
                    f"probe budget of bin {i} ({b}) is not a multiple of the page size {schedule.page_size}"
                )
            if b < floor:
                raise ProbeError(
                    f"probe budget of bin {i} ({b}) is below the {floor} tokens of the sink and local blocks"
                )
        budgets = tuple(s if b is None else b for b, s in zip(self.budgets, schedule.budgets, strict=True))
        if budgets == schedule.budgets:
            return None
        return ProbePlan(schedule, budgets, self.share, self.expires_at)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule_version": self.schedule_version,
            "share": self.share,
            "budgets": list(self.budgets),
            "expires_at": self.expires_at,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> Probe:
        if not isinstance(data, dict):
            raise ProbeError(f"a probe must be a JSON object, got {type(data).__name__}")
        fields = {"schedule_version", "share", "budgets", "expires_at"}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ProbeError(f"unknown field(s) {', '.join(map(repr, unknown))}")
        missing = sorted(fields - set(data))
        if missing:
            raise ProbeError(f"missing field(s) {', '.join(map(repr, missing))}")
        budgets = data["budgets"]
        if not isinstance(budgets, list):
            raise ProbeError(f"budgets must be a list, got {type(budgets).__name__}")
        return cls(data["schedule_version"], data["share"], tuple(budgets), data["expires_at"])

    @classmethod
    def from_json(cls, text: str | bytes) -> Probe:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProbeError(f"malformed JSON: {exc}") from None
        except RecursionError:
            raise ProbeError("malformed JSON: nested too deeply") from None
        return cls.from_dict(data)


@dataclass(frozen=True)
class ProbePlan:
    """A probe's budget for every bin of its schedule (`schedule`'s bins, pages, sink and local)."""

    schedule: Schedule
    budgets: tuple[int, ...]
    share: float
    expires_at: float

    def budget_for(self, kv_len: int) -> int:
        """The probe budget in tokens at KV length `kv_len` (uncapped, like `Schedule.budget_for`)."""
        return self.budgets[self.schedule.bin_of(kv_len)]

    def pages(self) -> list[int]:
        """Budget in pages per bin (what the attention layers take)."""
        return [in_pages(b, self.schedule.page_size) for b in self.budgets]

    def budget_tokens(self, kv_lens: torch.Tensor) -> torch.Tensor:
        """Probe budget in tokens for every KV length in `kv_lens`."""
        return per_bin(self.budgets, self.schedule.bin_width, kv_lens)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ShareCounter:
    """Picks `share` of a stream of sequences, evenly and deterministically (every 1/share-th one)."""

    def __init__(self) -> None:
        self._credit = 0.0

    def take(self, share: float) -> bool:
        """True for this sequence when it is one of the share."""
        self._credit += share
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            return True
        return False
