"""One RL step's learning: dense teacher-forced scores of the rollouts, alpha against the generators' top-k,
and the GRPO + TIS update of the dense policy.

Written to run unchanged under torch.distributed with FSDP2: the model is called directly (no
`.module`), the loss is normalised by the global token count (`trainer.grpo.global_token_count`),
gradients are clipped with `clip_grad_norm_` (DTensor-aware) and nothing here reads or writes state
dicts. Each rank passes its own rollouts; under FSDP every rank must run the same number of
micro-batches, since each forward and backward is a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparrow.acceptance import alpha_topk
from trainer.batch import MicroBatch, Rollout, generator_topk, micro_batches
from trainer.grpo import GRPOConfig, global_token_count, grpo_tis_loss, sampled_logprobs
from trainer.scoring import Scorer, TokenScores


@dataclass(frozen=True)
class UpdateConfig:
    """How the update runs: the loss's knobs, temperature, micro-batch size and gradient clipping."""

    grpo: GRPOConfig = GRPOConfig()
    temperature: float = 1.0
    micro_batch_size: int = 8
    max_grad_norm: float = 1.0  # 0 disables clipping


@dataclass
class Acceptance:
    """Alpha of every response token of the batch, with the KV length it was produced at."""

    alpha: torch.Tensor  # [tokens] float32
    kv_lens: torch.Tensor  # [tokens] int64


def dense_scores(
    scorer: Scorer, rollouts: Sequence[Rollout], temperature: float, micro_batch_size: int
) -> list[TokenScores]:
    """Dense teacher-forced logprobs and top-k lists of every rollout's response, in micro-batches."""
    out: list[TokenScores] = []
    for start in range(0, len(rollouts), micro_batch_size):
        chunk = rollouts[start : start + micro_batch_size]
        out += scorer.score([r.sequence for r in chunk], [r.prompt_len for r in chunk], None, temperature)
    return out


def acceptance(rollouts: Sequence[Rollout], dense: Sequence[TokenScores]) -> Acceptance:
    """Per-token alpha (lower bound from top-k lists) of the generators' distributions against the dense ones."""
    if len(rollouts) != len(dense):
        raise ValueError(f"{len(rollouts)} rollouts but {len(dense)} dense scores")
    gen_ids, gen_lps = generator_topk(rollouts)
    dense_ids = torch.cat([d.top_ids.cpu() for d in dense])
    dense_lps = torch.cat([d.top_logprobs.cpu() for d in dense])
    alpha = alpha_topk(gen_ids, gen_lps, dense_ids, dense_lps)
    return Acceptance(alpha=alpha, kv_lens=torch.cat([r.kv_lens() for r in rollouts]))


def grpo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollouts: Sequence[Rollout],
    old_logprobs: Sequence[torch.Tensor],
    advantages: torch.Tensor,
    config: UpdateConfig,
) -> dict[str, float]:
    """One optimizer step of GRPO + TIS over the batch; returns token-weighted statistics of the loss.

    `old_logprobs[i]` are the dense old policy's logprobs of rollout i's response tokens (the
    denominator of the PPO ratio and the numerator of the TIS weight).
    """
    if len(old_logprobs) != len(rollouts):
        raise ValueError(f"{len(rollouts)} rollouts but {len(old_logprobs)} old logprob rows")
    device = next(model.parameters()).device
    batches = micro_batches(rollouts, advantages, config.micro_batch_size)
    local_tokens = sum(len(r.token_ids) for r in rollouts)
    num_tokens = global_token_count(torch.tensor([float(local_tokens)], device=device))
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    loss_sum = 0.0
    for mb in batches:
        mb = mb.to(device)
        old = mb.place([old_logprobs[r] for r in mb.rows])
        loss, stats = _micro_loss(model, mb, old, config, num_tokens)
        loss.backward()
        loss_sum += float(loss.detach())
        weight = stats["tokens"]
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + (value if key == "tokens" else value * weight)
    grad_norm = _clip(model, config.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = max(totals.get("tokens", 0.0), 1.0)
    out = {key: (value if key == "tokens" else value / tokens) for key, value in totals.items()}
    out["loss"] = loss_sum
    out["grad_norm"] = grad_norm
    return out


def _micro_loss(
    model: torch.nn.Module, mb: MicroBatch, old: torch.Tensor, config: UpdateConfig, num_tokens: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits[:, :-1]
    logprobs = sampled_logprobs(logits, mb.targets, config.temperature)
    return grpo_tis_loss(logprobs, old, mb.rollout_logprobs, mb.advantages, mb.mask, config.grpo, num_tokens)


def _clip(model: torch.nn.Module, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    # An infinite bound measures the norm without scaling anything.
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    # Under FSDP2 the norm is a DTensor; its full value is the same on every rank.
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)
