"""Rollouts as the learner sees them, and the padded tensors one forward pass over them needs.

A row is prompt + response, right-padded. Logits at position t score the token at t + 1, so every
per-token tensor has one column fewer than the rows: response token i of a row whose prompt has P
tokens sits at column P - 1 + i. Plain data in, tensors out: the service converts its wire
messages to `Rollout`s, and this module knows nothing of gRPC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rollout:
    """One sampled response with what the generator reported about each of its tokens."""

    group_id: str
    sample_index: int
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # the generator's logprob of each sampled token
    top_ids: tuple[tuple[int, ...], ...]  # the generator's top-k ids per position, most likely first
    top_logprobs: tuple[tuple[float, ...], ...]
    kv_budgets: tuple[int, ...] = ()
    policy_version: int = 0
    schedule_version: int = 0
    probe: bool = False  # generated under a probe request (kv_budgets are the probe's where it applied)
    adapter_version: int = 0  # the DistillSparse adapter that served it (0: none)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def sequence(self) -> list[int]:
        """Prompt and response as one list of ids."""
        return [*self.prompt_ids, *self.token_ids]

    def kv_lens(self) -> torch.Tensor:
        """KV length at which each response token was produced: prompt length + its position in the response."""
        return torch.arange(self.prompt_len, self.prompt_len + len(self.token_ids), dtype=torch.long)


@dataclass
class MicroBatch:
    """Padded tensors of some rollouts of a batch (`rows` are their indices in it)."""

    rows: list[int]
    input_ids: torch.Tensor  # [b, T] int64
    attention_mask: torch.Tensor  # [b, T] int64
    targets: torch.Tensor  # [b, T - 1] the token each column's logits score
    mask: torch.Tensor  # [b, T - 1] float, 1 on response tokens
    rollout_logprobs: torch.Tensor  # [b, T - 1] float, 0 off the mask
    advantages: torch.Tensor  # [b] float
    prompt_lens: list[int]
    response_lens: list[int]

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same micro-batch on `device`."""
        moved = {
            name: getattr(self, name).to(device)
            for name in ("input_ids", "attention_mask", "targets", "mask", "rollout_logprobs", "advantages")
        }
        return MicroBatch(rows=self.rows, prompt_lens=self.prompt_lens, response_lens=self.response_lens, **moved)

    def place(self, per_row: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-row response values (row i: [response_len]) laid out as a [b, T - 1] tensor, 0 elsewhere."""
        out = torch.zeros(self.targets.shape, dtype=torch.float32, device=self.targets.device)
        for i, values in enumerate(per_row):
            start = self.prompt_lens[i] - 1
            out[i, start : start + self.response_lens[i]] = values.to(out.device, torch.float32)
        return out


def collate(rollouts: Sequence[Rollout], advantages: torch.Tensor, rows: Sequence[int]) -> MicroBatch:
    """The micro-batch of `rollouts[r] for r in rows`, padded to its longest row."""
    picked = [rollouts[r] for r in rows]
    if not picked:
        raise ValueError("a micro-batch needs at least one rollout")
    for r in picked:
        if not r.prompt_ids or not r.token_ids:
            raise ValueError(f"rollout {r.group_id}/{r.sample_index} has an empty prompt or response")
        if len(r.logprobs) != len(r.token_ids):
            raise ValueError(
                f"rollout {r.group_id}/{r.sample_index}: {len(r.logprobs)} logprobs for {len(r.token_ids)} tokens"
            )
    width = max(r.prompt_len + len(r.token_ids) for r in picked)
    b = len(picked)
    ids = torch.zeros(b, width, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width - 1)
    rollout_lp = torch.zeros(b, width - 1)
    for i, r in enumerate(picked):
        n = r.prompt_len + len(r.token_ids)
        ids[i, :n] = torch.as_tensor(r.sequence, dtype=torch.long)
        attn[i, :n] = 1
        start = r.prompt_len - 1
        mask[i, start : start + len(r.token_ids)] = 1.0
        rollout_lp[i, start : start + len(r.token_ids)] = torch.as_tensor(r.logprobs, dtype=torch.float32)
    return MicroBatch(
        rows=list(rows),
        input_ids=ids,
        attention_mask=attn,
        targets=ids[:, 1:].clone(),
        mask=mask,
        rollout_logprobs=rollout_lp,
        advantages=advantages[list(rows)].float(),
        prompt_lens=[r.prompt_len for r in picked],
        response_lens=[len(r.token_ids) for r in picked],
    )


def plan_micro_batches(lengths: Sequence[int], max_seqs: int, max_tokens: int = 0) -> list[list[int]]:
    """Row indices of each micro-batch for rows of `lengths` tokens (prompt + response).

    `max_tokens` 0: rows in order, `max_seqs` at a time (padding to the longest of each). Otherwise
    a token budget: rows sorted by length, each micro-batch as many neighbours as fit in
    `max_tokens` padded tokens (rows x its longest) and `max_seqs` rows, so padding stays small; a
    row longer than the budget goes alone. The loss's denominator is the batch's token count, so
    how rows are grouped changes nothing but memory and speed.
    """
    if max_seqs < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {max_seqs}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens_per_microbatch must be >= 0, got {max_tokens}")
    if not max_tokens:
        return [list(range(start, min(start + max_seqs, len(lengths)))) for start in range(0, len(lengths), max_seqs)]
    plan: list[list[int]] = []
    current: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (lengths[r], r)):
        # Sorted ascending, so this row is the longest of the micro-batch it joins.
        if current and (len(current) >= max_seqs or (len(current) + 1) * lengths[row] > max_tokens):
            plan.append(current)
            current = []
        current.append(row)
    if current:
        plan.append(current)
    return plan


def micro_batches(
    rollouts: Sequence[Rollout], advantages: torch.Tensor, size: int, max_tokens: int = 0
) -> list[MicroBatch]:
    """The batch cut into micro-batches (`plan_micro_batches`: `size` rows at most, `max_tokens` padded tokens)."""
    if advantages.shape != (len(rollouts),):
        raise ValueError(f"{len(rollouts)} rollouts but advantages of shape {tuple(advantages.shape)}")
    lengths = [r.prompt_len + len(r.token_ids) for r in rollouts]
    return [collate(rollouts, advantages, rows) for rows in plan_micro_batches(lengths, size, max_tokens)]


def generator_topk(rollouts: Sequence[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
    """The generators' top-k lists of every response token, stacked: ids and logprobs [tokens, k].

    Rows shorter than the longest are padded with id -1 and logprob -inf, which add nothing to alpha.
    """
    rows = [(ids, lps) for r in rollouts for ids, lps in zip(r.top_ids, r.top_logprobs, strict=True)]
    k = max((len(ids) for ids, _ in rows), default=0)
    out_ids = torch.full((len(rows), k), -1, dtype=torch.long)
    out_lps = torch.full((len(rows), k), float("-inf"), dtype=torch.float32)
    for i, (ids, lps) in enumerate(rows):
        out_ids[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        out_lps[i, : len(lps)] = torch.as_tensor(lps, dtype=torch.float32)
    return out_ids, out_lps


# A rank with fewer micro-batches than the busiest one pads with passes over this 2-token rollout.
PAD_ROLLOUT = Rollout("", 0, (0,), (0,), (0.0,), (), ())


def pad_batch(device: torch.device) -> MicroBatch:
    """A 2-token micro-batch whose one response token carries no weight: a rank's padding pass."""
    return collate([PAD_ROLLOUT], torch.zeros(1), [0]).to(device)
