"""Scoring trajectories as they arrive: decode, pick the group's reward, hand it to the worker pool.

The rollout servicer calls `on_trajectory` for each trajectory it stores, so rewards that score one
completion a call run while the rest of the group is still generating; a batched reward (TRL's,
verl's batch form) needs the whole group, and is called once the group's last sample is stored.
The step then only collects results (`group_scores`), submitting what was not scored yet
(trajectories read back after a restart). A reward sees the decoded response, the group's ground
truth, the row's prompt, extra_info and other columns, and the reward's `[reward.options.<name>]`
(sparrow/reward_shapes.py says how each shape receives them).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from services.trainer.http_reward import is_http_reward
from services.trainer.ledger import GroupLedger, GroupRecord
from services.trainer.reward_pool import RewardPool, RewardResult
from sparrow.reward_shapes import RewardInput

_Key = tuple[str, int]  # (group id, sample index)


def reward_input(
    response: str,
    ground_truth: str | None,
    data_source: str,
    extra_info: dict[str, Any],
    columns: dict[str, Any],
    prompt: Any,
    options: dict[str, Any],
    completion_ids=(),
) -> RewardInput:
    """One completion's RewardInput; Sparrow's extras are the row's extra_info, its data_source, its
    other columns under "columns" and the reward's options under "options"."""
    extras = {**extra_info, "data_source": data_source, "columns": columns, "options": options}
    return RewardInput(
        response=response,
        ground_truth=ground_truth,
        extras=extras,
        prompt=prompt if isinstance(prompt, str) else [dict(m) for m in prompt],
        data_source=data_source,
        extra_info=dict(extra_info),
        columns=dict(columns),
        completion_ids=tuple(completion_ids),
        options=dict(options),
    )


class RewardScorer:
    """Futures of every stored trajectory's reward, by (group, sample)."""

    def __init__(
        self, pool: RewardPool, tokenizer, ledger: GroupLedger, options: dict[str, dict] | None = None, http=None
    ):
        """`http`: the HttpRewards that calls rewards given as URLs (services/trainer/http_reward.py)."""
        self.pool = pool
        self.http = http
        self.tokenizer = tokenizer
        self.ledger = ledger
        self.options = options or {}
        # A sample's call, its place in the call's results and the call's size (1, or a batched reward's group).
        self._futures: dict[_Key, tuple[Future, int, int]] = {}
        self._arrived: dict[str, dict[int, Any]] = {}  # a batched reward's group: samples stored so far
        self._lock = threading.Lock()

    def response_text(self, token_ids) -> str:
        """The completion as the reward reads it (stop and other special tokens left out)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _input(self, record: GroupRecord, trajectory) -> RewardInput:
        prompt = record.row_prompt if record.row_prompt else record.prompt_text
        return reward_input(
            self.response_text(trajectory.token_ids), record.answer, record.data_source, record.extras,
            record.columns, prompt, self.options.get(record.reward, {}), trajectory.token_ids,
        )  # fmt: skip

    def _batched(self, record: GroupRecord) -> bool:
        if is_http_reward(record.reward):
            return self.http is not None and self.http.config.batch_size > 1
        try:
            return self.pool.signature(record.reward).batched
        except ValueError:  # cannot load here: each call finds it again, and the pool counts it
            return False

    def _submit(self, record: GroupRecord, samples) -> None:
        """One call over `samples` (held under the lock): each sample's key gets the Future and its place in it."""
        inputs = [self._input(record, t) for t in samples]
        if is_http_reward(record.reward) and self.http is not None:
            future = self.http.submit_inputs(record.reward, inputs)
        else:
            future = self.pool.submit_inputs(record.reward, inputs)
        for place, t in enumerate(samples):
            self._futures[(record.group_id, t.sample_index)] = (future, place, len(samples))

    def on_trajectory(self, trajectory, record: GroupRecord) -> None:
        """A trajectory was stored: start its reward now (a batched reward: once the group is complete)."""
        key = (trajectory.group_id, trajectory.sample_index)
        batched = self._batched(record)
        with self._lock:
            if key in self._futures:
                return
            if not batched:
                self._submit(record, [trajectory])
                return
            arrived = self._arrived.setdefault(record.group_id, {})
            arrived[trajectory.sample_index] = trajectory
            if len(arrived) >= record.n:
                self._arrived.pop(record.group_id)
                self._submit(record, sorted(arrived.values(), key=lambda t: t.sample_index)[: record.n])

    def group_scores(self, record: GroupRecord, samples) -> list[RewardResult]:
        """The rewards of a group's samples, in order; waits for those still running (each bounded by its timeout)."""
        samples = list(samples)
        batched = self._batched(record)
        with self._lock:
            keys = [(record.group_id, t.sample_index) for t in samples]
            if batched:
                held = [self._futures.get(k) for k in keys]
                # The group's call must have scored exactly these samples in this order, else they are scored anew.
                one_call = all(h is not None and h[0] is held[0][0] and h[1:] == (i, len(keys))
                               for i, h in enumerate(held))  # fmt: skip
                if keys and not one_call:
                    self._submit(record, samples)
            else:
                for t, k in zip(samples, keys, strict=True):
                    if k not in self._futures:
                        self._submit(record, [t])
            chosen = [self._futures[k] for k in keys]
        results = [future.result()[place] for future, place, _ in chosen]
        self.forget([record.group_id])
        return results

    def forget(self, group_ids) -> None:
        """Drop the futures of groups that are done (trained, dropped or dead)."""
        gone = set(group_ids)
        with self._lock:
            for key in [k for k in self._futures if k[0] in gone]:
                self._futures.pop(key)
            for gid in gone:
                self._arrived.pop(gid, None)
