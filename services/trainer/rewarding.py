"""Scoring trajectories as they arrive: decode, pick the group's reward, hand it to the worker pool.

The rollout servicer calls `on_trajectory` for each trajectory it stores, so rewards run while
the rest of the group is still generating; the step then only collects results (`group_scores`),
submitting what was not scored yet (trajectories read back after a restart). A reward sees the
decoded response, the group's ground truth and its extras (the row's extra_info, its data_source
and the reward's `[reward.options.<name>]`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from services.trainer.ledger import GroupLedger, GroupRecord
from services.trainer.reward_pool import RewardPool, RewardResult

_Key = tuple[str, int]  # (group id, sample index)


class RewardScorer:
    """Futures of every stored trajectory's reward, by (group, sample)."""

    def __init__(self, pool: RewardPool, tokenizer, ledger: GroupLedger, options: dict[str, dict] | None = None):
        self.pool = pool
        self.tokenizer = tokenizer
        self.ledger = ledger
        self.options = options or {}
        self._futures: dict[_Key, Future] = {}
        self._lock = threading.Lock()

    def response_text(self, token_ids) -> str:
        """The completion as the reward reads it (stop and other special tokens left out)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _submit(self, record: GroupRecord, token_ids) -> Future:
        extras = {**record.extras, "data_source": record.data_source, "options": self.options.get(record.reward, {})}
        return self.pool.submit(record.reward, self.response_text(token_ids), record.answer, extras)

    def on_trajectory(self, trajectory, record: GroupRecord) -> None:
        """A trajectory was stored: start its reward now."""
        key = (trajectory.group_id, trajectory.sample_index)
        with self._lock:
            if key in self._futures:
                return
            self._futures[key] = self._submit(record, trajectory.token_ids)

    def group_scores(self, record: GroupRecord, samples) -> list[RewardResult]:
        """The rewards of a group's samples, in order; waits for those still running (each bounded by its timeout)."""
        futures = []
        with self._lock:
            for t in samples:
                key = (record.group_id, t.sample_index)
                if key not in self._futures:
                    self._futures[key] = self._submit(record, t.token_ids)
                futures.append(self._futures[key])
        results = [f.result() for f in futures]
        self.forget([record.group_id])
        return results

    def forget(self, group_ids) -> None:
        """Drop the futures of groups that are done (trained, dropped or dead)."""
        gone = set(group_ids)
        with self._lock:
            for key in [k for k in self._futures if k[0] in gone]:
                self._futures.pop(key)
