"""The work contract between the trainer (producer) and the generators (consumers).

The trainer enqueues one `PromptGroup` per Redis Stream entry on `PROMPTS_STREAM` (one field,
`group`, holding the group's JSON). Generators read it through the consumer group
`GENERATOR_GROUP`, generate `n` samples, stream them to the trainer and ack (XACK) the entry only
after the trainer acked every trajectory of the group. Entries left pending by a generator that
died are claimed by another after an idle timeout (XAUTOCLAIM). A group that fails more than its
retry policy allows is moved to `DEAD_LETTER_STREAM` with the reason, never dropped silently.

Answers (rewards' ground truth) never travel: the trainer keeps them by `group_id`. Plain data
only: the core stays free of Redis.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

PROMPTS_STREAM = "sparrow:prompts"
GENERATOR_GROUP = "generators"
DEAD_LETTER_STREAM = "sparrow:prompts:dead"
GROUP_FIELD = "group"

MAX_PROMPT_TOKENS = 1 << 20
MAX_SAMPLES = 1024
# The decode modes a group may ask for by name (a dense group sets `dense` instead).
GROUP_DECODE_MODES = ("sparse", "speculative")
MAX_STOP_TOKENS = 64


class WorkItemError(ValueError):
    """A prompt group that cannot be generated; the message names the bad field."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of a group (RL: temperature 1.0, top_p 1.0, top-20 logprobs)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    top_logprobs: int = 20
    stop_token_ids: tuple[int, ...] = ()  # generation ends at any of these (the model's eos ids and the config's)


@dataclass(frozen=True)
class PromptGroup:
    """`n` samples to draw from one prompt, for the policy version `policy_version`.

    `attempt` counts deliveries that ended in a rejection or an error (0 on the first try); the
    generator's retry policy compares it to its limit before dead-lettering the group. `dense`: the
    samples decode with dense attention whatever the generator's schedule (evaluation rounds), beside
    the others in its batch. `evaluation`: a held-out group the trainer scores and never trains; none of
    its samples is a probe (an eval round under the current schedule measures that schedule, not a probe's).
    `decode`: how the group asks to be decoded, "sparse" or "speculative" (`GROUP_DECODE_MODES`); empty:
    the generator's own `engine.decode`. An engine that cannot serve the mode refuses the group (dead-lettered
    with the reason); dense groups say so with `dense`, which wins over `decode`.
    """

    group_id: str
    prompt_token_ids: tuple[int, ...]
    n: int
    policy_version: int
    sampling: Sampling = field(default_factory=Sampling)
    created_at: float = 0.0
    attempt: int = 0
    prompt_text: str = ""
    dense: bool = False
    evaluation: bool = False
    decode: str = ""

    def to_json(self) -> str:
        d = asdict(self)
        d["prompt_token_ids"] = list(self.prompt_token_ids)
        if not self.dense:  # absent unless set: a training group reads as it did before the field existed
            del d["dense"]
        if not self.evaluation:
            del d["evaluation"]
        if not self.decode:
            del d["decode"]
        return json.dumps(d, separators=(",", ":"))

    def to_fields(self) -> dict[str, str]:
        """The Redis Stream entry of this group."""
        return {GROUP_FIELD: self.to_json()}

    def retried(self) -> PromptGroup:
        """The same group with its attempt count advanced (for re-enqueueing)."""
        return PromptGroup(**{**self.__dict__, "attempt": self.attempt + 1})

    @classmethod
    def from_json(cls, text: str | bytes) -> PromptGroup:
        """Parse and validate; raises `WorkItemError` naming the first bad field."""
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:
            # ValueError covers bad syntax, bad UTF-8 and integers past Python's digit limit; RecursionError
            # nesting too deep for the parser.
            raise WorkItemError(f"prompt group is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise WorkItemError("prompt group must be a JSON object")
        return cls.from_dict(d)

    @classmethod
    def from_fields(cls, fields: dict[Any, Any]) -> PromptGroup:
        """Parse a Redis Stream entry's fields (bytes or str keys)."""
        raw = fields.get(GROUP_FIELD, fields.get(GROUP_FIELD.encode()))
        if raw is None:
            raise WorkItemError(f"stream entry has no '{GROUP_FIELD}' field")
        return cls.from_json(raw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PromptGroup:
        known = {
            "group_id",
            "prompt_token_ids",
            "n",
            "policy_version",
            "sampling",
            "created_at",
            "attempt",
            "prompt_text",
            "dense",
            "evaluation",
            "decode",
        }
        unknown = set(d) - known
        if unknown:
            raise WorkItemError(f"prompt group has unknown fields: {', '.join(sorted(unknown))}")
        gid = d.get("group_id")
        if not isinstance(gid, str) or not gid or len(gid) > 256:
            raise WorkItemError("group_id must be a non-empty string of at most 256 characters")
        ids = d.get("prompt_token_ids")
        if not isinstance(ids, list) or not ids or len(ids) > MAX_PROMPT_TOKENS:
            raise WorkItemError(f"group {gid}: prompt_token_ids must be a non-empty list")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise WorkItemError(f"group {gid}: prompt_token_ids must be non-negative integers")
        n = d.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SAMPLES:
            raise WorkItemError(f"group {gid}: n must be an integer in [1, {MAX_SAMPLES}]")
        pv = d.get("policy_version")
        if not isinstance(pv, int) or isinstance(pv, bool) or pv < 0:
            raise WorkItemError(f"group {gid}: policy_version must be a non-negative integer")
        attempt = d.get("attempt", 0)
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise WorkItemError(f"group {gid}: attempt must be a non-negative integer")
        created = d.get("created_at", 0.0)
        if not isinstance(created, int | float) or not _finite(created):
            raise WorkItemError(f"group {gid}: created_at must be a finite number")
        text = d.get("prompt_text", "")
        if not isinstance(text, str):
            raise WorkItemError(f"group {gid}: prompt_text must be a string")
        dense = d.get("dense", False)
        if not isinstance(dense, bool):
            raise WorkItemError(f"group {gid}: dense must be true or false")
        evaluation = d.get("evaluation", False)
        if not isinstance(evaluation, bool):
            raise WorkItemError(f"group {gid}: evaluation must be true or false")
        decode = d.get("decode", "")
        if decode not in ("", *GROUP_DECODE_MODES):
            raise WorkItemError(f"group {gid}: decode must be one of {', '.join(GROUP_DECODE_MODES)} (or absent)")
        return cls(
            group_id=gid,
            prompt_token_ids=tuple(ids),
            n=n,
            policy_version=pv,
            sampling=_sampling(gid, d.get("sampling", {})),
            created_at=float(created),
            attempt=attempt,
            prompt_text=text,
            dense=dense,
            evaluation=evaluation,
            decode=decode,
        )


def _finite(x: int | float) -> bool:
    """Whether `x` is a finite float or an int a float can hold (math.isfinite raises on larger ints)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _sampling(gid: str, d: Any) -> Sampling:
    if not isinstance(d, dict):
        raise WorkItemError(f"group {gid}: sampling must be an object")
    unknown = set(d) - {"temperature", "top_p", "max_new_tokens", "top_logprobs", "stop_token_ids"}
    if unknown:
        raise WorkItemError(f"group {gid}: sampling has unknown fields: {', '.join(sorted(unknown))}")
    stops = d.get("stop_token_ids", [])
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_TOKENS
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_PROMPT_TOKENS for t in stops)
    ):
        raise WorkItemError(f"group {gid}: sampling.stop_token_ids must be a list of at most {MAX_STOP_TOKENS} ids")
    s = Sampling(**{**d, "stop_token_ids": tuple(stops)})
    if not isinstance(s.temperature, int | float) or not (0 < s.temperature <= 10):
        raise WorkItemError(f"group {gid}: sampling.temperature must be in (0, 10]")
    if not isinstance(s.top_p, int | float) or not (0 < s.top_p <= 1):
        raise WorkItemError(f"group {gid}: sampling.top_p must be in (0, 1]")
    if (
        not isinstance(s.max_new_tokens, int)
        or isinstance(s.max_new_tokens, bool)
        or not (1 <= s.max_new_tokens <= MAX_PROMPT_TOKENS)
    ):
        raise WorkItemError(f"group {gid}: sampling.max_new_tokens must be a positive integer")
    if not isinstance(s.top_logprobs, int) or isinstance(s.top_logprobs, bool) or not (0 <= s.top_logprobs <= 20):
        raise WorkItemError(f"group {gid}: sampling.top_logprobs must be an integer in [0, 20]")
    return Sampling(float(s.temperature), float(s.top_p), s.max_new_tokens, s.top_logprobs, s.stop_token_ids)
