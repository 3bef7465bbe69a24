"""Checks of one incoming trajectory: the reason it cannot be trained on, or None.

Structure first (lengths, ids, values, versions), then what it claims about its group (known,
sample index in range, the prompt the trainer enqueued, no longer than the group allows). The
checks are vectorised with numpy: a long trajectory carries tens of thousands of positions of 20
alternatives each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.api.sparrow.v1 import rollout_pb2
from services.trainer.ledger import GroupRecord

MAX_ID_CHARS = 256


@dataclass(frozen=True)
class Limits:
    """What a well-formed trajectory must respect."""

    vocab_size: int
    top_k: int  # configured top-k (20); lists must have min(top_k, vocab_size) entries
    logprob_tolerance: float = 1e-3  # logprobs up to this above 0 pass (float rounding in engines)

    @property
    def expected_k(self) -> int:
        return min(self.top_k, self.vocab_size)


def check_structure(t: rollout_pb2.Trajectory, limits: Limits, latest_policy: int, latest_adapter: int) -> str | None:
    """Everything that can be checked without the group: ids, lengths, values, versions."""
    if not t.trajectory_id or len(t.trajectory_id) > MAX_ID_CHARS:
        return f"trajectory_id must be 1 to {MAX_ID_CHARS} characters"
    if not t.group_id or len(t.group_id) > MAX_ID_CHARS:
        return f"group_id must be 1 to {MAX_ID_CHARS} characters"
    n = len(t.token_ids)
    if n == 0:
        return "no generated tokens"
    if not t.prompt_token_ids:
        return "empty prompt_token_ids"
    lengths = {"logprobs": len(t.logprobs), "top_logprobs": len(t.top_logprobs), "kv_budgets": len(t.kv_budgets)}
    for name, length in lengths.items():
        if length != n:
            return f"length mismatch: {n} token_ids but {length} {name}"
    for name, ids in (("token_ids", t.token_ids), ("prompt_token_ids", t.prompt_token_ids)):
        arr = np.asarray(ids, dtype=np.int64)
        if arr.min() < 0 or arr.max() >= limits.vocab_size:
            return f"{name} outside the vocabulary [0, {limits.vocab_size})"
    lps = np.asarray(t.logprobs, dtype=np.float64)
    if not np.isfinite(lps).all():
        return "logprobs must be finite (NaN or inf found)"
    if lps.max() > limits.logprob_tolerance:
        return f"logprobs must be <= 0, found {lps.max():.6g}"
    if np.asarray(t.kv_budgets, dtype=np.int64).min() < 0:
        return "kv_budgets must be >= 0"
    reason = _check_top(t, limits)
    if reason is not None:
        return reason
    v = t.versions
    if v.policy_version < 0 or v.adapter_version < 0 or v.schedule_version < 0:
        return "versions must be >= 0"
    if v.policy_version > latest_policy:
        return f"policy version {v.policy_version} is from the future (latest published is {latest_policy})"
    if v.adapter_version > latest_adapter:
        return f"adapter version {v.adapter_version} is from the future (latest published is {latest_adapter})"
    return None


def _check_top(t: rollout_pb2.Trajectory, limits: Limits) -> str | None:
    k = limits.expected_k
    for pos, top in enumerate(t.top_logprobs):
        if len(top.token_ids) != len(top.logprobs):
            return f"top_logprobs at position {pos}: {len(top.token_ids)} ids but {len(top.logprobs)} logprobs"
        if len(top.token_ids) != k:
            return f"top_logprobs at position {pos} has {len(top.token_ids)} entries, expected {k}"
    ids = np.asarray([list(top.token_ids) for top in t.top_logprobs], dtype=np.int64).reshape(len(t.top_logprobs), k)
    lps = np.asarray([list(top.logprobs) for top in t.top_logprobs], dtype=np.float64).reshape(ids.shape)
    if ids.min() < 0 or ids.max() >= limits.vocab_size:
        return f"top_logprobs ids outside the vocabulary [0, {limits.vocab_size})"
    # -inf is a zero probability (fewer than k tokens possible); NaN and +inf are never valid.
    if np.isnan(lps).any() or np.isposinf(lps).any():
        return "top_logprobs must not hold NaN or +inf"
    if lps.max() > limits.logprob_tolerance:
        return f"top_logprobs must be <= 0, found {lps.max():.6g}"
    if k > 1:
        rising = np.nonzero((lps[:, 1:] > lps[:, :-1]).any(axis=1))[0]
        if rising.size:
            return f"top_logprobs at position {int(rising[0])} are not sorted most likely first"
        ordered = np.sort(ids, axis=1)
        repeated = np.nonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))[0]
        if repeated.size:
            return f"top_logprobs at position {int(repeated[0])} repeat a token id"
    return None


def check_against_group(t: rollout_pb2.Trajectory, group: GroupRecord) -> str | None:
    """What the trajectory claims about its group, against what the trainer enqueued."""
    if not 0 <= t.sample_index < group.n:
        return f"sample_index {t.sample_index} outside [0, {group.n}) of group {group.group_id}"
    if tuple(t.prompt_token_ids) != group.prompt_token_ids:
        return f"prompt_token_ids differ from the prompt enqueued for group {group.group_id}"
    if len(t.token_ids) > group.max_new_tokens:
        return f"{len(t.token_ids)} generated tokens exceed the group's max_new_tokens {group.max_new_tokens}"
    return None
