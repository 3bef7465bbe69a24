"""GRPO with truncated importance sampling (TIS), the dense policy update of every RL step.

Objective per token (DESIGN.md section 1): group-normalised advantage A, ratio
r = pi_theta(x) / pi_old(x) against the dense old policy recomputed by the trainer, PPO clipping
with an asymmetric range [1 - clip_low, 1 + clip_high], no KL and no entropy term, averaged over
every response token of the global batch (token-mean). Rollouts come from a different engine
(sparse attention, other kernels), so each token's loss is also weighted by
w = min(pi_old(x) / pi_rollout(x), C), detached: truncated importance sampling.

Written for one process or many: token counts are summed across ranks when torch.distributed is
initialised, so the loss of a rank is its share of the global token mean and gradients summed by
FSDP2 or DDP give the global objective's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.scoring import scaled_logprobs


@dataclass(frozen=True)
class GRPOConfig:
    """The GRPO + TIS knobs; defaults are the paper's."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0
    adv_eps: float = 1e-6

    def __post_init__(self) -> None:
        if not 0 < self.clip_low < 1 or self.clip_high <= 0:
            raise ValueError(f"clip range must satisfy 0 < clip_low < 1 and clip_high > 0, got {self}")
        if self.tis_cap < 1:
            raise ValueError(f"tis_cap must be >= 1, got {self.tis_cap}")


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Advantages [n] of rewards [n] laid out group after group: (r - group mean) / (group std + eps).

    A group whose rewards are all equal carries no signal: its advantages are exactly zero.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a multiple of {group_size} entries, got {tuple(rewards.shape)}")
    grouped = rewards.float().view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, unbiased=False, keepdim=True)
    return ((grouped - mean) / (std + eps)).masked_fill(std == 0, 0.0).view(-1)


def global_token_count(mask: torch.Tensor) -> torch.Tensor:
    """Response tokens in the whole batch, summed over ranks when running distributed."""
    count = mask.sum().float()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count)
    return count.clamp(min=1.0)


def grpo_tis_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOConfig,
    num_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss and statistics for [batch, seq] token tensors (`advantages` [batch] or [batch, seq]).

    `logprobs` carry gradients (current policy); `old_logprobs` are the dense old policy's and
    `rollout_logprobs` the generator's for the same sampled tokens. `num_tokens` is the token count
    the mean is taken over (default: `global_token_count(mask)`), so micro-batches of one step share
    one denominator.
    """
    mask = mask.float()
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    denom = global_token_count(mask) if num_tokens is None else num_tokens
    old = old_logprobs.detach()
    ratio = torch.exp(logprobs - old)
    clipped = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    raw_weight = torch.exp(old - rollout_logprobs.detach())
    weight = raw_weight.clamp(max=config.tis_cap)
    loss = (per_token * weight * mask).sum() / denom

    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        delta = old - rollout_logprobs  # log(pi_old / pi_rollout) per sampled token
        stats = {
            "tokens": float(mask.sum()),
            "tis_clip_fraction": float(((raw_weight > config.tis_cap).float() * mask).sum() / n),
            "tis_weight_mean": float((weight * mask).sum() / n),
            # Tokens whose clipped term is the one taken: they carry no gradient this step.
            "ppo_clip_fraction": float(((clipped * advantages < ratio * advantages).float() * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            # KL(rollout || dense) on tokens sampled from the rollout policy, the k3 estimator.
            "kl_rollout_dense": float(((torch.exp(delta) - delta - 1.0) * mask).sum() / n),
        }
    return loss, stats


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities [batch, seq] of `tokens` under `logits` [batch, seq, vocab] at `temperature`.

    The caller aligns them: logits at position t score the token at t + 1. Temperature is applied
    as everywhere else (`trainer.scoring.scaled_logprobs`), so training sees what scoring saw.
    """
    return scaled_logprobs(logits, temperature).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
