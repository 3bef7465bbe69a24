"""Exact speculative sampling: drafts from the sparse actor q, verified against the dense policy p.

Leviathan et al. 2023 / Chen et al. 2023: a draft x ~ q is accepted with probability
min(1, p(x) / q(x)); at the first rejection the token is drawn from norm(max(0, p - q)); when every
draft is accepted a bonus token is drawn from p at the next position. Every emitted token is then
distributed exactly as p, whatever q is. The acceptance probability of one draft is
sum_x min(p(x), q(x)): the project's alpha (`sparrow.acceptance`), here computed from full distributions.

Torch math only (no engine, no I/O; torch imported where tensors are made), so that the reference
engine, a future vLLM path and the cost model share one rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are made: the cost model needs none
    import torch

MIN_DRAFTS = 1
MAX_DRAFTS = 16


@dataclass
class Verdict:
    """One verify step of a batch: `accepted` [b] drafts kept per row, `next_token` [b] the token that follows
    them (the correction at the first rejection, or the bonus), `alpha` [b, k] sum_x min(p, q) per draft."""

    accepted: torch.Tensor
    next_token: torch.Tensor
    alpha: torch.Tensor


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` [..., vocab] cut to the most likely tokens whose mass reaches `top_p` (at least one), renormalised.

    The same nucleus rule as the engine's sampler; applied to both p and q, so the output follows p's nucleus.
    """
    if top_p >= 1.0:
        return probs
    import torch

    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    mask = torch.zeros_like(keep).scatter(-1, order, keep)
    kept = probs * mask
    return kept / kept.sum(-1, keepdim=True)


def accepts(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The acceptance rule: keep a draft when u < p(x) / q(x), u ~ U[0, 1), i.e. with probability min(1, p/q).

    Written as u * q < p so that q(x) = 0 (never drafted) and p(x) = 0 need no special case.
    """
    return u * q_draft < p_draft


def verify_drafts(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None = None
) -> Verdict:
    """Rejection-sample one cycle: p [b, k + 1, vocab] the dense distributions at the k + 1 verified positions,
    q [b, k, vocab] the draft distributions the k drafts [b, k] were drawn from (both after temperature and top_p).

    p[:, j] and q[:, j] are the distributions of draft j; p[:, k] is the bonus position's.
    """
    import torch

    b, k = drafts.shape
    rows = torch.arange(b, device=drafts.device)
    p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_draft = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(b, k, generator=generator, device=p.device, dtype=p.dtype)
    ok = accepts(p_draft, q_draft, u)
    accepted = ok.long().cumprod(-1).sum(-1)  # drafts kept before the first rejection
    # Past the last draft q is zero, so the "residual" there is p itself: the bonus token.
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, accepted]
    p_next = p[rows, accepted]
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # A rejection where p <= q everywhere can only come from rounding (then p == q): draw from p.
    residual = torch.where(mass > 0, residual, p_next)
    next_token = torch.multinomial(residual, 1, generator=generator)[:, 0]
    alpha = torch.minimum(p[:, :k], q).sum(-1)
    return Verdict(accepted, next_token, alpha)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one cycle of `k` drafts emits on average at i.i.d. acceptance `alpha`: (1 - a^(k+1)) / (1 - a)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if not MIN_DRAFTS <= k <= MAX_DRAFTS:
        raise ValueError(f"speculative_tokens must be in [{MIN_DRAFTS}, {MAX_DRAFTS}], got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
